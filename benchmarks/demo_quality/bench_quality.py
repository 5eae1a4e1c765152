"""Quality ablation on an existing demo run: held-out KL gap closed (and optionally task scores) per
surgery variant, training on the demo's cached tensors (docs/quality.md).

    python benchmarks/demo_quality/bench_quality.py DEMO_DIR --variants '{"kl": {"loss": "kl"}, ...}' [--score NAME ...]

DEMO_DIR is a ``mergekit-darts demo`` work directory (demo.yml, merged/, capture_cache/, data/);
``--prepare`` makes one without the demo's ablations and scoring: data, family (reused when
DEMO_DIR/family matches), the demo's YAML, merge + default surgery. ``--references`` also scores the
base, the experts and the plain merge, so each variant's scores can be read against the experts'. Each variant is a dict of ``surgery:`` overrides applied to demo.yml. The capture is done
once per distinct calibration setting (cached on disk); each variant then trains every domain and
reports the held-out gap closed, the chosen lr/steps and the training seconds per domain. Variants
named with --score are also exported to DEMO_DIR/merged and scored on the demo's test sets.
Results are appended to benchmarks/results/quality_ablation.json under --tag.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, machine_info  # noqa: E402


def _calibration_overrides(config_source: str, overrides: dict):
    """Split per-domain calibration overrides (``calibration: {...}``) from surgery overrides."""
    import yaml

    overrides = dict(overrides)
    calibration = overrides.pop("calibration", None)
    if calibration:
        data = yaml.safe_load(config_source)
        domains = data["surgery"]["domains"]
        for name in domains:
            domains[name]["calibration"] = {**domains[name]["calibration"], **calibration}
        config_source = yaml.safe_dump(data, sort_keys=False)
    return config_source, overrides


def run_variant(demo_dir: str, name: str, overrides: dict, score: bool, test=None) -> dict:
    import torch

    from mergekit_darts.pipeline import capture_step, parse_config_source
    from mergekit_darts.repair.train.domain import train_domain
    from mergekit_darts.settings import RunSettings

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        config_source = handle.read()
    calibration = overrides.get("calibration")
    config_source, overrides = _calibration_overrides(config_source, overrides)
    _, surgery = parse_config_source(config_source, overrides)
    settings = RunSettings.resolve(surgery, None, progress=False)
    out = os.path.join(demo_dir, "merged")
    captured = capture_step(out, surgery, settings)
    result = {"overrides": overrides, "calibration_overrides": calibration, "surgery": surgery.model_dump(exclude={"domains", "cache_dir"}),
              "domains": {}}
    modules, report = {}, {"surgery": {**surgery.model_dump(exclude={"domains"}), "seed": settings.seed},
                           "domains": {}}
    for domain, data in captured.domains.items():
        torch.manual_seed(settings.seed)
        start = time.perf_counter()
        trained = train_domain(domain, data, captured.merged_head, surgery, settings, tail=captured.tail,
                               merged_dir=out)
        seconds = time.perf_counter() - start
        modules[domain] = trained.module
        report["domains"][domain] = trained.entry
        entry = trained.entry
        result["domains"][domain] = {
            "gap_closed": entry["held_out_kl"]["gap_closed"], "kl_before": entry["held_out_kl"]["before"],
            "kl_after": entry["held_out_kl"]["after"], "parameters": entry["parameters"],
            "train_seconds": round(seconds, 2), "selection": entry.get("selection"),
            "records": entry["calibration"],
        }
        print(f"{name:28s} {domain:9s} gap_closed {entry['held_out_kl']['gap_closed']:.3f} "
              f"({seconds:.1f} s) {entry.get('selection') or ''}", flush=True)
    if score:
        result["scores"], _ = export_and_score(out, captured, surgery, settings, modules, report, test)
        print(f"{name:28s} scores {result['scores']}", flush=True)
    return result


def export_and_score(out: str, captured, surgery, settings, modules: dict, report: dict, test) -> tuple:
    """Export the trained ``modules`` into ``out`` (with the router where the surgery routes, as
    repair_directory does, so the directory is complete) and score it on the demo's ``test`` sets:
    (scores per domain, seconds the scoring took)."""
    from transformers import AutoTokenizer

    from mergekit_darts.demo import tasks
    from mergekit_darts.demo.run import score_surgery
    from mergekit_darts.pipeline import export_step, router_step

    router = None
    if surgery.router_enabled:
        router, report["router"] = router_step(out, captured, surgery, settings)
    export_step(out, surgery, modules, report, router)
    start = time.perf_counter()
    scores = score_surgery(out, AutoTokenizer.from_pretrained(out), test, list(tasks.DOMAINS))
    return scores, round(time.perf_counter() - start, 1)


def prepare(demo_dir: str, seed: int) -> dict:
    """The demo's first stages (run.py ``_run_demo`` up to merge + surgery); returns their seconds."""
    from mergekit.options import MergeOptions

    from mergekit_darts.demo.family import build_family
    from mergekit_darts.demo.run import DemoSizes, make_data, merge_yaml
    from mergekit_darts.demo import tasks
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    sizes, start = DemoSizes(), time.perf_counter()
    splits = make_data(demo_dir, seed, sizes)
    paths = build_family(os.path.join(demo_dir, "family"), splits, tasks.vocabulary(splits.values()), seed=seed,
                         spec=sizes.family, progress=False, log=print)
    family = time.perf_counter() - start
    config = merge_yaml(demo_dir, paths, seed, sizes)
    with open(os.path.join(demo_dir, "demo.yml"), "w") as handle:
        handle.write(config)
    merge_and_repair(config, os.path.join(demo_dir, "merged"), original_run_merge(),
                     options=MergeOptions(quiet=True, random_seed=seed))
    return {"family_s": round(family, 1), "merge_and_surgery_s": round(time.perf_counter() - start - family, 1)}


