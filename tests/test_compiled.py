"""The emitted model on the fast paths (issue 23): torch.compile with fullgraph, static caches (the
4-D masks generate builds for them), compiled static-cache generation, chunked prefill.

Fixture: a Llama with pad = eos and a non-zero pad embedding (helpers.realistic_padding), left-padded
prompts, random surgery with every option (position table, head_rank 2, depth 1) and a router fitted on
the model's own routing states, so a router that averaged over padding would pick other domains
(checked). Compiled runs use the ``aot_eager`` backend: the whole Dynamo capture and AOTAutograd
(graph breaks, guards, functionalization of the in-place ops) in seconds; inductor compiles that same
graph, and takes minutes per graph on these CPUs (benchmarks/speed_memory/bench_generation.py --compile runs it).
"""

import shutil

import pytest
import torch

from helpers import realistic_padding
from mergekit_darts.output.export import export_surgery
from mergekit_darts.remote_code.blocks import block_linear_targets
from mergekit_darts.remote_code.routing import pool_prompt_states
from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
from mergekit_darts.repair.route.router import fit_router
from mergekit_darts.tiny import make_random_model
from test_modeling import PAD, load, tokenizer_for
from test_router import CODE, MATH

PROMPTS = ["what is 2 plus 3 ?", "def sum ( a , b ) : return a + b",
           "how many apples are left if we have 9 and give 4 ?", "print ( list )"]
PICKS = ["math", "code", "math", "code"]  # what the router picks for PROMPTS (asserted below)
MIXED = ["math", "none", "code", "math"]
DOMAINS = {"one domain": "code", "mixed rows": MIXED, "auto": "auto"}
TOLERANCE = 1e-5  # aot_eager runs the eager kernels: measured 0.0; the bound leaves room for op reordering


def routing_states(plain, batch, depth):
    """What the emitted model's router reads: the final norm's output, or the first adapted block's input."""
    seen = {}
    handle = None
    if depth:
        handle = plain.model.layers[-depth].register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        final = plain.model(**batch).last_hidden_state
    if handle is not None:
        handle.remove()
    return seen.get("h", final)


def build_darts_dir(path, depth, seed=0, states="final"):
    """Random surgery of every kind (position table, head correction, block adapters) and a router fitted
    on the plain model's own routing states of MATH / CODE (``states``: the final norm's output, through a
    separate plain pass when blocks are adapted, or the first adapted block's input), exported into a
    realistic-padding Llama."""
    make_random_model(path, arch="llama", seed=3, hidden_size=64)
    realistic_padding(path)
    plain, tokenizer = load(path), tokenizer_for(path)
    targets = block_linear_targets(plain.model.layers, depth) if depth else None
    shape = SurgeryShape("darts", rank=4, head_rank=2, max_positions=6, content="relu", depth=depth,
                         depth_rank=2 if depth else 0)
    torch.manual_seed(seed)
    modules = {}
    for name in ("math", "code"):
        modules[name] = DomainSurgery.from_shape(shape, plain.config.hidden_size, plain.config.vocab_size, targets)
        with torch.no_grad():
            for param in modules[name].parameters():
                param.normal_(0.0, 0.3)
    pooled = {}
    for name, texts in (("math", MATH), ("code", CODE)):
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        read_at = depth if states == "block_input" else 0
        pooled[name] = pool_prompt_states(routing_states(plain, batch, read_at), batch.attention_mask)
    router = fit_router(pooled, threshold=0.02)
    router.states = states
    export_surgery(path, modules, {name: f"experts/{name}" for name in modules}, "math", loss="kl", router=router)
    return plain


@pytest.fixture(scope="module")
def darts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("compiled") / "darts")
    plain = build_darts_dir(path, depth=1)
    tokenizer = tokenizer_for(path)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any() and (batch.input_ids[batch.attention_mask == 0] == PAD).all()
    model = load(path, trust_remote_code=True)
    assert model.route_domains(batch.input_ids, batch.attention_mask) == PICKS
    # what the static-cache bug did: pooling over the (non-zero) padding states routes other domains
    router = model.darts.router
    states = routing_states(plain, batch, depth=0)  # the final states: the router's default
    with torch.no_grad():
        assert router(states, None).tolist() != router(states, batch.attention_mask).tolist()
    return {"path": path, "model": model, "plain": plain, "batch": batch, "tokenizer": tokenizer}


def forward_inputs(batch):
    return dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)


