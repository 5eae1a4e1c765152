"""Surgery training speed on cached tensors, and the speed-up over recomputing the merged model.

Part 1 — steps/s of ``mergekit_darts.repair.train.loop.train_surgery`` (the real training loop, full batch,
Adam) on random cached tensors at the paper's shapes (H=4096, T=512, N=50, rank 16), per loss:
l1, ewl1 (hidden-state losses) and kl (vocabulary ``--kl-vocab``, its own smaller N/T by default
because every kl step is several [positions x vocab x H] matmuls). The shapes actually run are
printed and stored.

Part 2 — the speed-up of caching. The original surgery code runs the merged model's forward pass
at every training step; this package captures the hidden states once. On a model small enough to
run here (default hidden 512, 4 layers) we time, interleaved and repeated:

* ``recompute``: merged-model forward (no grad, final hidden states) + one surgery step,
* ``cached``:    one surgery step on the cached states,

and report time(recompute) / time(cached), median over paired rounds (process CPU time by default:
steady on a shared machine; ``--clock wall`` for wall time). (The expert's target states
are taken as cached in both variants, so this understates what recomputing both models would cost.)

    python benchmarks/speed_memory/bench_training.py                         # CPU defaults, ~2-3 min on 2 cores
    python benchmarks/speed_memory/bench_training.py --n 50 --kl-n 50 --kl-t 512 --device cuda   # paper shapes on a GPU
    python benchmarks/speed_memory/bench_training.py --threads-check    # tiny steps, 1 vs all threads (oversubscription)
    python benchmarks/speed_memory/bench_training.py --preset-ratio     # preset: best step / loss: kl step (docs/scale.md)

Part 3 (``--preset-ratio``, alone) — what a ``preset: best`` step (rank-64 final-state correction plus rank-8
adapters on every linear of every block, the frozen blocks run forward and backward from the cached
embeddings, exact KL) costs against a ``loss: kl`` step at depth 0 (the same rank-64 correction on the
cached final states, exact KL), interleaved in one process on the same random Llama. The default
shape keeps Llama-2-7B's proportions at 1/8 of its width (hidden 512, MLP 1376, 32 layers, vocabulary
4000), so the ratio of block to head FLOPs per position is the 7B's; the FLOP model's ratio for the
same shapes is printed beside the measured one. The frozen blocks run as the CPU runs them (float32);
``--preset-autocast`` adds the bfloat16-autocast path a GPU takes, run under CPU autocast.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, interleaved, log, machine_info, median, paired_ratio, print_table, timed, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--t", type=int, default=512, help="sequence length (= max_positions)")
    p.add_argument("--n", type=int, default=10, help="calibration sequences (paper: 50)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--losses", nargs="+", default=["l1", "ewl1", "kl"])
    p.add_argument("--kl-vocab", type=int, default=32000, help="vocabulary of the kl loss (Llama-2: 32000)")
    p.add_argument("--kl-n", type=int, default=1)
    p.add_argument("--kl-t", type=int, default=128)
    p.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the cached hidden states (the paper caches bfloat16)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", nargs="+", default=None,
                   help="devices to run part 1 on (default: cpu, plus cuda when available)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    # part 2
    p.add_argument("--speedup-hidden", type=int, default=512)
    p.add_argument("--speedup-layers", type=int, default=4)
    p.add_argument("--speedup-vocab", type=int, default=32000)
    p.add_argument("--speedup-n", type=int, default=8)
    p.add_argument("--speedup-t", type=int, default=512)
    p.add_argument("--speedup-loss", default="ewl1")
    p.add_argument("--speedup-repeats", type=int, default=5)
    p.add_argument("--skip-speedup", action="store_true")
    p.add_argument("--threads-check", action="store_true",
                   help="only: small-shape ewl1 steps with 1 vs all CPU threads, interleaved (oversubscription check)")
    p.add_argument("--preset-ratio", action="store_true",
                   help="only: a preset: best step vs a loss: kl (depth 0) step, interleaved (part 3)")
    p.add_argument("--preset-shape", nargs=5, type=int, default=[512, 1376, 32, 8, 4000],
                   metavar=("HIDDEN", "MLP", "LAYERS", "HEADS", "VOCAB"), help="the random Llama of part 3")
    p.add_argument("--preset-rows", nargs=2, type=int, default=[4, 64], metavar=("N", "T"),
                   help="records x tokens per step in part 3 (full batch)")
    p.add_argument("--preset-autocast", action="store_true", help="part 3 also times the bfloat16-autocast blocks")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="clock of the speed-up ratio (part 2 runs on CPU; cpu time is steadier on a shared machine)")
    add_output_options(p)
    return p.parse_args(argv)


def cached_tensors(n, t, hidden, dtype, device, seed=0):
    """Random stand-ins for captured data: merged/target [N,T,H], mask with some right padding,
    position ids, entropies."""
    g = torch.Generator().manual_seed(seed)
    merged = torch.randn(n, t, hidden, generator=g)
    target = merged + 0.1 * torch.randn(n, t, hidden, generator=g)
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    positions = torch.arange(t).unsqueeze(0).expand(n, t).contiguous()
    entropy = torch.rand(n, t, generator=g) * 5
    return {
        "merged": merged.to(dtype).to(device), "target": target.to(dtype).to(device), "mask": mask.to(device),
        "position_ids": positions.to(device), "entropy": entropy.to(device),
    }


def sync_for(device):
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def train_fn(module, data, loss, steps, heads=None):
    from mergekit_darts.repair.train.loop import train_surgery

    heads = heads or {}

    def run():
        train_surgery(module, data["merged"], data["target"], data["mask"], data["position_ids"],
                      entropy=data["entropy"], loss=loss, steps=steps, lr=1e-3, **heads)

    return run


def bench_steps(args, device) -> list:
    """Part 1: steps/s of train_surgery per loss on ``device``."""
    from mergekit_darts.remote_code.surgery import DomainSurgery

    dtype = getattr(torch, args.cache_dtype)
    sync = sync_for(device)
    rows = []
    for loss in args.losses:
        n, t = (args.kl_n, args.kl_t) if loss == "kl" else (args.n, args.t)
        log(f"{device}: loss {loss}, N={n} T={t} H={args.hidden}")
        data = cached_tensors(n, t, args.hidden, dtype, device)
        heads = {}
        if loss == "kl":
            g = torch.Generator().manual_seed(1)
            head = torch.randn(args.kl_vocab, args.hidden, generator=g) / args.hidden ** 0.5
            heads = {"expert_head": head.to(dtype).to(device),
                     "merged_head": (head + 0.01 * torch.randn(head.shape, generator=g)).to(dtype).to(device)}
        module = DomainSurgery(args.hidden, rank=args.rank, max_positions=args.t, method="darts")
        train_fn(module, data, loss, 1, heads)()  # warm-up (allocator, kernels)
        per_step, per_step_cpu = [], []
        for _ in range(args.repeats):
            cpu_start = time.process_time()
            per_step.append(timed(train_fn(module, data, loss, args.steps, heads), sync) / args.steps)
            per_step_cpu.append((time.process_time() - cpu_start) / args.steps)
        step_s = median(per_step)
        positions = int(data["mask"].sum())
        rows.append({
            "device": str(device), "loss": loss, "n": n, "t": t, "hidden": args.hidden, "rank": args.rank,
            "vocab": args.kl_vocab if loss == "kl" else None, "cache_dtype": args.cache_dtype,
            "valid_positions": positions, "seconds_per_step": step_s, "steps_per_s": 1.0 / step_s,
            "positions_per_s": positions / step_s, "seconds_per_step_all": per_step,
            "cpu_seconds_per_step": median(per_step_cpu), "cpu_seconds_per_step_all": per_step_cpu,
            "seconds_for_500_steps": 500 * step_s,
        })
        del data, heads
    return rows


def bench_speedup(args) -> dict:
    """Part 2: (merged forward + surgery step) / (surgery step on cached states), on CPU."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.remote_code.surgery import DomainSurgery
    from mergekit_darts.tiny import make_random_model

    h, n, t = args.speedup_hidden, args.speedup_n, args.speedup_t
    with tempfile.TemporaryDirectory() as tmp:
        log(f"speed-up: model hidden={h} layers={args.speedup_layers}, N={n} T={t}")
        make_random_model(tmp, hidden_size=h, layers=args.speedup_layers, vocab_size=args.speedup_vocab,
                          max_position_embeddings=max(t, 256))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, args.speedup_vocab, (n, t), generator=g)
    data = cached_tensors(n, t, h, torch.float32, "cpu")
    attention_mask = data["mask"].long()

    def merged_forward():
        with torch.no_grad():
            return model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    with torch.no_grad():
        data["merged"] = merged_forward()  # the cached variant trains on the real merged states
    module = DomainSurgery(h, rank=args.rank, max_positions=t, method="darts")
    cached_step = train_fn(module, data, args.speedup_loss, 1)

    def recompute_step():
        fresh = dict(data, merged=merged_forward())
        train_fn(module, fresh, args.speedup_loss, 1)()

    recompute_step(), cached_step()  # warm-up
    times = interleaved({"recompute": recompute_step, "cached": cached_step}, args.speedup_repeats,
                        clock=args.clock)
    return {
        "model": {"hidden": h, "layers": args.speedup_layers, "vocab": args.speedup_vocab,
                  "params": sum(p.numel() for p in model.parameters())},
        "n": n, "t": t, "loss": args.speedup_loss, "device": "cpu", "clock": args.clock,
        "seconds": times,
        "seconds_per_step": {k: median(v) for k, v in times.items()},
        "speedup_recompute_over_cached": paired_ratio(times["recompute"], times["cached"]),
    }


