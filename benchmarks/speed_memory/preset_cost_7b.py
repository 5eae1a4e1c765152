"""The FLOP estimate of ``preset: best``'s training for a Llama-2-7B on one H200 (docs/scale.md), from the
step counts early stopping chose on the demo (results/preset_steps.json) and the CPU-measured ratio of a
preset step to a ``loss: kl`` step (results/bench_training_preset.json). An ESTIMATE: no 7B was trained.

    python benchmarks/speed_memory/preset_cost_7b.py            # prints the table, writes results/preset_cost_7b.json

The model (bench_training.preset_flops at 7B shapes): per position, the 32 blocks forward (2 x 6.48e9
weights + causal attention scores) and backward to their inputs (the same again), and the exact KL's
[positions x 4096] x [4096 x 32000] matmuls (5: checkpointed chunks). Rates: the blocks at 40 % of the
H200's ~790 TFLOP/s bf16 peak under autocast, or at 67 TFLOP/s in float32 (what ran before), the KL at
67 TFLOP/s (float32; docs/scale.md's KL section). Positions: 40 training records of 512 tokens (the
paper's 50 prompts, 20 % held out); with early stopping the run trains on 32 of them (8 validate, one
forward every ``eval_every`` steps) up to its stop, then refits the chosen step count on all 40. A run
with ``batch_size`` B below the record count trains B records per step (both the stopped run and the
refit), so its step costs B / records of a full-batch one.

Below the per-run rows, one row per tag of preset_steps.json: the median and largest minutes of its
domain runs, how many fit the target, and its mean task scores over its seeds — cost and quality of
each variant side by side. Then the cheaper recipes (``RECIPES``: every block on minibatches, with early stopping
or at a fixed step count, the step counts their demo runs chose), for Llama-2-7B and Llama-3-8B with each KL
setting: issue 52's 7B figure for both vocabularies.
"""

import json
import os
import statistics
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, machine_info, print_table, write_json  # noqa: E402
from bench_training import preset_flops  # noqa: E402

BF16_BLOCKS, FP32 = 0.4 * 790e12, 67e12
RECORDS, TOKENS, VALIDATION, EVAL_EVERY = 40, 512, 8, 25
TARGET_MIN = 10
# recipes priced on both 7B shapes from the step counts their demo runs chose (the AVX2 family, six seeds, the
# linear final-state correction): name -> (the tags of preset_steps.json that trained it, the overrides those runs
# had on top of the full-batch early-stopping preset of 2026-12-06)
RECIPES = {"batch_size: 8, early stopping": (("b8_avx2_a", "b8_avx2_b"), {"batch_size": 8}),
           "batch_size: 16, 500 fixed steps": (("fixed_b16_avx2_a", "fixed_b16_avx2_b"),
                                               {"early_stopping": False, "batch_size": 16}),
           "batch_size: 12, 500 fixed steps": (("fixed_b12_avx2_a", "fixed_b12_avx2_b"),
                                               {"early_stopping": False, "batch_size": 12})}


def seconds(steps: float, records: int, flops, block_rate: float, batch: Optional[int] = None,
            kl_rate: float = FP32, kl_positions: Optional[int] = None) -> float:
    """``kl_positions``: the positions a step's KL touches (``kl_positions_per_step``; None: all of them)."""
    positions = min(records, batch or records) * TOKENS
    kl_share = 1.0 if kl_positions is None else min(1.0, kl_positions / positions)
    per_position = flops["blocks"] / block_rate + kl_share * flops["kl"] / kl_rate
    return steps * positions * per_position


def domain_minutes(run_steps: float, chosen: float, flops, block_rate: float, early: bool, refit: bool = True,
                   batch: Optional[int] = None, kl_rate: float = FP32, kl_positions: Optional[int] = None) -> float:
    """Minutes of one domain: the stopped run on the training records less the validation ones, the
    validation checks, and (``refit``, the preset's default) the chosen steps again on all records;
    ``batch``: records per step (None: all of them); ``kl_rate``, ``kl_positions``: see ``seconds``."""
    kl = {"kl_rate": kl_rate, "kl_positions": kl_positions}
    if not early:
        return seconds(run_steps, RECORDS, flops, block_rate, batch, **kl) / 60
    checks = run_steps / EVAL_EVERY + 1  # the validation forwards: about a third of a step's FLOPs each
    total = (seconds(run_steps, RECORDS - VALIDATION, flops, block_rate, batch, **kl)
             + (seconds(chosen, RECORDS, flops, block_rate, batch, **kl) if refit else 0.0)
             + seconds(checks / 3, VALIDATION, flops, block_rate, kl_rate=kl_rate))
    return total / 60


