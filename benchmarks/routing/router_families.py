"""Routing of short prompts on three tiny families (docs/routing.md "Measurements", issue 30).

For each family (the demo's math / code / instruct, and the generated ``docs`` and ``chat``
families of benchmarks/routing/router_corpora.py, whose domains share vocabulary and surface forms) it

1. trains the tiny Llama family with the demo's recipe (``demo.family.build_family``, quick sizes:
   a base pretrained on the mixture, one fully fine-tuned expert per domain) and merges the experts
   with mergekit (task arithmetic, 0.5 each);
2. captures the merged model's final states of 50 calibration records and 100 test records per
   domain (the test records are never seen by any router);
3. trains routers on the calibration records exactly as the pipeline does (the surgery's 20 %
   held-out split, seed 0): the router before issue 30 (nearest centroid on whole records, fixed
   threshold 0.02) and the current one (random prefixes, classifier chosen in cross-validation,
   conformal gate at 5 % in-domain fallback), plus the current one with each classifier forced;
4. routes every test record cut to its first 16 / 32 / 64 tokens (BOS included) and whole, and
   reports per domain the share routed to its own domain and to ``none``, with the confusion
   matrices, and the swapped-domain fallback (a router fitted without a domain routes that domain).

Usage: python benchmarks/routing/router_families.py --workdir /tmp/router_families [--families demo,docs,chat]
Writes benchmarks/results/router_families.json (``--out``/``--overwrite`` as every benchmark).
"""

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, write_json  # noqa: E402

FIELD = {"demo": "prompt", "docs": "text", "chat": "prompt"}  # what a calibration / test record is


def family_splits(family: str, seed: int):
    if family == "demo":
        from mergekit_darts.demo import tasks

        splits = {d: tasks.make_splits(d, seed, train=1500, calib=50, test=100) for d in tasks.DOMAINS}
        return splits, tasks.vocabulary(splits.values())
    import router_corpora

    splits = router_corpora.make_splits(family, seed, train=1500, calib=50, test=100)
    return splits, router_corpora.vocabulary(splits)


def build_merged(root: str, family: str, seed: int):
    from mergekit_darts.demo.family import FamilySpec, build_family

    splits, words = family_splits(family, seed)
    paths = build_family(os.path.join(root, "family"), splits, words, seed=seed, spec=FamilySpec.quick(),
                         progress=False, log=log)
    merged = os.path.join(root, "merged")
    if not os.path.exists(os.path.join(merged, "config.json")):
        lines = ["merge_method: task_arithmetic", f"base_model: {paths['base']}", "models:"]
        lines += [f"  - model: {paths[d]}\n    parameters: {{weight: 0.5}}" for d in splits]
        config = os.path.join(root, "merge.yml")
        with open(config, "w") as handle:
            handle.write("\n".join(lines + ["dtype: float32"]) + "\n")
        subprocess.run(["mergekit-yaml", config, merged], check=True, capture_output=True)
    return splits, paths, merged


def capture(root, splits, paths, merged, field):
    """{domain: (calibration PromptStates, test PromptStates)} of the merged model, and the surgery."""
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.pipeline import capture_context
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts
    from mergekit_darts.repair.route.prefix import PromptStates
    from mergekit_darts.settings import RunSettings

    surgery = parse_surgery_block({
        "max_positions": 128, "device": "cpu", "dtype": "float32", "seed": 0, "capture_batch_size": 25,
        "cache_dir": os.path.join(root, "capture_cache"),
        "domains": {d: {"model": paths[d], "calibration": {"texts": [e[field] for e in splits[d]["calib"]]}}
                    for d in splits}})
    settings = RunSettings.resolve(surgery, progress=False)
    ctx = capture_context(merged, surgery, settings)
    out = {}
    for domain, parts in splits.items():
        states = []
        for part in ("calib", "test"):
            data = capture_merged_prompts(ctx, DomainCaptureSpec(name=f"{part}_{domain}", expert=merged,
                                                                 texts=[e[field] for e in parts[part]]))
            states.append(PromptStates(data.merged_hidden, data.prompt_lengths))
        out[domain] = tuple(states)
    return out, surgery, settings


