"""KL surgery training on a GPU at the paper's shapes: measured seconds per step, per variant, and the
time of 500 steps x 3 domains (issue 19's target on one H200: <= 5 minutes for 7B).

Synthetic tensors of the paper's shapes (H 4096, V 32000, 50 samples x 512 tokens, held_out 0.2 ->
40 training samples), cached states in bfloat16 as the capture stores them, promoted once to float32
as the pipeline does. Each variant runs the real ``train_surgery`` loop (rank 16, Adam):

* exact:               today's default (float32, full batch, expert logits recomputed every step)
* topk-mixed:          kl_target topk (k 256) + kl_precision mixed, full batch
* bf16-mixed:          kl_target bf16 (full distribution) + mixed, full batch
* topk-mixed-pps4096:  topk + mixed + kl_positions_per_step 4096
* exact-mixed:         exact targets with bf16 matmuls (what mixed precision alone gives)

Per-step time = (time of 1 + S steps - time of 1 step) / S, so the one-time target build is separate
(reported as ``setup_s``); medians over ``--repeats`` pairs. Peak CUDA memory per variant is recorded.

    python benchmarks/gpu/gpu_kl_scale.py                      # on a CUDA machine (a few minutes on an H200)
    python benchmarks/gpu/gpu_kl_scale.py --small --device cpu # tiny shapes: checks that the script runs

``--preset`` measures ``preset: best``'s step instead (docs/scale.md, "Block adapters in every block at 7B"):
a random Llama-2-7B-shaped model (hidden 4096, MLP 11008, 32 layers, vocabulary 32000) built on the device,
its 32 blocks as the frozen tail, and the real ``train_surgery`` loop over ``--preset-samples`` x 512 tokens
(full batch, exact KL) for: ``kl_depth0`` (the rank-64 correction on the final states alone),
``preset_float32`` (rank-8 adapters on every linear of every block, the blocks in float32) and
``preset_bf16_autocast`` (the same, the blocks under bfloat16 autocast: what a GPU run does). Seconds
per step are scaled linearly to the preset's 40 records x 512 positions per domain and to ``--preset-steps
STOPPED REFIT`` steps (an early-stopped run trains STOPPED steps on 32 of them, then refits on all 40; the
preset trains 500 fixed steps on all 40, written ``0 500``: the default), at ``--preset-batch B`` records per
step (``batch_size``; default the preset's 12), printed as minutes per domain against the 10-minute target. The peak memory of the measured step is what one step of
``--preset-samples`` records (or one micro-batch of that many, ``micro_batch_size``) needs.
``--train-blocks K ...`` (default 0 2) adds ``preset_topK_bf16_autocast``: ``train_blocks: K`` as the
pipeline runs it, the last K blocks training from their input, which the blocks below compute once per
record (its seconds, scaled to the 40 records, are added to the minutes per domain). With
``--small`` (H 64, 2 layers) it runs on a CPU:

    python benchmarks/gpu/gpu_kl_scale.py --preset                          # on a CUDA machine (minutes)
    python benchmarks/gpu/gpu_kl_scale.py --preset --small --device cpu     # tiny shapes: checks the script runs
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, log, machine_info, print_table, write_json  # noqa: E402

from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape  # noqa: E402
from mergekit_darts.repair.train.loop import train_surgery  # noqa: E402

VARIANTS = {
    "exact": {},
    "exact-mixed": {"kl_precision": "mixed"},
    "topk-mixed": {"kl_target": "topk", "kl_top_k": 256, "kl_precision": "mixed"},
    "bf16-mixed": {"kl_target": "bf16", "kl_precision": "mixed"},
    "topk-mixed-pps4096": {"kl_target": "topk", "kl_top_k": 256, "kl_precision": "mixed",
                           "kl_positions_per_step": 4096},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (H 64, V 512, 4 x 32 tokens): a CPU check")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=40, help="training samples (paper: 50 with 20%% held out)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of (1 step, 1 + steps) runs; medians are used")
    p.add_argument("--total-steps", type=int, default=500)
    p.add_argument("--domains", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--chunk", type=int, default=4096, help="kl_chunk_size")
    p.add_argument("--out", default=None)
    p.add_argument("--preset", action="store_true", help="only: preset: best's step at 7B shapes (see above)")
    p.add_argument("--preset-samples", type=int, default=8, help="records of --tokens per measured step")
    p.add_argument("--preset-steps", type=int, nargs=2, default=[0, 500], metavar=("STOPPED", "REFIT"),
                   help="steps of an early-stopped run (32 records) and of the refit or the only run (40 records) "
                        "per domain (default: the preset's 500 fixed steps)")
    p.add_argument("--preset-model", choices=("llama2", "llama3"), default="llama2",
                   help="with --preset: Llama-2-7B's shapes (vocabulary 32000) or Llama-3-8B's (128256, 8 key/value heads)")
    p.add_argument("--train-blocks", type=int, nargs="*", default=None,
                   help="with --preset, also train_blocks: k for each k (the last k blocks train; default 0 2, "
                        "with --small 0 1)")
    p.add_argument("--preset-batch", type=int, default=12,
                   help="records per step (batch_size; default: the preset's 12; 40: the full batch)")
    args = p.parse_args(argv)
    # hidden, MLP, layers, heads, vocabulary; key/value heads
    args.shape, args.kv_heads = {"llama2": ((4096, 11008, 32, 32, 32000), 32),
                                 "llama3": ((4096, 14336, 32, 32, 128256), 8)}[args.preset_model]
    if args.small and args.preset:
        # 20 timed steps: at these shapes a step is about a millisecond, and the time of the one-step run that is
        # subtracted jitters by as much (3 steps gave a step time of zero or less once in tests/test_preset_cost_bench.py)
        args.shape, args.preset_samples, args.tokens, args.steps = (64, 96, 2, 4, 512), 4, 32, 20
        args.kv_heads = 2 if args.preset_model == "llama3" else 4
        args.repeats = max(args.repeats, 2)
    elif args.small:
        args.hidden, args.vocab, args.samples, args.tokens, args.steps, args.chunk = 64, 512, 4, 32, 20, 64
        args.repeats = max(args.repeats, 3)  # a shared CPU is noisy
        VARIANTS["topk-mixed-pps4096"]["kl_positions_per_step"] = 48
    if args.train_blocks is None:
        args.train_blocks = [0, 1] if args.small else [0, 2]
    return args


def synthetic(args, device):
    g = torch.Generator().manual_seed(0)
    n, t, h = args.samples, args.tokens, args.hidden
    merged = torch.randn(n, t, h, generator=g).to(torch.bfloat16)
    expert = (merged.float() + 0.5 * torch.randn(n, t, h, generator=g)).to(torch.bfloat16)
    scale = 3.0 / h ** 0.5
    expert_head = torch.randn(args.vocab, h, generator=g) * scale
    merged_head = expert_head + 0.3 * scale * torch.randn(args.vocab, h, generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    position_ids = torch.arange(t).expand(n, t).clone()
    return {"merged": merged.to(device).float(), "target": expert.to(device).float(), "mask": mask.to(device),
            "position_ids": position_ids.to(device), "expert_head": expert_head.to(device),
            "merged_head": merged_head.to(device)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(tensors, options, steps, args, device):
    torch.manual_seed(0)
    module = DomainSurgery.from_shape(SurgeryShape(method="darts", rank=16, head_rank=0, max_positions=args.tokens,
                                                   content="relu"), hidden_size=args.hidden, vocab_size=args.vocab)
    sync(device)
    start = time.perf_counter()
    history = train_surgery(module, tensors["merged"], tensors["target"], tensors["mask"], tensors["position_ids"],
                            loss="kl", steps=steps, lr=1e-3, seed=0, expert_head=tensors["expert_head"],
                            merged_head=tensors["merged_head"], kl_chunk_size=args.chunk, **options)
    sync(device)
    return time.perf_counter() - start, history


def top_blocks_variant(tail, preset, embeddings, positions, k: int, device):
    """``train_blocks: k`` as the pipeline trains it (repair/train/top_blocks.py): (a factory of the module
    whose last k blocks train on a view of the tail, the first trained block's input, the seconds that
    input took to compute: once per record, the blocks below under bf16 autocast as a GPU run does)."""
    from mergekit_darts.repair.train import top_blocks
    from mergekit_darts.repair.train.tail import TailSurgery

    layers = len(tail.layers)
    if not 0 <= k < layers:
        raise SystemExit(f"--train-blocks: {k} must be 0 to {layers - 1} (all {layers}: the preset_* variants)")
    lower, upper = top_blocks.split_tail(tail, k)

    def make():
        module = preset().surgery
        return TailSurgery(upper, top_blocks.freeze_below(module, tail.first + layers - k))

    torch.manual_seed(0)
    start_module = make().surgery
    tail.compute_dtype = torch.bfloat16
    sync(device)
    start = time.perf_counter()
    inputs = top_blocks.first_trained_inputs(lower, start_module, embeddings, positions, embeddings.shape[0], device)
    sync(device)
    tail.compute_dtype = None
    return make, inputs.to(device), time.perf_counter() - start


def preset_step(args, device) -> dict:
    """``--preset``: seconds per full-batch step of kl_depth0, preset_float32 and preset_bf16_autocast."""
    from bench_training import preset_flops, preset_modules, random_llama

    hidden, mlp, layers, heads, vocab = args.shape
    n, t = args.preset_samples, args.tokens
    if device.type == "cpu":
        torch.set_num_threads(1)  # the tiny check: threads only contend on a shared machine
    log(f"{device}: a random Llama, hidden {hidden}, MLP {mlp}, {layers} layers; {n} x {t} positions")
    model = random_llama(hidden, mlp, layers, heads, vocab, t, device=device, kv_heads=args.kv_heads)
    tail, preset, kl_only = preset_modules(model)
    g = torch.Generator(device=device).manual_seed(0)
    positions = torch.arange(t, device=device).expand(n, t).contiguous()
    mask = torch.ones(n, t, dtype=torch.bool, device=device)
    with torch.no_grad():
        embeddings = model.model.embed_tokens(torch.randint(1, vocab, (n, t), generator=g, device=device))
        final = tail(embeddings, positions)
    merged_head = model.lm_head.weight.detach()
    expert_head = merged_head + 0.02 * torch.randn(merged_head.shape, generator=g, device=device)
    target = final + 0.1 * torch.randn(final.shape, generator=g, device=device)
    del model
    variants = {"kl_depth0": (kl_only, final, None), "preset_float32": (preset, embeddings, None),
                "preset_bf16_autocast": (preset, embeddings, torch.bfloat16)}
    first_input_s = {}  # variant -> seconds of its one-time pass through the frozen blocks
    for k in args.train_blocks:  # the preset's cheaper training: the last k blocks train from their input
        name = f"preset_top{k}_bf16_autocast"
        make, inputs, first_input_s[name] = top_blocks_variant(tail, preset, embeddings, positions, k, device)
        variants[name] = (make, inputs, torch.bfloat16)

    def timed_run(make, inputs, autocast, steps):
        torch.manual_seed(0)
        module = make()
        tail.compute_dtype = autocast
        sync(device)
        start = time.perf_counter()
        train_surgery(module, inputs, target, mask, positions, loss="kl", steps=steps, lr=1e-3, seed=0,
                      expert_head=expert_head, merged_head=merged_head, kl_chunk_size=args.chunk)
        sync(device)
        tail.compute_dtype = None
        return time.perf_counter() - start

    full_positions, stopped, refit = 40 * 512, *args.preset_steps
    results, rows = {}, []
    for name, (make, inputs, autocast) in variants.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        per_steps = []
        for _ in range(args.repeats):
            one = timed_run(make, inputs, autocast, 1)
            per_steps.append((timed_run(make, inputs, autocast, 1 + args.steps) - one) / args.steps)
        per_step = statistics.median(per_steps)
        scale = full_positions / (n * t)
        batch = args.preset_batch or 40  # records per step: the stopped run has 32, the refit all 40
        domain_s = per_step * scale * (stopped * min(batch, 32) + refit * min(batch, 40)) / 40
        once = first_input_s.get(name, 0.0) * scale
        domain_s += once  # train_blocks: the frozen blocks' forward, once per record
        results[name] = {"seconds_per_step": per_step, "per_step_runs": per_steps,
                         **({"first_input_seconds_at_20480_positions": once} if name in first_input_s else {}),
                         "seconds_per_step_at_20480_positions": per_step * scale,
                         "minutes_per_domain": domain_s / 60,
                         "peak_cuda_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        rows.append([name, f"{per_step:.4f}", f"{per_step * scale:.2f}", f"{domain_s / 60:.2f}"])
        log(f"{name}: {per_step:.4f} s/step")
    print_table(f"preset: best's step on {device} ({machine_info()['cuda'] or 'cpu'}), hidden {hidden}, {layers} layers, "
                f"{n} x {t} positions measured; minutes per domain for {stopped} + {refit} (refit) steps of "
                f"{args.preset_batch or 'all'} records (the full batch: 20,480 positions; target: 10)", ["variant", "s/step", "s/step at 20480", "min per domain"], rows)
    return {"shape": dict(zip(("hidden", "mlp", "layers", "heads", "vocab"), args.shape)), "rows": n, "tokens": t,
            "train_blocks": args.train_blocks,
            "steps": {"stopped": stopped, "refit": refit}, "batch_size": args.preset_batch, "measured": results,
            "kv_heads": args.kv_heads,
            "flop_model": preset_flops(hidden, mlp, layers, vocab, n, t, kl_matmuls=3 if n * t <= args.chunk else 5,
                                       kv_hidden=hidden // heads * args.kv_heads)}


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.preset:
        result = preset_step(args, device)
        write_json("gpu_preset_step", {"machine": machine_info(), "args": vars(args), "device": str(device),
                                       "preset": result}, args.out)
        return
    log(f"{device}: H {args.hidden}, V {args.vocab}, {args.samples} x {args.tokens} positions, {args.steps} steps")
    tensors = synthetic(args, device)
    results, rows = {}, []
    run(tensors, VARIANTS[args.variants[0]], 1, args, device)  # process warm-up (CUDA context, kernels)
    for name in args.variants:
        options = VARIANTS[name]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        setups, per_steps = [], []
        for _ in range(args.repeats):
            setup_s, _ = run(tensors, options, 1, args, device)  # target build + one step
            total_s, history = run(tensors, options, 1 + args.steps, args, device)
            setups.append(setup_s)
            per_steps.append((total_s - setup_s) / args.steps)
        setup_s, per_step = statistics.median(setups), statistics.median(per_steps)
        full = args.total_steps * args.domains * per_step + args.domains * setup_s
        results[name] = {"options": options, "setup_s": setup_s, "per_step_runs": per_steps, "seconds_per_step": per_step,
                         "seconds_total_steps_domains": full, "first_loss": history[0], "last_loss": history[-1],
                         "peak_cuda_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        rows.append([name, f"{setup_s:.3f}", f"{per_step:.4f}", f"{full:.1f}", f"{full / 60:.2f}", history[-1]])
        log(f"{name}: {per_step:.4f} s/step")
    print_table(f"measured on {device} ({machine_info()['cuda'] or 'cpu'}): {args.domains} domains x "
                f"{args.total_steps} steps", ["variant", "setup s", "s/step", "total s", "total min", "last loss"], rows)
    out = args.out
    if out is None and args.small:
        out = os.path.join(RESULTS_DIR, "gpu_kl_scale_small.json")
    write_json("gpu_kl_scale", {"machine": machine_info(), "args": vars(args), "device": str(device),
                                "measured": results}, out)


if __name__ == "__main__":
    main()