# train_blocks: k (issue 52): the 7B shapes, the k blocks a step runs, and the KL through the head
MODELS = {"Llama-2-7B": {"hidden": 4096, "mlp": 11008, "layers": 32, "vocab": 32000, "kv_hidden": 4096},
          "Llama-3-8B": {"hidden": 4096, "mlp": 14336, "layers": 32, "vocab": 128256, "kv_hidden": 1024}}
TRAIN_BLOCKS = (0, 1, 2, 4, "all")
# every block trained on minibatches (batch_size: the demo grid's cells foldable_kall_b10 / _b8)
ALL_BLOCKS_BATCHES = (10, 8)
# the KL's settings: exact float32 (the preset today); bf16 logit matmuls (kl_precision: mixed) at the
# blocks' rate; kl_positions_per_step 4096 (of 16,384 / 20,480 positions a step: the stopped run / refit)
KL_VARIANTS = {"exact float32 KL": (FP32, None), "kl_precision: mixed": (BF16_BLOCKS, None),
               "mixed + kl_positions_per_step 4096": (BF16_BLOCKS, 4096)}


def top_blocks_minutes(model: dict, k, run_steps: float, chosen: float, kl_rate: float = FP32,
                       kl_positions: Optional[int] = None, batch: Optional[int] = None, early: bool = True) -> dict:
    """Minutes of one domain with ``train_blocks: k`` (``"all"``: every block trains, the preset today):
    the training as ``domain_minutes`` with k blocks per step (bf16 autocast), plus the one-time forward
    of the 32 - k frozen blocks that computes the first trained block's input for the 40 records;
    ``batch``: records per step (``batch_size``; None: all of them); ``early``: False for a fixed step
    count (``early_stopping: false``: ``run_steps`` on every record, no validation, no refit)."""
    layers = model["layers"] if k == "all" else k
    shape = (model["hidden"], model["mlp"], layers, model["vocab"], 1, TOKENS)
    flops = {key: value / TOKENS for key, value in
             preset_flops(*shape, kl_matmuls=5, kv_hidden=model["kv_hidden"]).items() if key != "preset_over_kl"}
    train = domain_minutes(run_steps, chosen, flops, BF16_BLOCKS, early, batch=batch, kl_rate=kl_rate,
                           kl_positions=kl_positions)
    below = 0 if k == "all" else model["layers"] - k
    frozen = preset_flops(model["hidden"], model["mlp"], below, 1, RECORDS, TOKENS, kv_hidden=model["kv_hidden"])
    once = frozen["blocks"] / 2 / BF16_BLOCKS / 60  # forward only, no backward
    return {"minutes": train + once, "training_minutes": train, "first_input_minutes": once,
            "kl_share_of_step": flops["kl"] / kl_rate / (flops["blocks"] / BF16_BLOCKS + flops["kl"] / kl_rate)}


def top_blocks_rows(step_counts: dict) -> List[dict]:
    """One row per model x k x KL setting x step counts (``step_counts``: label -> (run, chosen)), and
    for k = all (every block trained) each of ``ALL_BLOCKS_BATCHES`` records per step besides the full batch."""
    rows = []
    for model_name, model in MODELS.items():
        for k in TRAIN_BLOCKS:
            for batch in (None, *ALL_BLOCKS_BATCHES) if k == "all" else (None,):
                for kl_name, (kl_rate, kl_positions) in KL_VARIANTS.items():
                    for steps_label, (run_steps, chosen) in step_counts.items():
                        rows.append({"model": model_name, "train_blocks": k, "batch_size": batch, "kl": kl_name,
                                     "steps": steps_label, "steps_run": run_steps, "chosen": chosen,
                                     **top_blocks_minutes(model, k, run_steps, chosen, kl_rate, kl_positions, batch)})
    return rows