def score_references(demo_dir: str, test: dict) -> dict:
    """Accuracy of the base, each expert and the plain merge (the demo's reference rows)."""
    import yaml

    from mergekit_darts.demo.evaluate import score_model
    from mergekit_darts.demo.run import _load
    from transformers import AutoTokenizer

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        config = yaml.safe_load(handle)
    out = os.path.join(demo_dir, "merged")
    tokenizer = AutoTokenizer.from_pretrained(out)
    models = {"base": config["base_model"],
              **{f"expert_{d}": c["model"] for d, c in config["surgery"]["domains"].items()}}
    scores = {key: score_model(_load(path), tokenizer, test) for key, path in models.items()}
    scores["merged"] = score_model(_load(out, trust_remote_code=True, darts_domain="none"), tokenizer, test)
    print(f"references {scores}", flush=True)
    return scores


def sample_diversity(demo_dir: str, overrides: dict) -> dict:
    """Per domain: how many sampled rows differ from their prompt's greedy row, and the mean number
    of distinct continuations per prompt (greedy included). Reads the cached capture."""
    from mergekit_darts.pipeline import capture_step, parse_config_source
    from mergekit_darts.settings import RunSettings

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        config_source, overrides = _calibration_overrides(handle.read(), overrides)
    _, surgery = parse_config_source(config_source, overrides)
    captured = capture_step(os.path.join(demo_dir, "merged"), surgery, RunSettings.resolve(surgery, None, False))
    result = {}
    for name, data in captured.domains.items():
        rows = [tuple(ids[mask].tolist()) for ids, mask in zip(data.input_ids, data.attention_mask)]
        prompts = int(data.groups.max()) + 1
        distinct = [len({rows[j] for j in range(p, len(rows), prompts)} | {rows[p]}) for p in range(prompts)]
        result[name] = {"sampled_rows": len(rows) - prompts,
                        "differ_from_greedy": sum(rows[j] != rows[j % prompts] for j in range(prompts, len(rows))),
                        "distinct_per_prompt": sum(distinct) / prompts}
    print(f"sample diversity {result}", flush=True)
    return result


def load_test(demo_dir: str) -> dict:
    from mergekit_darts.demo import tasks

    test = {}
    for domain in tasks.DOMAINS:
        with open(os.path.join(demo_dir, "data", f"{domain}_test.jsonl")) as handle:
            test[domain] = [json.loads(line) for line in handle]
    return test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    parser.add_argument("--variants", required=True, help="JSON {name: {surgery overrides}}")
    parser.add_argument("--score", nargs="*", default=[], help="variant names to score on the test sets")
    parser.add_argument("--tag", default="ablation")
    parser.add_argument("--prepare", action="store_true", help="make DEMO_DIR first (no ablations, no scoring)")
    parser.add_argument("--references", action="store_true", help="score base, experts and plain merge")
    parser.add_argument("--seed", type=int, default=0, help="the demo seed for --prepare")
    parser.add_argument("--diversity", nargs="*", default=[],
                        help="variant names (with continue_samples) whose sampled rows are compared to greedy")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the demo's setting: tiny matmuls gain nothing from threads
    variants = json.loads(args.variants)
    record = {"command": " ".join(sys.argv)}
    if args.prepare:
        os.makedirs(args.demo_dir, exist_ok=True)
        record["prepare"] = prepare(args.demo_dir, args.seed)
    test = load_test(args.demo_dir) if args.score or args.references else None
    if args.references:
        record["references"] = score_references(args.demo_dir, test)
    results = {}
    path = os.path.join(RESULTS_DIR, "quality_ablation.json")
    for name, overrides in variants.items():
        results[name] = run_variant(args.demo_dir, name, overrides, name in args.score, test)
        if name in args.diversity:
            results[name]["sample_diversity"] = sample_diversity(args.demo_dir, overrides)
        stored = {}
        if os.path.exists(path):  # written after every variant: a long run keeps what it measured
            with open(path) as handle:
                stored = json.load(handle)
        stored.setdefault("runs", {})[args.tag] = {**record, "machine": machine_info(), "variants": results}
        with open(path, "w") as handle:
            json.dump(stored, handle, indent=1)
    print(f"wrote {path} [{args.tag}]")


if __name__ == "__main__":
    main()
