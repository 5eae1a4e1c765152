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


@torch.no_grad()
def test_auto_with_block_adapters_routes_the_whole_prompt_on_a_plain_pass(darts):
    """With block adapters the default router reads the plain model's final states on its own pass over
    the whole prompt, before the prefill: a prefix cache filled without routing sums is accepted and the
    prompt routes as a whole (the router is pointed so that the uncached tokens alone route elsewhere)."""
    from mergekit_darts.remote_code.routing import pool_prompt_states
    from test_compiled import routing_states

    model, tokenizer = load(darts[1]["path"], trust_remote_code=True), darts["tokenizer"]
    assert model.darts.router.states == "final"
    full = ids_of(tokenizer, PROMPTS[2])
    prefix, suffix = full[:, :3], full[:, 3:]
    router = model.darts.router
    for name, ids in (("math", suffix), ("code", full)):
        index = router.domains.index(name)
        router.weight[index] = router.centroids[index] = pool_prompt_states(routing_states(model, {"input_ids": ids}, 0))[0]
    router.bias.zero_()
    router.similarity_mean.fill_(0.0)
    assert model.route_domains(full) == ["code"] and model.route_domains(suffix) == ["math"]
    expected = generate(model, {"input_ids": full}, "code")
    assert torch.equal(generate(model, {"input_ids": full}, "auto"), expected)
    filled = model(prefix, use_cache=True, darts_domain="code").cache  # no routing sums on it
    assert torch.equal(generate(model, {"input_ids": full}, "auto", cache=filled), expected)
    # a hand-written loop: the first call routes its own tokens on a plain pass, the next keeps its pick
    first = model(full, use_cache=True, darts_domain="auto")
    torch.testing.assert_close(first.logits, model(full, darts_domain="code").logits)
    token = first.logits[:, -1:].argmax(-1)
    step = model(token, cache=first.cache, darts_domain="auto").logits
    named = model(full, use_cache=True, darts_domain="code")
    torch.testing.assert_close(step, model(token, cache=named.cache, darts_domain="code").logits)


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


# ------------------------------------------------------------------ assisted and prompt-lookup decoding

def first_forward_of(model, run):
    """The keyword arguments of the first forward of ``model`` while ``run()`` runs, and run()'s result."""
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        result = run()
    finally:
        handle.remove()
    return seen, result


@torch.no_grad()
def test_prompt_lookup_with_auto_routes_on_the_prompt_alone(darts, tmp_path):
    """Prompt-lookup decoding feeds the prompt and its first draft tokens in one forward. The router is
    pointed so that the prompt alone routes to math and prompt + drafts to code: "auto" must pick math."""
    from mergekit_darts.remote_code.routing import pool_prompt_states
    from test_compiled import routing_states

    model = load(darts[0]["path"], trust_remote_code=True)  # its router is edited below
    ids = ids_of(darts["tokenizer"], PROMPTS[2] + " " + PROMPTS[2])  # repeated n-grams: lookup drafts tokens
    lookup = dict(prompt_lookup_num_tokens=4)
    seen, _ = first_forward_of(model, lambda: generate(model, {"input_ids": ids}, "none", **lookup))
    with_drafts = seen[0]["input_ids"]
    assert with_drafts.shape[1] > ids.shape[1] and torch.equal(with_drafts[:, :ids.shape[1]], ids)
    prompt = pool_prompt_states(routing_states(model, {"input_ids": ids}, 0))[0]
    drafted = pool_prompt_states(routing_states(model, {"input_ids": with_drafts}, 0))[0]
    router = model.darts.router
    for name, centroid in (("math", prompt), ("code", drafted)):
        index = router.domains.index(name)
        router.weight[index] = router.centroids[index] = centroid
    router.bias.zero_()
    router.similarity_mean.fill_(0.0)
    assert model.route_domains(ids) == ["math"] and model.route_domains(with_drafts) == ["code"]
    seen, routed = first_forward_of(model, lambda: generate(model, {"input_ids": ids}, "auto", **lookup))
    assert seen[0]["input_ids"].shape[1] > ids.shape[1]  # the first forward really carried drafts
    mask = seen[0]["darts_prompt_mask"]
    assert mask[:, :ids.shape[1]].all() and not mask[:, ids.shape[1]:].any()
    math, code = (generate(model, {"input_ids": ids}, name) for name in ("math", "code"))
    assert not torch.equal(math, code)
    assert torch.equal(routed, math)