def variant_rows(steps: dict, flops) -> List[dict]:
    """Per variant (the tags of preset_steps.json with the same overrides, e.g. seeds run side by side
    under two tags): its minutes per domain (median, largest, how many fit the target), its mean held-out
    gap closed beside the data-free extract's measured in the same runs (the untrained start no-regret
    compares with), and its mean task scores over the seeds it scored."""
    grouped: dict = {}
    for tag, run in steps.items():
        key = json.dumps([run["overrides"], run.get("experiment", {}), run_correction(run)], sort_keys=True)
        grouped.setdefault(key, []).append((tag, run))
    variants = []
    for runs in grouped.values():
        minutes, scores, gaps, extract_gaps, seeds = [], {}, {}, {}, 0
        for _, run in runs:
            batch = run["overrides"].get("batch_size")
            seeds += len(run["seeds"])
            for result in run["seeds"].values():
                for domain, d in result["domains"].items():
                    gaps.setdefault(domain, []).append(d["gap_closed"])
                    extract_gaps.setdefault(domain, []).append(d["baseline_gap_closed"])
                    run_steps, chosen, early = steps_of(d)
                    minutes.append(domain_minutes(run_steps, chosen, flops, BF16_BLOCKS, early,
                                                  d.get("refit_records") is not None, batch))
                for domain, score in (result.get("scores") or {}).items():
                    scores.setdefault(domain, []).append(score)
        experiment = runs[0][1].get("experiment")
        variants.append({"tags": [tag for tag, _ in runs], "overrides": runs[0][1]["overrides"],
                         "correction": run_correction(runs[0][1]),
                         "experiment": experiment, "is_preset": not runs[0][1]["overrides"] and not experiment,
                         "seeds": seeds,
                         "median_minutes": statistics.median(minutes), "max_minutes": max(minutes),
                         "within_target": sum(m <= TARGET_MIN for m in minutes), "domain_runs": len(minutes),
                         "mean_scores": {k: round(statistics.mean(v), 1) for k, v in scores.items()},
                         "scores": scores, "mean_gap_closed": {k: round(statistics.mean(v), 3) for k, v in gaps.items()},
                         "mean_extract_gap_closed": {k: round(statistics.mean(v), 3) for k, v in extract_gaps.items()}})
    # two-sided Mann-Whitney U of each domain's per-seed scores against the preset's with the same
    # final-state correction (the preset's changed on 2026-12-06: a variant is read against its own era's)
    presets = {json.dumps(v["correction"], sort_keys=True): v for v in variants if v["is_preset"]}
    for variant in variants:
        shipped = presets.get(json.dumps(variant["correction"], sort_keys=True))
        if shipped is not None and variant is not shipped:
            variant["p_vs_preset"] = {domain: mann_whitney(scores, shipped["scores"].get(domain, []))
                                      for domain, scores in variant["scores"].items()}
    return variants


def steps_of(domain: dict):
    """(steps run, steps chosen, early stopping or not) of a preset_steps.json domain run: one without early
    stopping (``early_stopping: false``) records no stopped run, and trains its ``chosen_steps`` once."""
    if domain.get("steps_run") is None:
        return domain["chosen_steps"], domain["chosen_steps"], False
    return domain["steps_run"], domain["chosen_steps"], True


def run_correction(run: dict) -> dict:
    """The final-state correction a run's preset trained (``content`` and ``method`` of its first seed's
    ``preset_settings``; empty for runs that did not record them)."""
    settings = next(iter(run["seeds"].values()), {}).get("preset_settings") or {}
    return {key: settings[key] for key in ("content", "method") if key in settings}


def mann_whitney(a: List[float], b: List[float]) -> Optional[float]:
    from scipy import stats

    if len(a) < 2 or len(b) < 2 or len(set(a) | set(b)) == 1:
        return None  # too few seeds, or every score equal (the test is undefined)
    return round(float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue), 3)


