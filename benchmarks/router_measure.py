"""Measure the domain router on the demo family: classifier choice and threshold trade-off (docs/routing.md).

Needs a built demo workdir (``mergekit-darts demo --quick --workdir DIR``; the merged model and the
capture cache are reused, so this loads the merged model only for the test prompts). For each
router kind (nearest centroid, logistic regression) and each threshold it reports:

* in-domain routing accuracy ("none" counts as wrong) on each domain's held-out calibration records
  (the surgery's own split) and on the demo's test prompts (never seen by the router);
* the out-of-domain fallback rate: for each domain, a router trained without it routes all of that
  domain's prompts (calibration + test); the share sent to "none".

Usage: python benchmarks/router_measure.py --workdir /tmp/router_demo
Prints a table and writes benchmarks/results/router_measure.json.
"""

import argparse
import json
import os

import torch

THRESHOLDS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "router_measure.json"))
    args = parser.parse_args()

    from mergekit_darts.pipeline import capture_context, capture_step, parse_config_source
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts
    from mergekit_darts.repair.train.split import split_held_out
    from mergekit_darts.repair.router import accuracy, confusion, fit_router, none_share, pooled_prompts
    from mergekit_darts.settings import RunSettings

    merged = os.path.join(args.workdir, "merged")
    _, surgery = parse_config_source(open(os.path.join(args.workdir, "demo.yml")).read())
    settings = RunSettings.resolve(surgery, progress=False)
    ctx = capture_context(merged, surgery, settings)
    captured = capture_step(merged, surgery, settings, ctx=ctx)
    pooled = {name: pooled_prompts(data) for name, data in captured.domains.items()}
    splits = {name: split_held_out(rows.shape[0], surgery.held_out, settings.seed) for name, rows in pooled.items()}
    train = {name: rows[splits[name][0]] for name, rows in pooled.items()}
    held = {name: rows[splits[name][1]] for name, rows in pooled.items()}
    test = {}
    for name in pooled:
        with open(os.path.join(args.workdir, "data", f"{name}_test.jsonl")) as handle:
            texts = [json.loads(line)["prompt"] for line in handle if line.strip()]
        spec = DomainCaptureSpec(name=f"test_{name}", expert=merged, texts=texts)
        test[name] = pooled_prompts(capture_merged_prompts(ctx, spec))
    every = {name: torch.cat([pooled[name], test[name]]) for name in pooled}

    results = {"workdir": os.path.abspath(args.workdir), "records": {
        name: {"train": int(train[name].shape[0]), "held_out": int(held[name].shape[0]),
               "test": int(test[name].shape[0])} for name in pooled}, "kinds": {}}
    print("records per domain (train / held-out calibration / test): "
          + ", ".join(f"{n} {v['train']}/{v['held_out']}/{v['test']}" for n, v in results["records"].items()))
    print(f"{'kind':9} {'thresh':>6}  {'held-out acc':>12}  {'test acc':>8}  {'OOD->none':>9}  per-domain test acc / OOD->none")
    for kind in ("centroid", "logistic"):
        rows = []
        for threshold in THRESHOLDS:
            router = fit_router(train, kind=kind, threshold=threshold)
            held_table, test_table = confusion(router, held), confusion(router, test)
            ood = {}
            for name in pooled:
                others = {o: r for o, r in train.items() if o != name}
                ood[name] = none_share(fit_router(others, kind=kind, threshold=threshold), every[name])
            row = {
                "threshold": threshold,
                "held_out_accuracy": accuracy(held_table), "test_accuracy": accuracy(test_table),
                "held_out_confusion": held_table, "test_confusion": test_table,
                "held_out_mean": _mean(held_table), "test_mean": _mean(test_table),
                "ood_none_share": ood, "ood_mean": sum(ood.values()) / len(ood),
            }
            rows.append(row)
            per = ", ".join(f"{n} {100 * row['test_accuracy'][n]:.0f}/{100 * ood[n]:.0f}" for n in pooled)
            print(f"{kind:9} {threshold:6.3f}  {100 * row['held_out_mean']:11.1f}%  {100 * row['test_mean']:7.1f}%  "
                  f"{100 * row['ood_mean']:8.1f}%  {per}")
        results["kinds"][kind] = rows
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    print(f"wrote {args.out}")


def _mean(table):
    total = sum(sum(row.values()) for row in table.values())
    return sum(row[name] for name, row in table.items()) / total


if __name__ == "__main__":
    main()
