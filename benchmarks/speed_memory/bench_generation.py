"""Generation overhead of the surgery: tokens/s with a domain active vs darts_domain="none".

Builds a random Llama shaped like a small real LLM, exports random non-zero surgery modules into
it with ``export_surgery`` (so the directory is exactly what ``mergekit-yaml`` writes), loads it
once with ``trust_remote_code=True`` and times greedy ``generate`` (KV cache on) with

* ``darts``: a domain active (norm hook + surgery on every forward),
* ``mixed``: one domain per row (``darts_domain`` = a per-row index tensor cycling over the domains):
  the per-row path, masked selections over every domain, also at batch 1,
* ``auto``:  ``set_darts_domain("auto")``: the router picks each row's domain at the prefill and the
  row keeps it (docs/routing.md). The exported router is built so that every timed prompt routes to
  the ``darts`` variant's domain (checked before timing), so auto/darts is the routing's own cost
  (with ``--depth`` and ``--router-states final``, the default, that includes the plain pass over the
  prompt that the router reads; ``block_input`` reads the first adapted block's input instead),
* ``none``:  the same loaded model after ``set_darts_domain("none")``,
* ``plain``: the same directory loaded without remote code (plain LlamaForCausalLM), as a check
  that the hooks cost nothing when no domain is active (``--no-plain`` skips it).

The variants are interleaved (ABC CBA ...) and repeated; the figure is the median over rounds of
tokens/s(darts) / tokens/s(none) (and tokens/s(auto) / tokens/s(darts)) measured in the same
round. Targets: >= 0.98 for both.
On CPU the default clock is the process's CPU time (``--clock cpu``) with one torch thread: on a
shared, oversubscribed machine wall time mostly measures the neighbours; tokens/s are then tokens
per CPU-second. On cuda the clock is wall time (with synchronisation).

    python benchmarks/speed_memory/bench_generation.py                     # CPU default (~2 min on 2 cores)
    python benchmarks/speed_memory/bench_generation.py --hidden 2048 --layers 8 --new-tokens 128 --repeats 10 --device cuda
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, interleaved, log, machine_info, median, paired_ratio, print_table, write_json  # noqa: E402

# Llama-2-7B: hidden 4096, vocab 32000, 6,738,415,616 parameters (paper setting; for the share column)
LLAMA2_7B = {"hidden": 4096, "params": 6_738_415_616}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--depth", type=int, default=0,
                   help="also give every domain random rank-8 adapters on the last DEPTH blocks' linears")
    p.add_argument("--router-states", choices=["final", "block_input"], default="final",
                   help="with --depth: what the router reads (final: a plain pass over the prompt)")
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--domains", type=int, default=3, help="surgery modules exported (one is active)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per batch size (after 1 warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: far steadier than 2 on a shared 2-core machine)")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="cpu: process CPU seconds (default on cpu: steady on a shared machine); wall (default on cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-plain", action="store_true", help="skip the plain LlamaForCausalLM variant")
    p.add_argument("--workdir", default=None, help="where to build the model (default: a temp dir)")
    add_output_options(p)
    return p.parse_args(argv)


def build_model_dir(path: str, args) -> dict:
    """Random Llama + random non-zero surgery modules exported into ``path``; returns parameter counts."""
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.blocks import block_linear_targets
    from mergekit_darts.remote_code.surgery import DomainSurgery, count_parameters
    from mergekit_darts.tiny import make_random_model

    model = make_random_model(
        path, hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.prompt_len + args.new_tokens),
    )
    model_params = sum(p.numel() for p in model.parameters())
    targets = block_linear_targets(model.model.layers, args.depth) if args.depth else None
    del model
    torch.manual_seed(0)
    modules = {}
    for index in range(args.domains):
        module = DomainSurgery(args.hidden, rank=args.rank, max_positions=args.max_positions, method="darts")
        with torch.no_grad():  # non-zero everywhere, small enough to keep generation sane
            module.up.weight.normal_(0.0, 0.02)
            module.position_bias.normal_(0.0, 0.02)
        if targets is not None:
            module.attach_blocks(targets, 8)
            with torch.no_grad():
                for _, _, adapter in module.block_adapters():
                    adapter.up.weight.normal_(0.0, 0.02)
        modules[f"d{index}"] = module
    export_surgery(path, modules, {name: f"expert-{name}" for name in modules}, default_domain="d0", loss="ewl1")
    per_domain = count_parameters(modules["d0"])
    return {"model_params": model_params, "per_domain": per_domain, "domains": args.domains, "modules": modules}


def bench_prompts(batch: int, args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(4, args.vocab, (batch, args.prompt_len), generator=generator)


def export_router(path: str, modules: dict, args) -> None:
    """A router whose d0 centroid is the mean direction of the timed prompts' final states (the
    other domains point the opposite way, threshold 0): every timed row routes to d0, so "auto"
    does the same surgery work as a fixed d0 plus the routing itself."""
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.routing import DomainRouter, pool_prompt_states

    model = load(path, args, remote=True)
    block_input = args.depth and args.router_states == "block_input"
    seen = []  # a block_input router reads the first adapted block's input, as the model does
    if block_input:
        model.model.layers[-args.depth].register_forward_pre_hook(
            lambda module, a, kw: seen.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)
    states = []
    with torch.inference_mode():
        for b in args.batch:
            final = model.model(input_ids=bench_prompts(b, args).to(args.device)).last_hidden_state
            states.append(pool_prompt_states(seen[-1] if block_input else final).cpu())
    pooled = torch.cat(states)
    del model
    centroid = torch.nn.functional.normalize(pooled.mean(dim=0), dim=0)
    router = DomainRouter(args.hidden, list(modules), threshold=0.0, states=args.router_states)
    with torch.no_grad():
        for index in range(len(modules)):
            sign = 1.0 if index == 0 else -1.0
            router.weight[index] = router.centroids[index] = sign * centroid
        similarity = pooled @ centroid
        router.similarity_mean.fill_(float(similarity.mean()))
        router.similarity_std.fill_(float(similarity.std()) if len(similarity) > 1 else 1.0)
    export_surgery(path, modules, {name: f"expert-{name}" for name in modules}, default_domain="d0", loss="ewl1",
                   router=router)


def load(path: str, args, remote: bool):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the plain load lists the darts.* tensors as unexpected: expected
    dtype = getattr(torch, args.dtype)
    kwargs = dict(trust_remote_code=True, darts_domain="d0") if remote else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(args.device).eval()
    return model


def mixed_rows(batch: int, args) -> torch.Tensor:
    """Row i gets domain d(i mod domains): the per-row index tensor of the "mixed" variant."""
    return torch.arange(batch) % args.domains


def generate_fn(model, input_ids, new_tokens, domain=None, **generate_kwargs):
    attention_mask = torch.ones_like(input_ids)

    def run():
        if domain is not None:
            model.set_darts_domain(domain)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=3, **generate_kwargs,
            )
        assert out.shape[1] == input_ids.shape[1] + new_tokens
        return out

    return run


def bench_batch(darts_model, plain_model, batch: int, args) -> dict:
    input_ids = bench_prompts(batch, args).to(args.device)
    routed = darts_model.route_domains(input_ids)
    assert routed == ["d0"] * batch, f"the router must send every timed row to d0, got {routed}"
    variants = {
        "darts": generate_fn(darts_model, input_ids, args.new_tokens, domain="d0"),
        "mixed": generate_fn(darts_model, input_ids, args.new_tokens, domain="d0",
                             darts_domain=mixed_rows(batch, args)),
        "auto": generate_fn(darts_model, input_ids, args.new_tokens, domain="auto"),
        "none": generate_fn(darts_model, input_ids, args.new_tokens, domain="none"),
    }
    if plain_model is not None:
        variants["plain"] = generate_fn(plain_model, input_ids, args.new_tokens)
    # the surgery must actually change something, or the comparison is meaningless
    out_darts, out_none = variants["darts"](), variants["none"]()
    changed = float((out_darts[:, args.prompt_len:] != out_none[:, args.prompt_len:]).float().mean())
    assert torch.equal(variants["auto"](), out_darts), "auto (every row routed to d0) must generate what d0 does"
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for fn in variants.values():  # warm-up
        fn()
    times = interleaved(variants, args.repeats, sync, args.clock)
    tokens = batch * args.new_tokens
    result = {
        "batch": batch,
        "tokens_per_round": tokens,
        "tokens_per_s": {name: median([tokens / t for t in ts]) for name, ts in times.items()},
        "seconds": times,
        # tokens/s ratio = inverse time ratio, paired per round
        "ratio_darts_over_none": paired_ratio(times["none"], times["darts"]),
        "ratio_auto_over_darts": paired_ratio(times["darts"], times["auto"]),
        "ratio_mixed_over_none": paired_ratio(times["none"], times["mixed"]),
        "greedy_tokens_changed_by_surgery": changed,
    }
    if "plain" in times:
        result["ratio_none_over_plain"] = paired_ratio(times["plain"], times["none"])
        result["ratio_darts_over_plain"] = paired_ratio(times["plain"], times["darts"])
    return result


def parameter_shares(counts: dict, args) -> dict:
    per_domain = counts["per_domain"]
    total = per_domain * counts["domains"]
    from mergekit_darts.repair.budget import correction_parameters

    paper_per_domain = correction_parameters({"method": "darts", "rank": args.rank, "max_positions": args.max_positions,
                                              "depth": args.depth, "depth_rank": 8},
                                             LLAMA2_7B["hidden"], 32000)
    return {
        "model_params": counts["model_params"],
        "added_per_domain": per_domain,
        "added_all_domains": total,
        "share_per_domain": per_domain / counts["model_params"],
        "share_all_domains": total / counts["model_params"],
        "formula": "2*rank*hidden + max_positions*hidden (+ depth*8*sum(in+out) of a block's linears) per domain",
        "llama2_7b_same_settings": {
            "added_per_domain": paper_per_domain,
            "share_all_domains": paper_per_domain * counts["domains"] / LLAMA2_7B["params"],
        },
    }


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path = os.path.join(tmp, "model")
        log(f"building random model hidden={args.hidden} layers={args.layers} vocab={args.vocab}")
        counts = build_model_dir(path, args)
        export_router(path, counts.pop("modules"), args)
        darts_model = load(path, args, remote=True)
        assert type(darts_model).__name__.startswith("Darts"), type(darts_model)
        plain_model = None if args.no_plain else load(path, args, remote=False)
        results = []
        for batch in args.batch:
            log(f"batch {batch}: {args.repeats} interleaved rounds of {args.new_tokens} new tokens")
            results.append(bench_batch(darts_model, plain_model, batch, args))

    shares = parameter_shares(counts, args)
    header = ["batch", "tok/s darts", "tok/s none", "darts/none (median)", "min..max", "tok/s auto",
              "auto/darts (median)", "min..max", "tok/s mixed", "mixed/none"]
    if not args.no_plain:
        header += ["tok/s plain", "none/plain"]
    rows = []
    for r in results:
        ratio = r["ratio_darts_over_none"]
        auto = r["ratio_auto_over_darts"]
        row = [r["batch"], r["tokens_per_s"]["darts"], r["tokens_per_s"]["none"], ratio["median"],
               f"{ratio['min']:.3f}..{ratio['max']:.3f}", r["tokens_per_s"]["auto"], auto["median"],
               f"{auto['min']:.3f}..{auto['max']:.3f}", r["tokens_per_s"]["mixed"], r["ratio_mixed_over_none"]["median"]]
        if not args.no_plain:
            row += [r["tokens_per_s"]["plain"], r["ratio_none_over_plain"]["median"]]
        rows.append(row)
    print_table(
        f"Generation throughput, greedy + KV cache, hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.device}/{args.dtype}, "
        f"{torch.get_num_threads()} thread(s), {args.repeats} interleaved rounds, {args.clock} clock",
        header, rows,
    )
    print_table("Added parameters", ["", "count", "share of model"], [
        ["per domain (this model)", shares["added_per_domain"], f"{100 * shares['share_per_domain']:.3f}%"],
        [f"{args.domains} domains (this model)", shares["added_all_domains"],
         f"{100 * shares['share_all_domains']:.3f}%"],
        [f"{args.domains} domains at Llama-2-7B shape", shares["llama2_7b_same_settings"]["added_per_domain"] * args.domains,
         f"{100 * shares['llama2_7b_same_settings']['share_all_domains']:.3f}%"],
    ])
    write_json("bench_generation", {
        "benchmark": "generation",
        "target": "tokens/s(darts) / tokens/s(none) >= 0.98; tokens/s(auto) / tokens/s(darts) >= 0.98; "
                  "tokens/s(mixed) / tokens/s(none) >= 0.98",
        "settings": vars(args), "machine": machine_info(), "parameters": shares, "results": results,
    }, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