def test_no_graph_breaks_where_the_plain_model_has_none(darts):
    inputs = forward_inputs(darts["batch"])
    assert torch._dynamo.explain(darts["plain"])(**inputs).graph_break_count == 0
    for label, domain in DOMAINS.items():
        explained = torch._dynamo.explain(darts["model"])(**inputs, darts_domain=domain)
        assert explained.graph_break_count == 0, (label, [str(b.reason) for b in explained.break_reasons])


def test_block_input_router_compiles_without_graph_breaks(darts, tmp_path):
    """The other routing point: a ``block_input`` router resolved inside the first adapted layer."""
    path = str(tmp_path / "block_input")
    build_darts_dir(path, depth=1, states="block_input")
    model, inputs = load(path, trust_remote_code=True), forward_inputs(darts["batch"])
    assert model.darts.router.states == "block_input"
    explained = torch._dynamo.explain(model)(**inputs, darts_domain="auto")
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(**inputs, darts_domain="auto").logits
        torch.testing.assert_close(compiled(**inputs, darts_domain="auto").logits, eager, rtol=0, atol=TOLERANCE)
        assert (eager - model(**inputs, darts_domain="none").logits).abs().max() > 1.0


def test_fullgraph_compiled_forward_equals_eager(darts):
    model, inputs = darts["model"], forward_inputs(darts["batch"])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        none = model(**inputs, darts_domain="none").logits
        for label, domain in DOMAINS.items():
            eager = model(**inputs, darts_domain=domain).logits
            torch.testing.assert_close(compiled(**inputs, darts_domain=domain).logits, eager, rtol=0, atol=TOLERANCE,
                                       msg=label)
            assert (eager - none).abs().max() > 1.0, label  # the correction is really in the compared logits


def generate(model, batch, domain, **kwargs):
    return model.generate(**batch, darts_domain=domain, max_new_tokens=5, do_sample=False, pad_token_id=PAD, **kwargs)


def test_static_cache_generation_equals_dynamic_row_by_row(darts):
    """generate with a static cache (4-D masks) gives, row by row, the dynamic cache's tokens and the
    tokens each prompt gets alone, unpadded, with its domain named; eager and with a fullgraph-compiled
    forward (generate compiles the decoding steps itself)."""
    from transformers import CompileConfig

    model, batch, tokenizer = darts["model"], darts["batch"], darts["tokenizer"]
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode="default")
    compile_config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    for label, domain in DOMAINS.items():
        dynamic = generate(model, batch, domain)
        assert torch.equal(generate(model, batch, domain, cache_implementation="static"), dynamic), label
        compiled = generate(model, batch, domain, cache_implementation="static", compile_config=compile_config)
        assert torch.equal(compiled, dynamic), label
        names = PICKS if domain == "auto" else (domain if isinstance(domain, list) else [domain] * len(PROMPTS))
        for row, (prompt, name) in enumerate(zip(PROMPTS, names)):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            alone = generate(model, {"input_ids": ids}, name)[:, ids.shape[1]:]
            assert torch.equal(dynamic[row:row + 1, batch.input_ids.shape[1]:], alone), (label, prompt)
    assert hasattr(model, "_compiled_call")  # the decoding steps really ran compiled


# ------------------------------------------------------------------------------------ chunked prefill