def threads_check(args, n=40, t=64, hidden=64, steps=100, repeats=4) -> dict:
    """Wall seconds per small ewl1 step with 1 thread vs os.cpu_count() threads, interleaved."""
    from mergekit_darts.remote_code.surgery import DomainSurgery

    data = cached_tensors(n, t, hidden, torch.float32, "cpu")
    many = os.cpu_count() or 1

    def with_threads(count):
        def run():
            torch.set_num_threads(count)
            train_fn(DomainSurgery(hidden, rank=args.rank, max_positions=t), data, "ewl1", steps)()
        return run

    times = interleaved({"1": with_threads(1), str(many): with_threads(many)}, repeats)
    torch.set_num_threads(args.threads or many)
    per_step = {k: [x / steps for x in v] for k, v in times.items()}
    result = {"n": n, "t": t, "hidden": hidden, "steps": steps, "seconds_per_step": per_step,
              "ratio_many_over_one": paired_ratio(times[str(many)], times["1"])}
    r = result["ratio_many_over_one"]
    print_table(f"Threads check: ewl1 step N={n} T={t} H={hidden}, wall, {repeats} interleaved rounds of {steps} steps",
                ["threads", "s/step (median)", "all rounds"],
                [[k, median(v), " ".join(f"{x:.4f}" for x in v)] for k, v in per_step.items()]
                + [[f"{many} / 1", r["median"], f"{r['min']:.1f}..{r['max']:.1f}"]])
    return result


