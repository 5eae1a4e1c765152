"""generate with a cache the user brings (issue 34, item 5): ``cache=`` / ``past_key_values=`` a
DynamicCache or a StaticCache, a prefix cache filled by a forward, one cache reused across chat turns.

Every result is compared with the same call without the user's cache, and the plain model's (the merge
loaded without remote code) with ``darts_domain="none"``. The fixture is test_compiled's: realistic
padding, random surgery of every kind (position table, head correction, block adapters: with ``depth``
the KV cache itself depends on the domain) and a router."""

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from test_compiled import MIXED, PICKS, PROMPTS, build_darts_dir
from test_modeling import PAD, load, tokenizer_for

DOMAINS = {"none": "none", "one domain": "code", "mixed rows": MIXED, "auto": "auto"}
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def darts(tmp_path_factory):
    made = {}
    for depth in (0, 1):
        path = str(tmp_path_factory.mktemp(f"caches{depth}") / "darts")
        plain = build_darts_dir(path, depth=depth)
        made[depth] = {"path": path, "model": load(path, trust_remote_code=True), "plain": plain}
    tokenizer = tokenizer_for(made[1]["path"])
    made["batch"] = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    made["tokenizer"] = tokenizer
    assert made[1]["model"].route_domains(made["batch"].input_ids, made["batch"].attention_mask) == PICKS
    return made


def generate(model, inputs, domain=None, **kwargs):
    if domain is not None:
        kwargs["darts_domain"] = domain
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, **kwargs)


def ids_of(tokenizer, text):
    return tokenizer(text, return_tensors="pt").input_ids


@pytest.mark.parametrize("depth", [0, 1])
def test_generate_takes_a_users_dynamic_or_static_cache_by_either_name(darts, depth):
    model, plain, batch = darts[depth]["model"], darts[depth]["plain"], darts["batch"]
    caches = {"dynamic": lambda: DynamicCache(config=model.config),
              "static": lambda: StaticCache(config=model.config, max_cache_len=batch.input_ids.shape[1] + NEW_TOKENS)}
    expected = {label: generate(model, batch, domain) for label, domain in DOMAINS.items()}
    assert torch.equal(expected["none"], generate(plain, batch))
    assert not torch.equal(expected["one domain"], expected["none"])  # the correction changes the tokens
    for kind, make in caches.items():
        for name in ("cache", "past_key_values"):
            for label, domain in DOMAINS.items():
                got = generate(model, batch, domain, **{name: make()})
                assert torch.equal(got, expected[label]), (kind, name, label)
        assert torch.equal(generate(plain, batch, cache=make()), expected["none"]), kind


@pytest.mark.parametrize("depth", [0, 1])
@torch.no_grad()
def test_prefix_cache_filled_by_a_forward_continues_like_the_whole_prompt(darts, depth):
    """The prefix's KV cache made by a forward with the same domain, then generate on the whole prompt:
    the same tokens as without the cache (generate feeds only the uncached tokens)."""
    model, plain, tokenizer = darts[depth]["model"], darts[depth]["plain"], darts["tokenizer"]
    full = ids_of(tokenizer, PROMPTS[2])
    prefix = full[:, :6]
    domains = ["none", "math", "code"] + (["auto"] if depth == 0 else [])
    for domain in domains:
        cache = model(prefix, use_cache=True, darts_domain=domain).cache
        assert cache.get_seq_length() == prefix.shape[1]
        got = generate(model, {"input_ids": full}, domain, cache=copy.deepcopy(cache))
        assert torch.equal(got, generate(model, {"input_ids": full}, domain)), domain
    plain_cache = plain(prefix, use_cache=True).cache
    assert torch.equal(generate(plain, {"input_ids": full}, cache=plain_cache),
                       generate(model, {"input_ids": full}, "none"))


@torch.no_grad()
def test_auto_with_a_prefix_cache_routes_the_whole_prompt_or_refuses(darts):
    """"auto" reads the whole prompt's states: a prefix cache made by an "auto" forward carries its
    routing sums and generate adds the rest of the prompt to them (checked: the prefix alone routes
    elsewhere); a cache filled without them is refused, never routed on the new tokens alone."""
    model, tokenizer = darts[0]["model"], darts["tokenizer"]
    full = ids_of(tokenizer, PROMPTS[2])
    prefix, suffix = full[:, :3], full[:, 3:]
    assert model.route_domains(full) == ["math"]
    assert model.route_domains(prefix) != ["math"] or model.route_domains(suffix) != ["math"]
    cache = model(prefix, use_cache=True, darts_domain="auto").cache
    assert torch.equal(generate(model, {"input_ids": full}, "auto", cache=cache),
                       generate(model, {"input_ids": full}, "math"))
    filled = model(prefix, use_cache=True, darts_domain="code").cache
    with pytest.raises(ValueError, match=r"darts_domain='auto': the cache passed to generate already holds 3 tokens, "
                                         r"but not the routing of them.*route_domains"):
        generate(model, {"input_ids": full}, "auto", cache=filled)


@pytest.mark.parametrize("depth", [0, 1])
def test_one_cache_reused_across_chat_turns(darts, depth):
    """Turn 2 appends a new message to turn 1's prompt and answer and passes turn 1's cache back: the
    same tokens as turn 2 without a cache, for the plain model and each named domain."""
    model, plain, tokenizer = darts[depth]["model"], darts[depth]["plain"], darts["tokenizer"]
    first, reply = ids_of(tokenizer, PROMPTS[0]), ids_of(tokenizer, PROMPTS[3])
    for label, domain in (("plain", None), ("none", "none"), ("math", "math"), ("code", ["code"])):
        runner = plain if label == "plain" else model
        cache = DynamicCache(config=model.config)
        turn1 = generate(runner, {"input_ids": first}, domain, cache=cache)
        assert (turn1[:, first.shape[1]:] != PAD).all()  # no row finished: turn 2 continues every token
        second = torch.cat([turn1, reply], dim=1)
        turn2 = generate(runner, {"input_ids": second}, domain, cache=cache)
        assert cache.get_seq_length() == second.shape[1] + NEW_TOKENS - 1
        assert torch.equal(turn2, generate(runner, {"input_ids": second}, domain)), label
