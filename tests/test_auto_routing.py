"""darts_domain="auto" in the emitted model (issue 16, docs/routing.md): the router picks each row's
domain from its own prompt at the prefill, and the row keeps it for the whole generation.

The fixture fits the router on the plain model's own prompt states (what the pipeline does), with
visible random surgery, so the router's choices are known (``route_domains``) and each domain changes
the output. Every "auto" result is compared with the same rows run with the routed domain named."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from loading_helpers import VISIBLE, make_tiny_darts_dir, run_concurrently
from mergekit_darts.output.export import export_surgery
from mergekit_darts.remote_code.routing import pool_prompt_states, pooled_from_sums
from mergekit_darts.repair.route.router import fit_router
from test_modeling import PAD, PROMPTS, load, tokenizer_for
from test_router import CODE, MATH, _config

DATA = Path(__file__).parent / "data"
EXPERTS = {"math": "experts/math", "code": "experts/code"}
# with the strict router (threshold 1.0: only prompts at least as typical as the domain's own mean
# similarity route), PROMPTS[1] falls back to "none" (confidence 0.28, measured) and the others route
STRICT_PICKS = ["math", "none", "code"]


def _export_with_router(path, modules, plain, tokenizer, threshold):
    pooled = {}
    with torch.no_grad():
        for name, texts in (("math", MATH), ("code", CODE)):
            batch = tokenizer(texts, return_tensors="pt", padding=True)
            pooled[name] = pool_prompt_states(plain.model(**batch).last_hidden_state, batch.attention_mask)
    export_surgery(path, modules, EXPERTS, "auto", loss="kl", router=fit_router(pooled, threshold=threshold))


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    path, strict, bare = str(root / "darts"), str(root / "strict"), str(root / "bare")
    modules = make_tiny_darts_dir(path)
    shutil.copytree(path, bare)  # the same surgery, exported without a router
    shutil.copytree(path, strict)
    plain, tokenizer = load(path), tokenizer_for(path)
    _export_with_router(path, modules, plain, tokenizer, threshold=0.02)
    _export_with_router(strict, modules, plain, tokenizer, threshold=1.0)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # really left padded
    model = load(path, trust_remote_code=True)
    return {"path": path, "strict": strict, "bare": bare, "model": model, "plain": plain, "tokenizer": tokenizer,
            "batch": batch, "picks": model.route_domains(batch.input_ids, batch.attention_mask)}


def generate(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=PAD, **kwargs)


def alone(tokenizer, prompt):
    return {"input_ids": tokenizer(prompt, return_tensors="pt").input_ids}


def picks_from_sums(model, sums):
    """The domains the router picks from routing sums (routing.prompt_state_sums) carried between calls."""
    router = model.darts.router
    with torch.no_grad():
        return [router.domains[i] if i >= 0 else "none" for i in router(pooled=pooled_from_sums(sums)).tolist()]


def test_routing_is_deterministic_and_separates_the_domains(auto):
    model, batch, tokenizer = auto["model"], auto["batch"], auto["tokenizer"]
    assert model.darts_domain == "auto"  # the exported default
    picks = auto["picks"]
    assert picks[0] == "math" and picks[1] == "code"  # a word problem and a code line
    assert model.route_domains(batch.input_ids, batch.attention_mask) == picks
    for prompt, pick in zip(PROMPTS, picks):  # left padding does not change a row's choice
        assert model.route_domains(alone(tokenizer, prompt)["input_ids"]) == [pick]


def test_mixed_batch_forward_gives_each_row_its_routed_domain(auto):
    model, batch, picks = auto["model"], auto["batch"], auto["picks"]
    with torch.no_grad():
        routed = model(**batch, darts_domain="auto").logits
        default = model(**batch).logits  # the directory's default is "auto"
        named = model(**batch, darts_domain=picks).logits
        per_row = model(**batch, darts_domain=["auto", "none", "auto"]).logits
        plain = auto["plain"](**batch).logits
    torch.testing.assert_close(routed, named, rtol=0, atol=1e-5)
    assert torch.equal(routed, default)
    torch.testing.assert_close(per_row[[0, 2]], named[[0, 2]], rtol=0, atol=1e-5)
    torch.testing.assert_close(per_row[1], plain[1], rtol=0, atol=1e-5)
    assert (routed[:2] - plain[:2]).abs().max() > VISIBLE  # routed rows really are corrected
    assert model.darts_domain == "auto"


def test_right_padding_routes_like_left_padding(auto):
    """The router averages only the real tokens: a right-padded batch (pad = eos, a non-zero embedding)
    routes each row as the left-padded one and as the prompt alone."""
    model, tokenizer = auto["model"], tokenizer_for(auto["path"])
    tokenizer.padding_side = "right"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask[:, -1] == 0).any()
    assert model.route_domains(batch.input_ids, batch.attention_mask) == auto["picks"]
    with torch.no_grad():
        routed = model(**batch, darts_domain="auto").logits
        named = model(**batch, darts_domain=auto["picks"]).logits
    torch.testing.assert_close(routed, named, rtol=0, atol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_auto_equals_each_prompt_alone_with_its_domain(auto, use_cache):
    """Left-padded batch, with and without KV cache: each row equals its prompt generated alone
    (unpadded) with the routed domain named, so the row kept its prefill domain at every step."""
    model, batch, tokenizer = auto["model"], auto["batch"], auto["tokenizer"]
    prompt_len = batch.input_ids.shape[1]
    steps = []  # what generate hands each step's forward: the rows and whether the step routes
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.append((kwargs["darts_rows"].tolist(), kwargs.get("darts_route"),
                                                   kwargs.get("darts_route_state"))), with_kwargs=True)
    try:
        together = generate(model, batch, darts_domain="auto", use_cache=use_cache)[:, prompt_len:]
    finally:
        handle.remove()
    assert len(steps) == 6 and steps[0][:2] == ([-2] * len(PROMPTS), "prefill")  # routed at the prefill ...
    assert picks_from_sums(model, steps[0][2]) == auto["picks"]  # (the sums it added the prompt's states to)
    routed = [model.darts_domains.index(pick) if pick != "none" else -1 for pick in auto["picks"]]
    assert all(step == (routed, None, None) for step in steps[1:])  # ... then kept, nothing routed again
    assert torch.equal(generate(model, batch, use_cache=use_cache)[:, prompt_len:], together)  # default "auto"
    per_row = generate(model, batch, darts_domain=["auto", "none", "auto"], use_cache=use_cache)[:, prompt_len:]
    for row, (prompt, pick) in enumerate(zip(PROMPTS, auto["picks"])):
        ids = alone(tokenizer, prompt)
        expected = generate(model, ids, darts_domain=pick)[:, ids["input_ids"].shape[1]:]
        assert torch.equal(together[row:row + 1], expected), (prompt, pick)
        if row != 1:
            assert torch.equal(per_row[row:row + 1], expected), (prompt, pick)
    ids = alone(tokenizer, PROMPTS[1])
    none = generate(model, ids, darts_domain="none")[:, ids["input_ids"].shape[1]:]
    assert torch.equal(per_row[1:2], none)
    assert not torch.equal(none, together[1:2])  # the routed domain really changes the continuation


def test_beam_search_keeps_each_rows_routed_domain(auto):
    model, batch, tokenizer = auto["model"], auto["batch"], auto["tokenizer"]
    kwargs = dict(num_beams=2, num_return_sequences=2)
    together = generate(model, batch, darts_domain="auto", **kwargs)[:, batch.input_ids.shape[1]:]
    for row, (prompt, pick) in enumerate(zip(PROMPTS, auto["picks"])):
        ids = alone(tokenizer, prompt)
        expected = generate(model, ids, darts_domain=pick, **kwargs)[:, ids["input_ids"].shape[1]:]
        assert torch.equal(together[2 * row:2 * row + 2], expected), (prompt, pick)


@torch.no_grad()
def test_manual_loop_with_the_kv_cache_keeps_the_routing(auto):
    """A hand-written greedy loop passing ``cache`` back: steps after the prefill see one token per
    row, so they must take the routing stored on the cache. Same tokens as generate without cache."""
    model, batch = auto["model"], auto["batch"]
    ids, mask = batch.input_ids, batch.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate derives them
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, darts_domain="auto")
    assert picks_from_sums(model, out.cache._darts_route_sums) == auto["picks"]
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(5):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions, cache=out.cache,
                    darts_domain="auto")
        tokens.append(out.logits[:, -1].argmax(-1))
    expected = generate(model, batch, darts_domain="auto", use_cache=False)[:, ids.shape[1]:]
    assert torch.equal(torch.stack(tokens, dim=1), expected)


def test_rows_below_the_threshold_are_exactly_the_plain_merge(auto):
    model = load(auto["strict"], trust_remote_code=True)
    batch, tokenizer = auto["batch"], auto["tokenizer"]
    assert model.route_domains(batch.input_ids, batch.attention_mask) == STRICT_PICKS
    with torch.no_grad():
        routed = model(**batch).logits
        plain = auto["plain"](**batch).logits
    assert torch.equal(routed[1], plain[1])
    assert (routed[0] - plain[0]).abs().max() > VISIBLE
    # a batch whose rows all fall below the threshold is the plain merge, also in generation
    ids = alone(tokenizer, PROMPTS[1])
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, auto["plain"](**ids).logits)
    assert torch.equal(generate(model, ids), generate(model, ids, darts_domain="none"))


def test_save_pretrained_round_trip_keeps_the_router(auto, tmp_path):
    model, batch = auto["model"], auto["batch"]
    model.save_pretrained(tmp_path / "saved")
    again = load(str(tmp_path / "saved"), trust_remote_code=True)
    assert again.darts_domain == "auto"
    for name, tensor in model.darts.router.state_dict().items():
        assert torch.equal(again.darts.router.state_dict()[name], tensor), name
    assert again.route_domains(batch.input_ids, batch.attention_mask) == auto["picks"]
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)


def test_lm_eval_loads_auto_and_scores_with_the_routed_domains(auto):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=auto["path"], trust_remote_code=True, darts_domain="auto", device="cpu", batch_size=1)
    model = lm.model
    assert model.darts_domain == "auto"
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append((args + (kwargs.get("input_ids"),))[0]),
                                             with_kwargs=True)
    requests = [Instance("loglikelihood", {}, (context, " " + continuation), index)
                for index, (context, continuation) in enumerate([("how many apples are", "left"),
                                                                 ("def sum ( a , b ) :", "return a + b")])]
    try:  # one request per call: lm-eval reorders a list by length
        routed = [lm.loglikelihood([request])[0][0] for request in requests]
    finally:
        handle.remove()
    assert len(seen) == len(requests)
    # lm-eval's batch_size=1 calls carry no padding: each call is routed on its own tokens
    picks = [model.route_domains(ids)[0] for ids in seen]
    assert picks == ["math", "code"]
    named = []
    for request, pick in zip(requests, picks):
        model.set_darts_domain(pick)
        named.append(lm.loglikelihood([request])[0][0])
    model.set_darts_domain("none")
    plain = [score for score, _ in lm.loglikelihood(requests)]
    model.set_darts_domain("auto")
    assert routed == pytest.approx(named, abs=1e-4)
    assert routed != pytest.approx(plain, abs=1e-3)


def test_two_threads_auto_and_fixed_match_their_sequential_outputs(auto):
    """One model object, one thread routing ("auto", forward and generate), one with a fixed domain:
    every output is the one each gets alone (no per-call state shared between threads)."""
    model, batch = auto["model"], auto["batch"]
    ids = alone(auto["tokenizer"], PROMPTS[1])["input_ids"]
    with torch.no_grad():
        expected = {"auto": model(**batch, darts_domain="auto").logits, "math": model(ids, darts_domain="math").logits}
    expected_tokens = generate(model, batch, darts_domain="auto")
    assert not torch.allclose(model(ids, darts_domain="auto").logits, expected["math"])

    def routed(step):
        failed = [] if torch.equal(model(**batch, darts_domain="auto").logits, expected["auto"]) else ["auto"]
        if step % 20 == 0 and not torch.equal(generate(model, batch, darts_domain="auto"), expected_tokens):
            failed.append("auto generate")
        return failed

    def fixed(step):
        return [] if torch.equal(model(ids, darts_domain="math").logits, expected["math"]) else ["math"]

    errors, mismatches = run_concurrently({"auto": routed, "math": fixed}, steps=60)
    assert not errors and not mismatches, (errors[:3], mismatches[:5], len(mismatches))
    assert model.darts_domain == "auto"


def test_auto_without_a_router_is_a_clear_error(auto):
    model, batch = load(auto["bare"], trust_remote_code=True), auto["batch"]
    assert model.darts.router is None and model.darts_domain == "math"
    needs = r"darts_domain: 'auto' needs the domain router.*router: true"
    with pytest.raises(ValueError, match=needs):
        model(**batch, darts_domain="auto")
    with pytest.raises(ValueError, match=needs):
        generate(model, batch, darts_domain=["auto", "math", "none"])
    with pytest.raises(ValueError, match=needs):
        model.set_darts_domain("auto")
    with pytest.raises(ValueError, match=needs):
        model.route_domains(batch.input_ids)
    with pytest.raises(ValueError, match=needs):
        load(auto["bare"], trust_remote_code=True, darts_domain="auto")
    assert model.darts_domain == "math"


def test_directory_written_before_routing_loads_and_refuses_auto(tmp_path):
    from mergekit_darts.remote_code.modeling_darts import DartsLlamaForCausalLM

    out = tmp_path / "v010"
    shutil.copytree(DATA / "v0_1_0_output", out)
    model = DartsLlamaForCausalLM.from_pretrained(str(out)).eval()
    assert model.darts.router is None and sorted(model.darts_domains) == ["code", "math"]
    with pytest.raises(ValueError, match="'auto' needs the domain router"):
        DartsLlamaForCausalLM.from_pretrained(str(out), darts_domain="auto")


def test_missing_router_tensors_warn_and_fall_back_to_none(auto, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "norouter"
    shutil.copytree(auto["path"], out)
    shard = os.path.join(out, "darts.safetensors")
    save_file({k: v for k, v in load_file(shard).items() if not k.startswith("darts.router.")}, shard,
              metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        model = load(str(out), trust_remote_code=True)
    assert "no darts.router.* tensors" in caplog.text
    assert model.darts.router is None and model.darts_domain == "none"
    with torch.no_grad():
        assert torch.equal(model(**auto["batch"]).logits, auto["plain"](**auto["batch"]).logits)


def test_pipeline_output_with_default_domain_auto_loads_and_routes(tiny_family, merged_copy, tmp_path):
    """A real merge + surgery run with ``default_domain: auto``: the directory loads with "auto" active
    and routes the domains' own prompts to their domains (held-out accuracy 1.0 in the report)."""
    from mergekit_darts.pipeline import run_surgery

    report = run_surgery(_config(tiny_family, tmp_path, default_domain="auto"), merged_copy, progress=False)
    assert report["router"]["accuracy"] == {"math": 1.0, "code": 1.0}
    model = load(merged_copy, trust_remote_code=True)
    assert model.darts_domain == "auto" and model.darts.router.domains == ["math", "code"]
    tokenizer = tokenizer_for(merged_copy)
    prompts = MATH[:3] + CODE[:3]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    picks = model.route_domains(batch.input_ids, batch.attention_mask)
    assert picks == ["math"] * 3 + ["code"] * 3
    prompt_len = batch.input_ids.shape[1]
    assert torch.equal(generate(model, batch)[:, prompt_len:], generate(model, batch, darts_domain=picks)[:, prompt_len:])