def random_llama(hidden, mlp, layers, heads, vocab, positions, device="cpu", seed=0, kv_heads=None):
    """A random float32 Llama of that shape, built on ``device``, in eval mode (``kv_heads``: grouped-query
    attention's key/value heads; default ``heads``)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads or heads,
                                      max_position_embeddings=max(positions, 64), pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).float().eval()


def preset_modules(model, rank=64, depth_rank=8):
    """(the frozen tail of every block, a factory of preset: best's module on it, a factory of the depth-0
    loss: kl module): the tail is copied out of ``model``, which the caller may then drop."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.tail import TailSurgery

    config, layers = model.config, model.config.num_hidden_layers
    tail = FrozenTail(model, layers).requires_grad_(False).eval()
    positions = config.max_position_embeddings

    def preset():
        shape = SurgeryShape("darts", rank=rank, head_rank=0, max_positions=positions, content="relu", depth=layers,
                             depth_rank=depth_rank)
        module = DomainSurgery.from_shape(shape, config.hidden_size, config.vocab_size, tail.targets)
        return TailSurgery(tail, module.to(model.lm_head.weight.device))

    def kl_only():
        shape = SurgeryShape("darts", rank=rank, head_rank=0, max_positions=positions, content="relu")
        return DomainSurgery.from_shape(shape, config.hidden_size, config.vocab_size).to(model.lm_head.weight.device)

    return tail, preset, kl_only