def split_router(model, tokenizer, prompt, chunk, depth):
    """Point the router's "math" centroid at the first chunk's pooled routing state and "code"'s at the
    whole prompt's: the first chunk alone routes to math, the whole prompt to code."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain_like = model  # with no call active the emitted model computes the plain merge's states
    whole = pool_prompt_states(routing_states(plain_like, {"input_ids": ids}, depth))[0]
    first = pool_prompt_states(routing_states(plain_like, {"input_ids": ids[:, :chunk]}, depth))[0]
    assert float(whole @ first) < 0.999
    router = model.darts.router
    with torch.no_grad():
        for name, centroid in (("math", first), ("code", whole)):
            index = router.domains.index(name)
            router.weight[index] = router.centroids[index] = centroid
        router.bias.zero_()
        router.similarity_mean.fill_(0.0)
    assert model.route_domains(ids) == ["code"] and model.route_domains(ids[:, :chunk]) == ["math"]
    return ids


@pytest.mark.parametrize("depth,states", [(0, "final"), (1, "final"), (1, "block_input")])
def test_chunked_prefill_is_routed_on_the_whole_prompt(darts, tmp_path, depth, states):
    """Every chunk is generated with the whole prompt's domain. depth 0: each prefill chunk adds its tokens
    to the routing sums. depth > 0 with the default final-state router: generate routes the whole prompt
    on a plain pass before the prefill, so chunking changes nothing. depth > 0 with ``states:
    block_input`` (the documented limitation, docs/routing.md): the adapters inside the blocks act while
    each chunk is fed, so an earlier chunk's tokens went through the domain routed from the prompt so far
    (here math, not code): the first token's logits differ from the unchunked ones."""
    if (depth, states) == (1, "final"):
        model = load(darts["path"], trust_remote_code=True)
    else:
        path = str(tmp_path / f"depth{depth}")
        build_darts_dir(path, depth=depth, states=states)
        model = load(path, trust_remote_code=True)
    assert model.darts.router.states == states
    prompt, chunk = PROMPTS[2], 4
    ids = split_router(model, darts["tokenizer"], prompt, chunk, depth if states == "block_input" else 0)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    whole = model.generate(ids, darts_domain="auto", **kwargs)
    chunked = model.generate(ids, darts_domain="auto", prefill_chunk_size=chunk, **kwargs)
    named = model.generate(ids, darts_domain="code", **kwargs)
    assert torch.equal(whole.sequences, named.sequences)  # unchunked: routed on the whole prompt
    first_whole, first_chunked = whole.logits[0], chunked.logits[0]
    if states == "final":
        assert torch.equal(chunked.sequences, whole.sequences)
        torch.testing.assert_close(first_chunked, first_whole, rtol=0, atol=1e-5)
    else:
        assert (first_chunked - first_whole).abs().max() > 1e-3
        # named domains do not depend on routing: chunked and unchunked agree
        named_chunked = model.generate(ids, darts_domain="code", prefill_chunk_size=chunk, **kwargs)
        torch.testing.assert_close(named_chunked.logits[0], named.logits[0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_manual_loop_over_a_static_cache_routes_each_new_sequence(darts):
    """A hand-written loop with a StaticCache (its length is a tensor: no host sync to tell a new
    sequence): reset and refilled with other prompts, it routes them afresh; later steps keep it."""
    from transformers import StaticCache

    model, tokenizer = darts["model"], darts["tokenizer"]
    cache = StaticCache(config=model.config, max_cache_len=32)
    for prompts in (PROMPTS[:2], PROMPTS[:2][::-1]):
        cache.reset()
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        ids, mask = batch.input_ids, batch.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, darts_domain="auto")
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions, cache=cache,
                        darts_domain="auto")
            tokens.append(out.logits[:, -1].argmax(-1))
        picks = [PICKS[PROMPTS.index(prompt)] for prompt in prompts]
        expected = generate(model, batch, picks)[:, ids.shape[1]:ids.shape[1] + 4]
        assert torch.equal(torch.stack(tokens, dim=1), expected), prompts


def test_generate_from_inputs_embeds_matches_input_ids(darts):
    model, batch = darts["model"], darts["batch"]
    embeds = model.get_input_embeddings()(batch.input_ids).detach()
    for label, domain in DOMAINS.items():
        from_ids = generate(model, batch, domain)[:, batch.input_ids.shape[1]:]
        from_embeds = model.generate(inputs_embeds=embeds, attention_mask=batch.attention_mask, darts_domain=domain,
                                     max_new_tokens=5, do_sample=False, pad_token_id=PAD)
        assert torch.equal(from_embeds, from_ids), label


@torch.no_grad()
def test_auto_with_a_custom_4d_mask_reads_darts_prompt_mask(darts):
    """A caller's own 4-D mask says nothing the router can use about which tokens are padding: "auto"
    then needs ``darts_prompt_mask`` (a clear error without it), and with it routes like the 2-D mask."""
    model, batch = darts["model"], darts["batch"]
    mask = batch.attention_mask.bool()
    length = mask.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    # real keys, causal; a padded query sees itself only (so no row is empty)
    custom = causal & (mask[:, None, None, :] | torch.eye(length, dtype=torch.bool))
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    inputs = dict(input_ids=batch.input_ids, position_ids=positions, use_cache=False)
    with pytest.raises(ValueError, match=r"darts_domain='auto'.*attention_mask has shape \(4, 1, \d+, \d+\).*"
                                         r"darts_prompt_mask"):
        model(**inputs, attention_mask=custom, darts_domain="auto")
    got = model(**inputs, attention_mask=custom, darts_domain="auto", darts_prompt_mask=batch.attention_mask).logits
    expected = model(**inputs, attention_mask=batch.attention_mask, darts_domain=PICKS).logits
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-5)