def test_router_under_accelerate_cpu_offload(auto):
    """Every weight on meta, loaded by accelerate's hooks only inside a module's forward: routing goes
    through the router's __call__, so it still sees its real tensors."""
    import accelerate

    model, batch = load(auto["path"], trust_remote_code=True), auto["batch"]
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.darts.router.centroids.device.type == "meta"
    assert model.route_domains(batch.input_ids, batch.attention_mask) == auto["picks"]
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, auto["model"](**batch).logits, rtol=0, atol=1e-5)
    assert torch.equal(generate(model, batch), generate(auto["model"], batch))


@torch.no_grad()
def test_a_reset_cache_is_a_new_sequence_and_static_caches_route(auto):
    """A cache object reused for another prompt after ``reset()`` still carries the old routing: its
    prefill must route the new prompt. generate with a static cache routes like the dynamic one."""
    model, tokenizer = auto["model"], auto["tokenizer"]
    first = tokenizer([PROMPTS[0], PROMPTS[1]], return_tensors="pt", padding=True)
    swapped = tokenizer([PROMPTS[1], PROMPTS[0]], return_tensors="pt", padding=True)
    cache = model(**first, use_cache=True, darts_domain="auto").cache
    assert picks_from_sums(model, cache._darts_route_sums) == auto["picks"][:2]
    cache.reset()
    logits = model(**swapped, cache=cache, use_cache=True, darts_domain="auto").logits
    assert picks_from_sums(model, cache._darts_route_sums) == auto["picks"][1::-1]
    torch.testing.assert_close(logits, model(**swapped, darts_domain=auto["picks"][1::-1]).logits, rtol=0, atol=1e-5)
    static = generate(model, swapped, darts_domain="auto", cache_implementation="static")
    assert torch.equal(static, generate(model, swapped, darts_domain=auto["picks"][1::-1]))