def preset_rows(model, tail, n, t, seed=0) -> dict:
    """Seeded random rows for a preset step on ``model``: its embeddings (the tail's input), the tail's
    final states, a target near them, the mask and positions, and the heads (``expert_head``: the
    merged head plus noise); a dict of train_surgery's tensors."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (n, t), generator=generator)
    positions = torch.arange(t).expand(n, t).contiguous()
    with torch.no_grad():
        embeddings = model.model.embed_tokens(ids)
        final = tail(embeddings, positions)
    head = model.lm_head.weight.detach()
    return {"embeddings": embeddings, "final": final, "target": final + 0.1 * torch.randn(final.shape, generator=generator),
            "mask": torch.ones(n, t, dtype=torch.bool), "positions": positions,
            "heads": {"expert_head": head + 0.02 * torch.randn(head.shape, generator=generator), "merged_head": head}}


def preset_flops(hidden, mlp, layers, vocab, n, t, kl_matmuls=3, kv_hidden=None) -> dict:
    """The FLOP model of docs/scale.md for one full-batch step at these shapes: the blocks forward
    (2 x weights x positions, plus attention scores 4 x t x hidden per position per layer) and backward to
    their inputs (the same again; the adapters' own gradients are left out, < 1 %), and the exact KL's
    [positions x hidden] x [hidden x vocab] matmuls (3 with one chunk: expert and merged logits, the
    merged logits' backward; 5 with checkpointed chunks). ``layers``: the blocks a step runs (all of
    them, or ``train_blocks``' k); ``kv_hidden``: the key/value width under grouped-query attention
    (heads x head size; default ``hidden``: every head its own keys)."""
    positions = n * t
    kv = hidden if kv_hidden is None else kv_hidden
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp
    blocks = 2 * (2 * layers * per_layer * positions + 4 * layers * positions * (t / 2) * hidden)
    kl = kl_matmuls * 2 * positions * hidden * vocab
    return {"blocks": blocks, "kl": kl, "preset_over_kl": (blocks + kl) / kl}


def preset_ratio(args) -> dict:
    """Part 3: seconds per full-batch step, preset: best vs loss: kl at depth 0, interleaved, one process."""
    from mergekit_darts.repair.train.loop import train_surgery

    hidden, mlp, layers, heads, vocab = args.preset_shape
    n, t = args.preset_rows
    model = random_llama(hidden, mlp, layers, heads, vocab, t)
    tail, preset, kl_only = preset_modules(model)
    data = preset_rows(model, tail, n, t)
    embeddings, final, target, mask, positions, heads_ = (
        data[k] for k in ("embeddings", "final", "target", "mask", "positions", "heads"))
    del model

    def step(make, inputs, autocast=None):
        module = make()

        def run():
            tail.compute_dtype = autocast
            train_surgery(module, inputs, target, mask, positions, loss="kl", steps=args.steps, lr=1e-3, **heads_)
            tail.compute_dtype = None
        return run

    variants = {"kl_depth0": step(kl_only, final), "preset_best": step(preset, embeddings)}
    if args.preset_autocast:
        variants["preset_best_bf16_autocast"] = step(preset, embeddings, torch.bfloat16)
    for run in variants.values():
        run()  # warm-up
    times = interleaved(variants, args.repeats, clock=args.clock)
    per_step = {k: [x / args.steps for x in v] for k, v in times.items()}
    flops = preset_flops(hidden, mlp, layers, vocab, n, t)
    result = {"shape": {"hidden": hidden, "mlp": mlp, "layers": layers, "heads": heads, "vocab": vocab},
              "rows": n, "tokens": t, "positions": n * t, "rank": 64, "depth_rank": 8, "steps_per_round": args.steps,
              "clock": args.clock, "seconds_per_step": per_step,
              "median_seconds_per_step": {k: median(v) for k, v in per_step.items()},
              "preset_over_kl": paired_ratio(times["preset_best"], times["kl_depth0"]),
              "flop_model": flops}
    if args.preset_autocast:
        result["bf16_autocast_over_float32"] = paired_ratio(times["preset_best_bf16_autocast"], times["preset_best"])
    r = result["preset_over_kl"]
    print_table(f"preset: best step / loss: kl (depth 0) step: random Llama hidden {hidden}, MLP {mlp}, {layers} layers, "
                f"vocab {vocab}; {n} x {t} positions, full batch, exact KL; {args.repeats} interleaved rounds of "
                f"{args.steps} steps, {args.clock} clock",
                ["variant", "s/step (median)", "all rounds"],
                [[k, median(v), " ".join(f"{x:.3f}" for x in v)] for k, v in per_step.items()]
                + [["preset / kl (measured)", r["median"], f"{r['min']:.1f}..{r['max']:.1f}"],
                   ["preset / kl (FLOP model)", flops["preset_over_kl"], ""]])
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.preset_ratio:
        if args.threads:
            torch.set_num_threads(args.threads)
        write_json("bench_training_preset", {"benchmark": "training_preset_ratio", "settings": vars(args),
                                             "machine": machine_info(), "result": preset_ratio(args)},
                   args.out, overwrite=args.overwrite)
        return
    if args.threads_check:
        write_json("bench_training_threads", {"benchmark": "training_threads", "machine": machine_info(),
                                              "result": threads_check(args)}, args.out, overwrite=args.overwrite)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    steps = []
    for device in devices:
        steps += bench_steps(args, device)
    speedup = None if args.skip_speedup else bench_speedup(args)

    print_table(
        f"Surgery training speed (train_surgery, full batch, Adam; cached states in {args.cache_dtype}; "
        f"{torch.get_num_threads()} CPU thread(s); median of {args.repeats} x {args.steps} steps)",
        ["device", "loss", "N", "T", "H", "vocab", "s/step (wall)", "CPU s/step", "steps/s", "positions/s",
         "500 steps (s)"],
        [[r["device"], r["loss"], r["n"], r["t"], r["hidden"], r["vocab"] or "-", r["seconds_per_step"],
          r["cpu_seconds_per_step"], r["steps_per_s"], r["positions_per_s"], r["seconds_for_500_steps"]]
         for r in steps],
    )
    if speedup:
        s = speedup["speedup_recompute_over_cached"]
        print_table(
            f"Caching speed-up: model hidden {speedup['model']['hidden']}, {speedup['model']['layers']} layers, "
            f"N={speedup['n']} T={speedup['t']}, loss {speedup['loss']}, {args.speedup_repeats} interleaved rounds, "
            f"{args.clock} clock",
            ["s/step recompute", "s/step cached", "recompute/cached (median)", "min..max"],
            [[speedup["seconds_per_step"]["recompute"], speedup["seconds_per_step"]["cached"], s["median"],
              f"{s['min']:.1f}..{s['max']:.1f}"]],
        )
    write_json("bench_training", {
        "benchmark": "training", "settings": vars(args), "machine": machine_info(),
        "steps": steps, "speedup": speedup,
    }, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
