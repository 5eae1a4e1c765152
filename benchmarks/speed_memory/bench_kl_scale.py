"""KL surgery at the paper's shapes on CPU: time per step of exact vs cached-target vs positions-per-step,
extrapolated, plus the accuracy cost of the cached targets and a FLOP-based estimate for one H200.

Paper shapes: H 4096, V 32000, 50 samples x 512 tokens per domain (held_out 0.2 -> 20480 training
positions), 3 domains, 500 steps. A full-batch float32 step is ~27 TFLOP, far too much for this CPU, so
we time the loss forward + backward (the whole cost of a KL step: the surgery module itself is a rank-16
matmul) on ``--positions`` positions at the full H and V and scale linearly to 20480 positions (every
matmul and elementwise op of the step is linear in positions). The variants:

* exact:         losses.kl_loss, float32, chunks checkpointed (today's path; 5 [P x H x V] matmuls)
* cached-chunked: kl_targets topk target, checkpointed chunks (3 matmuls: forward, recompute, backward)
* cached-single:  topk target, one chunk, no checkpoint (2 matmuls): the path positions-per-step takes
* bf16-dense:     the full distribution in bfloat16, one chunk

    python benchmarks/speed_memory/bench_kl_scale.py            # ~2-4 min on one core
    python benchmarks/speed_memory/bench_kl_scale.py --positions 128 --repeats 1   # quicker

The H200 figures are estimates from FLOP counts, not measurements: run benchmarks/gpu/gpu_kl_scale.py there.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import interleaved, log, machine_info, median, print_table, timed, write_json  # noqa: E402

from mergekit_darts.repair.train.kl import build_kl_target, kl_to_target  # noqa: E402
from mergekit_darts.repair.train.kl import kl_loss  # noqa: E402

# matmuls of [P x H] x [H x V] per step (each 2 P H V FLOP)
MATMULS = {"exact": 5, "cached-chunked": 3, "cached-single": 2, "bf16-dense": 2}
# bf16 dense peak as given in issue 19's brief (~790 TFLOP/s); float32 without tensor cores 67 TFLOP/s
# and HBM3e 4.8 TB/s (H200 SXM datasheet figures).
H200 = {"bf16_tflops": 790.0, "fp32_tflops": 67.0, "hbm_tb_s": 4.8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--held-out", type=float, default=0.2)
    p.add_argument("--domains", type=int, default=3)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--positions", type=int, default=256, help="positions timed per step on this CPU")
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--pps", type=int, nargs="+", default=[1024, 4096], help="kl_positions_per_step to estimate")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--utilisation", type=float, default=0.4,
                   help="assumed share of the H200's peak matmul FLOP/s reached (estimate only)")
    p.add_argument("--accuracy-hidden", type=int, default=512)
    p.add_argument("--accuracy-positions", type=int, default=256)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def synthetic(positions, hidden, vocab, seed=0):
    """Merged/expert states and heads scaled so the expert's entropy is a few nats (like an LM's)."""
    g = torch.Generator().manual_seed(seed)
    corrected = torch.randn(positions, hidden, generator=g)
    expert = corrected + 0.5 * torch.randn(positions, hidden, generator=g)
    scale = 3.0 / hidden ** 0.5  # logit std ~3
    expert_head = torch.randn(vocab, hidden, generator=g) * scale
    merged_head = expert_head + 0.3 * torch.randn(vocab, hidden, generator=g) * scale
    return corrected, expert, expert_head, merged_head


def step_fn(variant, corrected, expert, expert_head, merged_head, target, chunk):
    rows = torch.arange(corrected.shape[0])

    def run():
        h = corrected.clone().requires_grad_(True)
        if variant == "exact":
            value = kl_loss(h, expert, expert_head, merged_head, chunk_size=chunk)
        else:
            value = kl_to_target(h, rows, target, merged_head, chunk_size=chunk if variant == "cached-chunked" else 1 << 30)
        value.backward()
    return run


def accuracy(args):
    """KL value and gradient of each cached target against the exact loss on a smaller H."""
    corrected, expert, expert_head, merged_head = synthetic(args.accuracy_positions, args.accuracy_hidden, args.vocab, 1)
    rows = torch.arange(corrected.shape[0])

    def value_grad(fn):
        h = corrected.clone().requires_grad_(True)
        value = fn(h)
        value.backward()
        return float(value.detach()), h.grad

    exact, exact_grad = value_grad(lambda h: kl_loss(h, expert, expert_head, merged_head))
    with torch.no_grad():
        log_p = torch.log_softmax(expert @ expert_head.T, -1)
        entropy = float(-(log_p.exp() * log_p).sum(-1).mean())
    out = {"shape": {"positions": args.accuracy_positions, "hidden": args.accuracy_hidden, "vocab": args.vocab},
           "expert_entropy_nats": entropy, "exact_kl": exact, "targets": {}}
    for name, kind, k in [("topk-64", "topk", 64), ("topk-256", "topk", 256), ("topk-1024", "topk", 1024),
                          ("topk-all", "topk", args.vocab), ("bf16-dense", "bf16", 0)]:
        target = build_kl_target(kind, expert, expert_head, top_k=max(k, 1))
        value, grad = value_grad(lambda h: kl_to_target(h, rows, target, merged_head))
        entry = {"kl": value, "kl_relative_error": (value - exact) / exact,
                 "grad_relative_error": float((grad - exact_grad).norm() / exact_grad.norm()),
                 "grad_cosine": float(torch.nn.functional.cosine_similarity(grad.flatten(), exact_grad.flatten(), 0))}
        if kind == "topk":
            entry["mean_tail_mass"] = float(target.tail_mass.mean())
        out["targets"][name] = entry
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    positions_full = args.samples * args.tokens - round(args.held_out * args.samples) * args.tokens
    H, V, P = args.hidden, args.vocab, args.positions
    log(f"timing {P} positions at H={H}, V={V}; full batch = {positions_full} positions per domain")
    corrected, expert, expert_head, merged_head = synthetic(P, H, V)
    build_s = timed(lambda: build_kl_target("topk", expert, expert_head, top_k=args.top_k), clock="cpu")
    topk = build_kl_target("topk", expert, expert_head, top_k=args.top_k)
    dense = build_kl_target("bf16", expert, expert_head)
    chunk = max(1, P // 2)  # two checkpointed chunks, as at full scale
    variants = {name: step_fn(name, corrected, expert, expert_head, merged_head,
                              dense if name == "bf16-dense" else topk, chunk) for name in MATMULS}
    for run in variants.values():  # warm-up: first-call allocations and kernel selection
        run()
    times = interleaved(variants, args.repeats, clock="cpu")
    per_position = {name: median(values) / P for name, values in times.items()}

    flop_matmul = 2 * H * V  # per position
    rows, results = [], {}
    for name, seconds in per_position.items():
        full_step = seconds * positions_full
        achieved = MATMULS[name] * flop_matmul / seconds / 1e9
        results[name] = {"cpu_seconds_per_position": seconds, "cpu_seconds_per_full_batch_step": full_step,
                         "cpu_hours_500_steps_3_domains": full_step * args.steps * args.domains / 3600,
                         "achieved_gflops": achieved, "matmuls_per_step": MATMULS[name]}
        rows.append([name, P, f"{median(times[name]):.2f}", f"{full_step:.1f}", f"{achieved:.1f}"])
    for pps in args.pps:
        step = per_position["cached-single"] * pps
        results[f"pps-{pps}"] = {"cpu_seconds_per_step": step, "positions": pps}
        rows.append([f"cached-single pps={pps}", pps, "-", f"{step:.1f}", "-"])
    print_table("CPU, one thread (process CPU time), full batch extrapolated linearly in positions",
                ["variant", "positions", "measured s", "s/step at full batch", "GFLOP/s"], rows)

    # H200 estimate: matmul FLOPs at an assumed utilisation + elementwise traffic on [P, V] float32
    # (about 8 passes per step: logits, log-softmax (2), exp, products, gradient (3)) at 60% of HBM
    def h200_seconds(matmuls, positions, dtype):
        peak = H200["bf16_tflops"] if dtype == "bf16" else H200["fp32_tflops"]
        compute = matmuls * 2 * positions * H * V / (peak * 1e12 * args.utilisation)
        traffic = 8 * 4 * positions * V / (H200["hbm_tb_s"] * 1e12 * 0.6)
        return compute + traffic

    build_once = args.domains * h200_seconds(1, positions_full, "bf16")
    scenarios = {
        "exact float32 full batch": (5, positions_full, "fp32"),
        "cached topk + bf16 matmuls, full batch (chunked)": (3, positions_full, "bf16"),
        "cached topk + bf16 matmuls, full batch (one chunk)": (2, positions_full, "bf16"),
        **{f"cached topk + bf16 matmuls, pps={pps}": (2, pps, "bf16") for pps in args.pps},
    }
    estimate = {}
    est_rows = []
    for name, (matmuls, positions, dtype) in scenarios.items():
        total = args.steps * args.domains * h200_seconds(matmuls, positions, dtype)
        if not name.startswith("exact"):
            total += build_once
        estimate[name] = {"seconds_total": total, "minutes_total": total / 60, "within_5_minutes": total <= 300}
        est_rows.append([name, f"{total:.0f}", f"{total / 60:.1f}", total <= 300])
    print_table(f"ESTIMATE (not measured) for one H200: {args.domains} domains x {args.steps} steps, "
                f"utilisation {args.utilisation:.0%} of peak", ["scenario", "s", "min", "<= 5 min"], est_rows)

    log("accuracy of cached targets")
    acc = accuracy(args)
    acc_rows = [[name, f"{e['kl']:.5f}", f"{e['kl_relative_error']:+.2e}", f"{e['grad_relative_error']:.2e}",
                 f"{e.get('mean_tail_mass', 0):.2e}"] for name, e in acc["targets"].items()]
    print_table(f"accuracy vs exact KL {acc['exact_kl']:.5f} (expert entropy {acc['expert_entropy_nats']:.2f} nats)",
                ["target", "KL", "rel. error", "grad rel. error", "tail mass"], acc_rows)

    write_json("bench_kl_scale", {
        "machine": machine_info(), "args": vars(args), "positions_full_batch": positions_full,
        "clock": "process CPU time, torch threads = args.threads",
        "cpu_topk_build_seconds_per_position": build_s / P,
        "cpu": results,
        "h200_estimate": {"note": "ESTIMATE from FLOP counts, not a measurement", "assumptions": {
            **H200, "utilisation": args.utilisation, "elementwise_passes": 8, "hbm_efficiency": 0.6,
            "target_build_seconds_all_domains": build_once}, "scenarios": estimate},
        "accuracy": acc,
    }, args.out)


if __name__ == "__main__":
    main()