@pytest.mark.parametrize("assistant_kind", ["plain", "darts"])
def test_assistant_model_drafts_with_its_own_settings(darts, assistant_kind):
    """Speculative decoding with a plain or a Darts assistant: greedy output is the target's own for
    every domain argument, and the assistant's forwards never get the target's darts_* keywords."""
    model, tokenizer = darts[0]["model"], darts["tokenizer"]
    assistant = darts[0]["plain"] if assistant_kind == "plain" else load(darts[0]["path"], trust_remote_code=True)
    ids = {"input_ids": ids_of(tokenizer, PROMPTS[2])}
    for domain in ("none", "code", ["math"], "auto"):
        seen, assisted = first_forward_of(assistant, lambda: generate(model, ids, domain, assistant_model=assistant))
        assert torch.equal(assisted, generate(model, ids, domain)), domain
        assert seen, "the assistant drafted nothing"
        for kwargs in seen:
            got = {key for key in kwargs if key.startswith("darts_")}
            assert got <= ({"darts_domain"} if assistant_kind == "darts" else set()), (domain, got)
            assert kwargs.get("darts_domain") in (None, assistant.darts_domain if assistant_kind == "darts" else None)


# ----------------------------------------------------- calls inside calls, a loop that reorders its cache

@pytest.mark.parametrize("depth", [0, 1])
@torch.no_grad()
def test_a_call_made_inside_a_forward_leaves_the_outer_call_as_it_was(darts, depth):
    """A hook on a decoder layer calls ``route_domains`` / the model itself (another domain, "none") on
    another prompt while the outer forward runs on the same thread: the outer call keeps its own domain
    and routing, the inner one gets what it gets alone."""
    model, tokenizer = darts[depth]["model"], darts["tokenizer"]
    math_ids, code_ids = ids_of(tokenizer, PROMPTS[0]), ids_of(tokenizer, PROMPTS[1])
    assert model.route_domains(math_ids) == ["math"] and model.route_domains(code_ids) == ["code"]
    inner_calls = {"route_domains": lambda: model.route_domains(code_ids),
                   "forward none": lambda: model(code_ids, darts_domain="none").logits,
                   "forward code": lambda: model(code_ids, darts_domain="code").logits}
    alone = {label: call() for label, call in inner_calls.items()}
    assert torch.equal(alone["forward none"], darts[depth]["plain"](code_ids).logits)
    for outer in ("auto", "math"):
        expected = model(math_ids, darts_domain="math").logits
        for label, call in inner_calls.items():
            inner = []

            def hook(module, args, output, call=call):
                if not inner:  # the inner call runs this layer too
                    inner.append(None)
                    inner[0] = call()

            handle = model.model.layers[0].register_forward_hook(hook)
            try:
                got = model(math_ids, darts_domain=outer).logits
            finally:
                handle.remove()
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"{outer} / {label}")
            if label == "route_domains":
                assert inner[0] == ["code"]
            else:
                torch.testing.assert_close(inner[0], alone[label], rtol=0, atol=1e-5, msg=f"{outer} / {label}")


@torch.no_grad()
def test_reordering_a_manual_loops_cache_reorders_its_routing(darts):
    """A hand-written beam-style loop swaps the rows of its cache (``reorder_cache``): each row keeps its
    own prompt's routing, so the step after the swap gives the swapped rows of the step without it."""
    model, tokenizer = darts[0]["model"], darts["tokenizer"]
    batch = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)  # routed to math and code
    ids, mask = batch.input_ids, batch.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    first = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, darts_domain="auto")
    token = first.logits[:, -1].argmax(-1, keepdim=True)
    step = dict(attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
                position_ids=positions[:, -1:] + 1, darts_domain="auto")
    cache = first.cache
    assert type(cache).__name__ == "DynamicCache" and isinstance(cache, DynamicCache)
    kept = model(input_ids=token, cache=copy.deepcopy(cache), **step).logits
    swap = torch.tensor([1, 0])
    sums = cache._darts_route_sums.clone()
    cache.reorder_cache(swap)
    assert torch.equal(cache._darts_route_sums, sums[swap])
    swapped_step = {**step, "attention_mask": step["attention_mask"][swap], "position_ids": step["position_ids"][swap]}
    named = {tuple(names): model(input_ids=token[swap], cache=copy.deepcopy(cache),
                                 **{**swapped_step, "darts_domain": names}).logits
             for names in (["code", "math"], ["math", "code"])}
    swapped = model(input_ids=token[swap], cache=cache, **swapped_step).logits
    torch.testing.assert_close(swapped, kept[swap], rtol=0, atol=1e-5)
    torch.testing.assert_close(swapped, named[("code", "math")], rtol=0, atol=1e-5)
    assert (named[("math", "code")] - swapped).abs().max() > 1.0  # the old rows' routing would show