def old_router(calib, splits):
    """The router before issue 30: nearest centroid on whole training records, threshold 0.02."""
    from mergekit_darts.repair.route.router import fit_router
    from mergekit_darts.repair.route.prefix import pooled_at

    train = {d: pooled_at(states.subset(splits[d][0]), (None,))["all"] for d, states in calib.items()}
    return fit_router(train, kind="centroid", threshold=0.02)


def measure(router, test) -> dict:
    from mergekit_darts.repair.route.prefix import pooled_at
    from mergekit_darts.repair.route.train import by_prefix

    return by_prefix(router, {d: pooled_at(states) for d, states in test.items()})


def swapped(router_fn, calib, splits) -> dict:
    """{domain: {label: share to none}}: the router (same recipe) fitted without that domain."""
    from mergekit_darts.repair.route.prefix import pooled_at

    shares = {}
    for name in calib:
        others = {d: s for d, s in calib.items() if d != name}
        router = router_fn(others, {d: splits[d] for d in others})
        shares[name] = {label: float((router.route(rows) == -1).float().mean())
                        for label, rows in pooled_at(calib[name]).items()}
    return shares


def run_family(root, family, seed):
    from mergekit_darts.repair.route.train import train_router
    from mergekit_darts.repair.train.split import split_held_out

    started = time.perf_counter()
    splits, paths, merged = build_merged(root, family, seed)
    states, surgery, settings = capture(root, splits, paths, merged, FIELD[family])
    calib = {d: s[0] for d, s in states.items()}
    test = {d: s[1] for d, s in states.items()}
    held = {d: split_held_out(s.records, surgery.held_out, settings.seed) for d, s in calib.items()}
    recipes = {
        "before (centroid, whole records, 0.02)": lambda c, sp: old_router(c, sp),
        "auto (prefixes, CV choice, conformal 5%)": lambda c, sp: train_router(c, sp, seed=settings.seed)[0],
        "centroid (prefixes, conformal 5%)": lambda c, sp: train_router(c, sp, kind="centroid", seed=settings.seed)[0],
        "logistic (prefixes, conformal 5%)": lambda c, sp: train_router(c, sp, kind="logistic", seed=settings.seed)[0],
    }
    result = {"domains": list(splits), "field": FIELD[family],
              "test_tokens": {d: {"mean": float(s.lengths.float().mean()), "min": int(s.lengths.min()),
                                  "max": int(s.lengths.max())} for d, s in test.items()},
              "routers": {}}
    _, entry = train_router(calib, held, seed=settings.seed)
    result["pipeline_entry"] = entry
    for name, make in recipes.items():
        router = make(calib, held)
        result["routers"][name] = {"kind": router.kind, "threshold": router.threshold,
                                   "test": measure(router, test),
                                   "swapped_none_share": swapped(make, calib, held)}
        _print(family, name, result["routers"][name])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _print(family, name, row):
    cells = []
    for label, summary in row["test"].items():
        acc = "/".join(f"{100 * v:.0f}" for v in summary["accuracy"].values())
        none = "/".join(f"{100 * v:.0f}" for v in summary["none_share"].values())
        cells.append(f"{label}: own {acc} none {none}")
    log(f"{family:5} {name} [{row['kind']}, t={row['threshold']:.4f}]: " + "; ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--families", default="demo,docs,chat")
    parser.add_argument("--seed", type=int, default=0)
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    results = {"machine": machine_info(), "command": "python benchmarks/routing/router_families.py " + " ".join(argv or sys.argv[1:]),
               "seed": args.seed, "families": {}}
    for family in args.families.split(","):
        results["families"][family] = run_family(os.path.join(args.workdir, family), family, args.seed)
    write_json("router_families", results, args.out, args.overwrite)


if __name__ == "__main__":
    main()
