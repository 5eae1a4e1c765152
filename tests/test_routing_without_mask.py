"""``generate(darts_domain="auto")`` on a padded batch passed without an attention mask (issue 45, ask 6):
transformers derives the mask from the generation config's pad token, and "auto" must route on the
tokens that mask keeps, at every depth (0, 1, all) and for both routing points.

Fixture: test_compiled's realistic model (random surgery of every kind and a router fitted on the
plain model's own routing states), then padded the way Llama-3.1 releases do: a pad token that is no
stop id (``<|finetune_right_pad_id|>``) whose embedding row is a real, non-zero one. Averaging over
that padding routes other domains (checked in the fixture), so a router that counts it changes the
generated tokens. With pad = eos transformers cannot tell padding from text and attends to it; routing
then counts it too, as the attention does, at every depth.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_compiled import PICKS, PROMPTS, build_darts_dir
from test_modeling import load, tokenizer_for

PAD = 3  # the tiny tokenizer's <pad>: not a stop id (its eos is 2)
EOS = 2
NEW_TOKENS = 5
# (depth, router states); the tiny model has 2 decoder layers, so depth 2 is ``depth: all``
SETUPS = [(0, "final"), (1, "final"), (2, "final"), (1, "block_input")]


def pad_like_llama31(path):
    """The pad token becomes <pad> (config, generation config, tokenizer), distinct from eos, and its
    embedding row (zero in the tiny models: padding_idx) is drawn like every other row."""
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        with open(file) as handle:
            settings = json.load(handle)
        settings["pad_token_id"] = PAD
        with open(file, "w") as handle:
            json.dump(settings, handle, indent=2)
    tokenizer = tokenizer_for(path)
    tokenizer.pad_token = "<pad>"
    tokenizer.save_pretrained(path)
    shards = [name for name in os.listdir(path) if name.startswith("model") and name.endswith(".safetensors")]
    assert len(shards) == 1
    weights = load_file(os.path.join(path, shards[0]))
    embeddings = weights["model.embed_tokens.weight"]
    embeddings[PAD] = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(7)) * embeddings.std()
    save_file(weights, os.path.join(path, shards[0]), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    made = {}
    for depth, states in SETUPS:
        path = str(tmp_path_factory.mktemp(f"nomask{depth}{states}") / "darts")
        build_darts_dir(path, depth=depth, states=states)
        pad_like_llama31(path)
        model = load(path, trust_remote_code=True)
        assert model.config.pad_token_id == model.generation_config.pad_token_id == PAD
        assert model.darts.router.states == states
        made[depth, states] = model
    made["tokenizer"] = tokenizer_for(path)
    batch = made["tokenizer"](PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any() and (batch.input_ids[batch.attention_mask == 0] == PAD).all()
    made["batch"] = batch
    for depth, states in SETUPS:
        model = made[depth, states]
        assert model.route_domains(batch.input_ids, batch.attention_mask) == PICKS, (depth, states)
        # the padding counted (a forward without a mask attends to it) routes other domains
        assert model.route_domains(batch.input_ids) != PICKS, (depth, states)
    return made


def generate(model, **kwargs):
    return model.generate(max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("depth,states", SETUPS)
def test_auto_without_a_mask_generates_what_it_does_with_the_mask(padded, depth, states):
    model, batch = padded[depth, states], padded["batch"]
    with_mask = generate(model, **batch, darts_domain="auto")
    assert torch.equal(with_mask, generate(model, **batch, darts_domain=PICKS))  # each row its routed domain
    assert not torch.equal(with_mask, generate(model, **batch, darts_domain="none"))  # the correction shows
    assert torch.equal(generate(model, input_ids=batch.input_ids, darts_domain="auto"), with_mask)
    # a static cache (the 4-D mask generate builds for it) and per-row lists with "auto" rows
    assert torch.equal(generate(model, input_ids=batch.input_ids, darts_domain="auto", cache_implementation="static"),
                       with_mask)
    rows = ["auto", "none", "auto", "code"]
    assert torch.equal(generate(model, input_ids=batch.input_ids, darts_domain=rows),
                       generate(model, **batch, darts_domain=rows))


@pytest.mark.parametrize("depth", [0, 1])
def test_right_padding_without_a_mask_routes_like_with_it(padded, depth):
    model, tokenizer = padded[depth, "final"], padded["tokenizer"]
    tokenizer.padding_side = "right"
    try:
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "left"
    assert (batch.attention_mask[:, -1] == 0).any()
    assert model.route_domains(batch.input_ids, batch.attention_mask) == PICKS
    assert torch.equal(generate(model, input_ids=batch.input_ids, darts_domain="auto"),
                       generate(model, **batch, darts_domain="auto"))


@pytest.mark.parametrize("depth", [0, 1])
def test_pad_equal_to_eos_routes_on_every_token_as_the_attention_does(padded, depth):
    """With pad = eos transformers keeps every token (it cannot tell padding from a real end of text):
    the attention sees the padding, and so does the router, at depth 0 and with block adapters alike."""
    model, tokenizer = padded[depth, "final"], padded["tokenizer"]
    tokenizer.pad_token = "</s>"
    try:
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.pad_token = "<pad>"
    everything = torch.ones_like(batch.input_ids)
    expected = generate(model, input_ids=batch.input_ids, attention_mask=everything, darts_domain="auto",
                        pad_token_id=EOS)
    assert torch.equal(generate(model, input_ids=batch.input_ids, darts_domain="auto", pad_token_id=EOS), expected)
    picks = model.route_domains(batch.input_ids)
    assert torch.equal(generate(model, input_ids=batch.input_ids, attention_mask=everything, darts_domain=picks,
                                pad_token_id=EOS), expected)


def test_the_mask_rule_without_transformers_private_helpers_is_the_same(padded, monkeypatch):
    """Another transformers version may rename the private helpers generate's own mask comes from: the
    emitted code then applies the same rule itself (pad ids are padding unless pad is a stop id)."""
    import sys

    model, tokenizer = padded[1, "final"], padded["tokenizer"]
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    generation = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".generation"]
    expected = generation.generation_attention_mask(model, batch.input_ids, {})
    assert torch.equal(expected, batch.attention_mask)

    def renamed(*args, **kwargs):
        raise AttributeError("_prepare_generation_config")

    monkeypatch.setattr(model, "_prepare_generation_config", renamed)
    assert torch.equal(generation.generation_attention_mask(model, batch.input_ids, {}), expected)
    assert generation.generation_attention_mask(model, batch.input_ids, {"pad_token_id": EOS}) is None
