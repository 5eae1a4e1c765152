"""The empty directions of ``adapter_init: delta`` (issue 45 ask 1): zero-filled (both factors zero,
they never train: the code before) against LoRA-filled (random ``down``, zero ``up``: what
``start_from_deltas`` does now), on a tiny family whose experts changed only q_proj / v_proj by a
rank-4 delta (a PEFT LoRA on q/v merged into the weights), repaired with ``adapter_init: delta``,
``depth: all``, ``depth_rank: 2`` (below the delta's rank, as the preset's 8 is below a rank-16 LoRA)
and ``loss: kl``. Every other linear and the head have no delta at all: zero-filled, only the
truncated q/v adapters train. ``no_regret: false``: the figure is what training reached.

    python benchmarks/demo_quality/delta_fill.py [--seeds 1 2 3] [--steps 100]

Prints the held-out KL gap closed per seed, domain and variant (and the untrained extract's), and
writes results/delta_fill.json. The two variants share one capture (the cache), so they differ only
in the start of the empty directions.
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, median, print_table, write_json  # noqa: E402


def merge(paths, out):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    text = (f"merge_method: task_arithmetic\nbase_model: {paths['base']}\nmodels:\n"
            + "".join(f"  - model: {paths[name]}\n    parameters: {{weight: 0.5}}\n" for name in ("math", "code"))
            + "dtype: float32\n")
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), out, options=MergeOptions(quiet=True))
    return text


def calibration(root, name, seed, count):
    from mergekit_darts.tiny import DEFAULT_WORDS

    rng = random.Random(f"{name}-{seed}")
    words = list(DEFAULT_WORDS)
    path = os.path.join(root, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))}) + "\n")
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=64)
    add_output_options(parser)
    args = parser.parse_args()

    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.train import delta_init
    from mergekit_darts.tiny import make_low_rank_expert, make_random_model

    lora_filled = delta_init.empty_rows
    variants = {"zero-filled": lambda down, up: (down != down).all(dim=1), "LoRA-filled": lora_filled}
    rows, records = [], []
    for seed in args.seeds:
        root = tempfile.mkdtemp(prefix=f"delta_fill_{seed}_")
        paths = {"base": os.path.join(root, "base")}
        make_random_model(paths["base"], seed=seed, hidden_size=args.hidden)
        for offset, name in enumerate(("math", "code"), start=1):
            paths[name] = make_low_rank_expert(paths["base"], os.path.join(root, name), seed=100 * seed + offset,
                                               rank=4)
        merged = os.path.join(root, "merged")
        config = merge(paths, merged) + (
            "surgery:\n  loss: kl\n  adapter_init: delta\n  depth: all\n  depth_rank: 2\n  rank: 2\n"
            f"  no_regret: false\n  max_positions: 32\n  steps: {args.steps}\n  lr: 0.01\n  device: cpu\n"
            f"  dtype: float32\n  held_out: 0.25\n  seed: {seed}\n  cache_dir: {os.path.join(root, 'cache')}\n"
            "  domains:\n" + "".join(
                f"    {name}:\n      model: {paths[name]}\n      calibration: {{path: "
                f"{calibration(root, name, seed, args.prompts)}, field: text, samples: {args.prompts}}}\n"
                for name in ("math", "code")))
        for variant, rule in variants.items():
            log(f"seed {seed}: {variant}")
            delta_init.empty_rows = rule
            out = os.path.join(root, f"out-{variant}")
            shutil.copytree(merged, out)
            try:
                report = run_surgery(config, out, progress=False)
            finally:
                delta_init.empty_rows = lora_filled
            for name, entry in report["domains"].items():
                record = {"seed": seed, "domain": name, "variant": variant,
                          "gap_closed": entry["held_out_kl"]["gap_closed"],
                          "extract_gap_closed": entry["baseline"]["held_out_kl"]["gap_closed"],
                          "empty_directions": entry["baseline"]["empty_directions"]}
                records.append(record)
                rows.append([seed, name, variant, record["extract_gap_closed"], record["gap_closed"]])
        shutil.rmtree(root, ignore_errors=True)
    print_table("held-out KL gap closed (adapter_init: delta, q/v-only experts)",
                ["seed", "domain", "start", "untrained extract", "trained"], rows)
    summary = {variant: median([r["gap_closed"] for r in records if r["variant"] == variant]) for variant in variants}
    print("\nmedian gap closed over seeds and domains: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    write_json("delta_fill", {"settings": vars(args), "machine": machine_info(), "records": records,
                              "median_gap_closed": summary}, path=args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
