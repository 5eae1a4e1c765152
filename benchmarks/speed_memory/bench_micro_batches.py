"""What ``micro_batch_size`` saves: the peak memory of one ``preset: best`` training step (rank-64
correction plus rank-8 adapters on every linear of every block, exact KL, full batch) with the whole
batch at once and with micro-batches, and its seconds (docs/scale.md).

    python benchmarks/speed_memory/bench_micro_batches.py                     # CPU, about 2 minutes on 2 cores
    python benchmarks/speed_memory/bench_micro_batches.py --micro 8 4 2 1     # micro-batch sizes besides the whole batch

Each variant runs in a fresh process on the same random Llama with Llama-2-7B's proportions at 1/8
of its width (hidden 512, MLP 1376; ``--layers`` blocks, vocabulary 4000) and the same seeded rows: the
process's resident-memory high-water mark is reset after the setup (``/proc/self/clear_refs``), so
the figure is what the step itself adds. The first-step loss of every variant is printed beside it:
equal, because a micro-batched step is the same step.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, machine_info, print_table, write_json  # noqa: E402


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def one_step(settings: dict) -> dict:
    """Child process: build the model and rows, reset the memory peak, train one step; what it added."""
    import torch

    from bench_training import preset_modules, preset_rows, random_llama
    from mergekit_darts.repair.train.loop import train_surgery

    torch.set_num_threads(settings["threads"])
    n, t, vocab = settings["rows"], settings["tokens"], 4000
    model = random_llama(512, 1376, settings["layers"], 8, vocab, t)
    tail, preset, _ = preset_modules(model)
    data = preset_rows(model, tail, n, t)
    del model
    torch.manual_seed(0)
    module = preset()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current resident size
    start_kib = _status_kib("VmRSS")
    started = time.perf_counter()
    history = train_surgery(module, data["embeddings"], data["target"], data["mask"], data["positions"], loss="kl",
                            steps=1, lr=1e-3, micro_batch_size=settings["micro"], **data["heads"])
    return {"micro_batch_size": settings["micro"], "seconds": time.perf_counter() - started,
            "peak_added_mib": (_status_kib("VmHWM") - start_kib) / 1024, "first_loss": history[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_step(json.loads(args.child))))
        return
    rows = []
    for micro in [None, *args.micro]:
        settings = {"micro": micro, "rows": args.rows, "tokens": args.tokens, "layers": args.layers,
                    "threads": args.threads}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(settings)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    whole = rows[0]["peak_added_mib"]
    print_table(f"one preset: best step, {args.rows} x {args.tokens} positions, {args.layers} blocks of hidden 512 "
                f"(float32, CPU, {args.threads} threads): peak memory the step adds",
                ["micro_batch_size", "peak added (MiB)", "of the whole batch's", "seconds", "first-step loss"],
                [[r["micro_batch_size"] or "(whole batch)", f"{r['peak_added_mib']:.0f}",
                  f"{r['peak_added_mib'] / whole:.2f}", f"{r['seconds']:.1f}", f"{r['first_loss']:.6f}"] for r in rows])
    write_json("bench_micro_batches", {"benchmark": "micro_batches", "machine": machine_info(),
                                       "settings": {k: v for k, v in vars(args).items() if k != "child"},
                                       "result": rows}, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
