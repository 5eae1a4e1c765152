"""Compiled generation with a static cache: the Darts model (one domain, mixed rows, auto) vs the plain merge.

The same random Llama and random non-zero surgery as ``bench_generation.py`` (``export_surgery``, so the
directory is what ``mergekit-yaml`` writes, with a router that sends every timed row to ``d0``). Every
variant runs greedy ``generate`` with ``cache_implementation="static"`` and a ``compile_config``
(fullgraph, inductor, static shapes): transformers compiles the decoding steps, the prefill runs eager.

* ``plain``: the directory loaded without remote code (``LlamaForCausalLM``), compiled the same way,
* ``one``:   ``darts_domain="d0"`` (the correction of one domain for every row),
* ``mixed``: a per-row index tensor cycling over the domains (the masked per-row path, also at batch 1),
* ``auto``:  ``darts_domain="auto"`` (routed at the prefill from the prompt; later steps route from the
  carried sums).

Before timing, each variant's compiled tokens are compared with its eager dynamic-cache tokens (the
share that agrees is reported: inductor's kernels may round differently) and the surgery must change
the plain model's tokens. Rounds are interleaved (order flipped every round); the figure is the median
over rounds of tokens/s(variant) / tokens/s(plain) in the same round. Target: >= 0.98 at batch 1 and 8.
The number of compiled graphs is checked not to grow while timing (no recompiles).

On CPU the clock is the process's CPU time with one torch thread (see bench_generation.py); the
compile takes minutes per graph on a busy 2-core machine (8 graphs). On CUDA use ``gpu_generation.py``
(wall clock, ``mode="reduce-overhead"``: CUDA graphs).

    python benchmarks/speed_memory/bench_generation_compiled.py                 # CPU (~15-25 min on 2 busy cores)
    python benchmarks/speed_memory/bench_generation_compiled.py --mode reduce-overhead --device cuda --dtype bfloat16
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, interleaved, log, machine_info, median, paired_ratio, print_table, write_json  # noqa: E402
from bench_generation import bench_prompts, build_model_dir, export_router, load, mixed_rows  # noqa: E402

VARIANTS = ("plain", "one", "mixed", "auto")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--depth", type=int, default=0, help="also give every domain rank-8 adapters on the last DEPTH blocks")
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--domains", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per batch size (after the compiling warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mode", default="default", help="torch.compile mode (reduce-overhead = CUDA graphs)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--workdir", default=None)
    add_output_options(p)
    return p.parse_args(argv)


def compile_config(args):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, backend=args.backend, mode=args.mode)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    return config


def generate_fn(model, input_ids, args, static: bool = True, **darts):
    attention_mask = torch.ones_like(input_ids)
    extra = dict(cache_implementation="static", compile_config=compile_config(args)) if static else {}

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=3, **darts, **extra)
        assert out.shape[1] == input_ids.shape[1] + args.new_tokens
        return out[:, input_ids.shape[1]:]

    return run


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def bench_batch(darts_model, plain_model, batch: int, args) -> dict:
    input_ids = bench_prompts(batch, args).to(args.device)
    assert darts_model.route_domains(input_ids) == ["d0"] * batch, "the router must send every timed row to d0"
    darts = {"one": {"darts_domain": "d0"}, "mixed": {"darts_domain": mixed_rows(batch, args)},
             "auto": {"darts_domain": "auto"}}
    variants = {"plain": generate_fn(plain_model, input_ids, args)}
    variants.update({name: generate_fn(darts_model, input_ids, args, **kwargs) for name, kwargs in darts.items()})
    eager = {"plain": generate_fn(plain_model, input_ids, args, static=False)()}
    eager.update({name: generate_fn(darts_model, input_ids, args, static=False, **kwargs)()
                  for name, kwargs in darts.items()})
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    log(f"batch {batch}: compiling (warm-up)")
    agreement = {}
    for name, fn in variants.items():  # the first call compiles; the second is a warm run
        compiled = fn()
        fn()
        agreement[name] = float((compiled == eager[name]).float().mean())
    changed = float((eager["one"] != eager["plain"]).float().mean())
    graphs = compiled_graphs()
    log(f"batch {batch}: {args.repeats} interleaved rounds of {args.new_tokens} new tokens")
    times = interleaved(variants, args.repeats, sync, args.clock)
    tokens = batch * args.new_tokens
    return {
        "batch": batch,
        "tokens_per_round": tokens,
        "tokens_per_s": {name: median([tokens / t for t in ts]) for name, ts in times.items()},
        "seconds": times,
        # tokens/s ratio = inverse time ratio, paired per round
        **{f"ratio_{name}_over_plain": paired_ratio(times["plain"], times[name]) for name in ("one", "mixed", "auto")},
        "compiled_tokens_equal_eager_share": agreement,
        "greedy_tokens_changed_by_surgery": changed,
        "graphs_compiled_while_timing": compiled_graphs() - graphs,
    }


def main(argv=None, name: str = "bench_generation_compiled"):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    # every variant x batch size is its own static graph; plus headroom for the prefill-free decode graphs
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(args.batch) + 4)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path = os.path.join(tmp, "model")
        log(f"building random model hidden={args.hidden} layers={args.layers} vocab={args.vocab}")
        counts = build_model_dir(path, args)
        export_router(path, counts.pop("modules"), args)
        darts_model = load(path, args, remote=True)
        plain_model = load(path, args, remote=False)
        assert type(darts_model).__name__.startswith("Darts") and not type(plain_model).__name__.startswith("Darts")
        results = [bench_batch(darts_model, plain_model, batch, args) for batch in args.batch]

    header = ["batch", "tok/s plain", *(f"tok/s {n}" for n in VARIANTS[1:]), *(f"{n}/plain" for n in VARIANTS[1:]),
              "compiled = eager"]
    rows = []
    for r in results:
        ratios = [r[f"ratio_{n}_over_plain"] for n in VARIANTS[1:]]
        rows.append([r["batch"], *(r["tokens_per_s"][n] for n in VARIANTS),
                     *(f"{x['median']:.3f} ({x['min']:.3f}..{x['max']:.3f})" for x in ratios),
                     " ".join(f"{n}:{r['compiled_tokens_equal_eager_share'][n]:.2f}" for n in VARIANTS)])
    print_table(
        f"Compiled static-cache generation (fullgraph, {args.backend}, mode {args.mode}), greedy, hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}, depth {args.depth}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, {args.device}/{args.dtype}, {torch.get_num_threads()} thread(s), {args.repeats} interleaved rounds, "
        f"{args.clock} clock; graph breaks {graph_breaks()}", header, rows)
    write_json(name, {
        "benchmark": "generation, compiled forward + static cache",
        "target": "tokens/s(one|mixed|auto) / tokens/s(plain) >= 0.98 at batch 1 and 8",
        "settings": vars(args), "machine": machine_info(), "graph_breaks": graph_breaks(),
        "parameters": {k: v for k, v in counts.items()}, "results": results,
    }, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