def main() -> None:
    per_position = preset_flops(4096, 11008, 32, 32000, 1, TOKENS, kl_matmuls=5)
    flops = {k: v / TOKENS for k, v in per_position.items() if k != "preset_over_kl"}
    steps = json.load(open(os.path.join(RESULTS_DIR, "preset_steps.json")))["runs"]
    ratio = json.load(open(os.path.join(RESULTS_DIR, "bench_training_preset.json")))["result"]
    # (tag, seed, domain, steps run, steps chosen, early stopping or not, refit or not, batch): a run without
    # refit has no refit_records
    picked = [(tag, seed, domain, *steps_of(d), d.get("refit_records") is not None, run["overrides"].get("batch_size"))
              for tag, run in steps.items() for seed, result in run["seeds"].items()
              for domain, d in result["domains"].items()]
    rows, estimate = [], {"flops_per_position": flops, "preset_over_kl_flop_model_7b": per_position["preset_over_kl"],
                          "preset_over_kl_measured_cpu": ratio["preset_over_kl"]["median"],
                          "preset_over_kl_flop_model_cpu_shape": ratio["flop_model"]["preset_over_kl"], "rows": []}
    for label, run_steps, chosen, rate, early, refit, batch in (
            ["500 full-batch steps, float32 blocks (before)", 500, 500, FP32, False, False, None],
            ["500 full-batch steps, bf16-autocast blocks", 500, 500, BF16_BLOCKS, False, False, None],
            *[[(f"early stopping ({tag} seed {seed} {domain}: ran {run}, chose {chosen}"
                f"{'' if refit else ', no refit'}" if early else f"{chosen} fixed steps ({tag} seed {seed} {domain}")
               + f"{f', batch {batch}' if batch else ''}), bf16 blocks",
               run, chosen, BF16_BLOCKS, early, refit, batch]
              for tag, seed, domain, run, chosen, early, refit, batch in picked]):
        minutes = domain_minutes(run_steps, chosen, flops, rate, early, refit, batch)
        rows.append([label, f"{minutes:.1f}", "yes" if minutes <= TARGET_MIN else "no"])
        estimate["rows"].append({"label": label, "steps_run": run_steps, "chosen": chosen, "minutes": minutes,
                                 "refit": refit, "batch_size": batch})
    # the median: the early-stopping preset of before 2026-12-07 (refit, up to 500 steps: tags early_stop_*), not
    # the variants tried
    picked = [p for p in picked if p[5] and p[6] and p[0].startswith("early_stop")]
    if picked:
        run, chosen = statistics.median(p[3] for p in picked), statistics.median(p[4] for p in picked)
        minutes = domain_minutes(run, chosen, flops, BF16_BLOCKS, True)
        rows.append([f"early stopping, median of the demo's ({run:g} run, {chosen:g} chosen)", f"{minutes:.1f}",
                     "yes" if minutes <= TARGET_MIN else "no"])
        estimate["median"] = {"steps_run": run, "chosen": chosen, "minutes": minutes}
        # the largest chosen step count that fits the target, stopping `patience x eval_every` = 100 steps later
        fits = max((s for s in range(0, 501) if domain_minutes(s + 100, s, flops, BF16_BLOCKS, True) <= TARGET_MIN),
                   default=0)
        estimate["largest_chosen_within_target"] = fits
        rows.append([f"the most steps early stopping may choose within {TARGET_MIN} min (stopping 100 later)",
                     str(fits), ""])
    print_table(f"preset: best per domain on one H200, Llama-2-7B, 40 x 512 training positions (ESTIMATE; "
                f"{per_position['preset_over_kl']:.1f}x a loss: kl step by FLOPs, measured on this CPU at 7B "
                f"proportions: {ratio['preset_over_kl']['median']:.1f}x vs {ratio['flop_model']['preset_over_kl']:.1f}x "
                "by FLOPs)", ["training", "minutes per domain", f"<= {TARGET_MIN} min"], rows)
    estimate["variants"] = variant_rows(steps, flops)
    print_table("each variant of preset_steps.json: minutes per 7B domain (ESTIMATE) and demo task scores",
                ["overrides", "seeds", "median min", "max min", f"runs <= {TARGET_MIN} min",
                 "held-out gap closed", "the extract's, same runs", "math / code / instruct", "p vs the preset"],
                [[("(the preset)" if v["is_preset"] else json.dumps({**v["overrides"], **(v["experiment"] or {})}))
                  + (f" [{v['correction'].get('content')}]" if v["correction"] else ""),
                  v["seeds"], f"{v['median_minutes']:.1f}",
                  f"{v['max_minutes']:.1f}", f"{v['within_target']} of {v['domain_runs']}",
                  " / ".join(f"{g:.3f}" for g in v["mean_gap_closed"].values()),
                  " / ".join(f"{g:.3f}" for g in v["mean_extract_gap_closed"].values()),
                  " / ".join(f"{s:g}" for s in v["mean_scores"].values()),
                  " / ".join("-" if p is None else f"{p:.2f}" for p in (v.get("p_vs_preset") or {}).values())]
                 for v in estimate["variants"]])
    step_counts = {"the demo's median": (estimate["median"]["steps_run"], estimate["median"]["chosen"])} \
        if "median" in estimate else {"500 + 500": (500, 500)}
    step_counts.update(real_family_steps())
    estimate["train_blocks"] = top_blocks_rows(step_counts)
    print_table("train_blocks: k, minutes per domain on one H200 (ESTIMATE; bf16 blocks, the one-time pass of the "
                "frozen blocks included; KL share: of a step)",
                ["model", "k", "batch", "KL", "steps (run, chosen)", "minutes", "KL share", f"<= {TARGET_MIN} min"],
                [[r["model"], r["train_blocks"], r["batch_size"] or "all", r["kl"], f"{r['steps']} ({r['steps_run']:g}, {r['chosen']:g})",
                  f"{r['minutes']:.1f}", f"{r['kl_share_of_step']:.0%}", "yes" if r["minutes"] <= TARGET_MIN else "no"]
                 for r in estimate["train_blocks"]])
    estimate["recipes"] = {name: rows for name in RECIPES if (rows := recipe_rows(steps, name))}
    for name, recipe in estimate["recipes"].items():
        print_table(f"preset: best, every block, {name}: minutes per domain on one H200 (ESTIMATE; the median step "
                    "counts of its demo runs)",
                    ["model", "KL", "steps (run, chosen)", "minutes", f"<= {TARGET_MIN} min"],
                    [[r["model"], r["kl"], f"{r['steps_run']:g}, {r['chosen']:g}", f"{r['minutes']:.1f}",
                      "yes" if r["minutes"] <= TARGET_MIN else "no"] for r in recipe])
    write_json("preset_cost_7b", {"machine": machine_info(), "estimate": estimate}, overwrite=True)


def recipe_rows(steps: dict, name: str) -> List[dict]:
    """Recipe ``name`` of ``RECIPES`` on both 7B shapes and each KL setting: every block trained, at its
    batch, the median steps run and chosen over the domain runs of its tags (none: no rows); a tag whose
    runs trained something else than the recipe is refused."""
    tags, overrides = RECIPES[name]
    runs = {tag: steps[tag] for tag in tags if tag in steps}
    other = [tag for tag, run in runs.items() if run["overrides"] != overrides]
    if other:
        raise SystemExit(f"preset_cost_7b: RECIPES[{name!r}]: tags {other} of preset_steps.json did not train with "
                         f"{overrides} alone (their overrides: {[runs[t]['overrides'] for t in other]})")
    picked = [steps_of(d) for run in runs.values() for result in run["seeds"].values()
              for d in result["domains"].values()]
    if not picked:
        return []
    run, chosen = statistics.median(p[0] for p in picked), statistics.median(p[1] for p in picked)
    early, batch = overrides.get("early_stopping", True), overrides.get("batch_size")
    return [{"recipe": name, "model": model_name, "kl": kl_name, "batch_size": batch, "early_stopping": early,
             "steps_run": run, "chosen": chosen, "domain_runs": len(picked),
             **top_blocks_minutes(model, "all", run, chosen, kl_rate, kl_positions, batch, early)}
            for model_name, model in MODELS.items() for kl_name, (kl_rate, kl_positions) in KL_VARIANTS.items()]


def real_family_steps() -> dict:
    """The step counts early stopping chose in the real family's preset rows (results/real_table_v2.json),
    as label -> (median run, median chosen) over their domains; none before those rows exist."""
    path = os.path.join(RESULTS_DIR, "real_table_v2.json")
    if not os.path.exists(path):
        return {}
    table, counts = json.load(open(path)), {}
    for row, report in sorted(table.get("reports", {}).items()):
        if "/preset" not in row:
            continue
        picked = [steps for entry in report.values() if isinstance(entry, dict) and (steps := chosen_steps(entry))]
        if picked:
            counts[f"real family {row.split('/')[1]}"] = (statistics.median(run for run, _ in picked),
                                                          statistics.median(chosen for _, chosen in picked))
    return counts


def chosen_steps(entry: Optional[dict]):
    """(steps run, steps chosen) of a real_table row's domain entry (its report's ``selection``), or None."""
    selection = (entry or {}).get("selection") or {}
    runs = [c for c in selection.get("candidates", []) if c.get("lr") == selection.get("lr")]
    return (runs[0]["steps_run"], selection["steps"]) if runs and "steps" in selection else None


if __name__ == "__main__":
    main()
