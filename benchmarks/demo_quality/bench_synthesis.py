"""Calibration data and depth on the demo family: 50 real prompts, 500 real prompts, and 50 real +
prompts written by the experts (``calibration.synthesize``), each with several surgery variants and
seeds; held-out KL gap closed, the behaviour figures and task scores (docs/quality.md).

    python benchmarks/demo_quality/bench_synthesis.py DEMO_DIR [--prepare] --seeds 0 1 2 3 4 5 \
        --conditions real50 real500 synth500 --variants kl best best_all8 [--score] --tag NAME

DEMO_DIR is a demo work directory as ``bench_quality.py --prepare`` makes it. ``real500`` calibrates
each domain on the demo's 50 prompts plus 450 distinct prompts of its training split (never a test
prompt; written to DEMO_DIR/calib500_<domain>.jsonl); ``synth500`` on the demo's 50 plus 450 that the
domain's expert writes. One process runs the whole grid in the order seed, condition, variant, and
writes benchmarks/results/quality_synthesis.json[--tag] after every run, so a long sweep keeps what it
measured. Captures are cached in DEMO_DIR/capture_cache and reused.
"""

import argparse
import difflib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, machine_info  # noqa: E402

SYNTHESIZED = 450
CONDITIONS = {
    "real50": {},
    "real500": {"path": "{demo}/calib500_{domain}.jsonl", "samples": 500},
    # the prompts written by the merge's base model and answered by the expert: the demo's experts,
    # fine-tuned on answers only, no longer write prompts (docs/quality.md); "synth500x": by the experts
    "synth500": {"synthesize": SYNTHESIZED, "synthesize_writer": "{base}"},
    "synth500x": {"synthesize": SYNTHESIZED},
    # how well each writer writes: 50 prompts from the 40 training prompts (the acceptance table)
    "synth50": {"synthesize": 50, "synthesize_writer": "{base}"},
    "synth50x": {"synthesize": 50},
}
VARIANTS = {
    "kl": {"loss": "kl"},
    "best": {"loss": "kl", "rank": 64},  # today's preset: best
    # the same in minibatches of 50 rows (with the 40 training rows of 50 prompts: the same as above)
    "kl_b50": {"loss": "kl", "batch_size": 50},
    "best_b50": {"loss": "kl", "rank": 64, "batch_size": 50},
    # adapters on every linear of all 4 blocks, minibatches of 50 (the demo's layer count is 4)
    "kl_all8": {"loss": "kl", "depth": 4, "depth_rank": 8, "batch_size": 50},
    "best_all8": {"loss": "kl", "rank": 64, "depth": 4, "depth_rank": 8, "batch_size": 50},
    "best_all1": {"loss": "kl", "rank": 64, "depth": 4, "depth_rank": 1, "batch_size": 50},
    "best_d1": {"loss": "kl", "rank": 64, "depth": 1, "batch_size": 50},
    # adapter_init: delta (docs/quality.md "Starting from the weight deltas"): the data-free extract of
    # every block linear at rank r (steps 0: no training), and the same adapters trained from it
    **{f"extract_all{r}": {"loss": "kl", "depth": 4, "depth_rank": r, "adapter_init": "delta", "steps": 0}
       for r in (1, 2, 4, 8, 16)},
    **{f"best_delta{r}": {"loss": "kl", "rank": 64, "depth": 4, "depth_rank": r, "adapter_init": "delta",
                          "batch_size": 50} for r in (1, 2, 4, 8, 16)},
    # with the head's delta at the same rank too (docs/quality.md "What each part ... adds")
    "extract_all8_head8": {"loss": "kl", "depth": 4, "depth_rank": 8, "head_rank": 8, "adapter_init": "delta",
                           "steps": 0},
    "best_delta8_head8": {"loss": "kl", "rank": 64, "depth": 4, "depth_rank": 8, "head_rank": 8,
                          "adapter_init": "delta", "batch_size": 50},
}


def write_calib500(demo_dir: str) -> None:
    """The demo's 50 calibration prompts + the first 450 distinct training-split prompts that are
    neither calibration nor test prompts, per domain."""
    from mergekit_darts.demo import tasks

    for domain in tasks.DOMAINS:
        path = os.path.join(demo_dir, f"calib500_{domain}.jsonl")
        if os.path.exists(path):
            continue
        rows = [json.loads(line) for line in open(os.path.join(demo_dir, f"calib_{domain}.jsonl"))]
        test = {json.loads(line)["prompt"] for line in open(os.path.join(demo_dir, "data", f"{domain}_test.jsonl"))}
        seen = {row["prompt"] for row in rows} | test
        for line in open(os.path.join(demo_dir, "data", f"{domain}_train.jsonl")):
            row = json.loads(line)
            if row["prompt"] not in seen and len(rows) < 500:
                seen.add(row["prompt"])
                rows.append(row)
        with open(path, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


def configure(demo_dir: str, condition: str, variant: str, seed: int):
    """The demo's YAML with a condition's calibration and a variant's surgery keys."""
    import yaml

    from mergekit_darts.pipeline import parse_config_source

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        data = yaml.safe_load(handle)
    for domain, entry in data["surgery"]["domains"].items():
        extra = {k: v.format(demo=demo_dir, domain=domain, base=data["base_model"]) if isinstance(v, str) else v
                 for k, v in CONDITIONS[condition].items()}
        entry["calibration"] = {**entry["calibration"], **extra}
    _, surgery = parse_config_source(yaml.safe_dump(data, sort_keys=False), {**VARIANTS[variant], "seed": seed})
    return surgery


def test_overlap(captured, tokenizer, test: dict) -> dict:
    """Per domain: how many synthesized prompts are a test prompt, or one's near duplicate (the same
    rule as the synthesis uses for held-out prompts)."""
    from mergekit_darts.repair.capture.synthesize import is_near_duplicate
    from mergekit_darts.repair.train.split import prompt_count

    result = {}
    for domain, data in captured.domains.items():
        if data.real_prompts is None:
            continue
        prompts = [row[:n].tolist() for row, n in zip(data.input_ids, data.prompt_lengths.tolist())]
        synthesized = prompts[data.real_prompts:prompt_count(data)]
        texts = [tokenizer.decode(row, skip_special_tokens=True).strip() for row in synthesized]
        test_prompts = [ex["prompt"] for ex in test[domain]]
        test_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in test_prompts]
        exact = sum(t in set(test_prompts) for t in texts)
        near = sum(any(is_near_duplicate(tokenizer(t, add_special_tokens=False)["input_ids"], ids) for ids in test_ids)
                   for t in texts)
        closest = [max(difflib.SequenceMatcher(None, t.split(), p.split()).ratio() for p in test_prompts)
                   for t in texts[:50]]
        result[domain] = {"synthesized": len(texts), "equal_to_a_test_prompt": exact,
                          "near_duplicate_of_a_test_prompt": near,
                          "mean_closest_test_similarity_first50": sum(closest) / max(1, len(closest)),
                          "examples": texts[:5], "synthesis": data.synthesis}
    return result


def run_one(demo_dir: str, condition: str, variant: str, seed: int, score: bool, test: dict) -> dict:
    import torch

    from mergekit_darts.demo import tasks
    from mergekit_darts.pipeline import capture_step
    from mergekit_darts.repair.budget import share_of_7b
    from mergekit_darts.repair.train.domain import train_domain
    from mergekit_darts.settings import RunSettings

    surgery = configure(demo_dir, condition, variant, seed)
    settings = RunSettings.resolve(surgery, None, progress=False)
    out = os.path.join(demo_dir, "merged")
    start = time.perf_counter()
    captured = capture_step(out, surgery, settings)
    capture_s = time.perf_counter() - start
    report = {"surgery": {**surgery.model_dump(exclude={"domains"}), "seed": seed}, "domains": {}}
    if captured.tail is not None:
        report["surgery"]["layers"] = captured.tail.first + len(captured.tail.layers)
    modules, result = {}, {"capture_s": round(capture_s, 1), "domains": {}}
    for domain, data in captured.domains.items():
        torch.manual_seed(seed)
        trained = train_domain(domain, data, captured.merged_head, surgery, settings, tail=captured.tail,
                               merged_dir=out)
        modules[domain], entry = trained.module, trained.entry
        report["domains"][domain] = entry
        result["domains"][domain] = {
            "gap_closed": entry["held_out_kl"]["gap_closed"], "kl_before": entry["held_out_kl"]["before"],
            "kl_after": entry["held_out_kl"]["after"], "behaviour": entry["behaviour"],
            "train_seconds": entry["train_seconds"], "parameters": entry["parameters"],
            "records": entry["calibration"]}
        b = entry["behaviour"]
        print(f"s{seed} {condition:8s} {variant:10s} {domain:8s} gap {entry['held_out_kl']['gap_closed']:.3f} "
              f"exact {b['before']['exact_match']:.2f}->{b['after']['exact_match']:.2f} "
              f"top1 {b['after']['top1_agreement']:.3f} ({entry['train_seconds']:.0f} s)", flush=True)
    result["share_7b"] = share_of_7b(report["surgery"])
    if condition.startswith("synth"):
        result["test_overlap"] = test_overlap(captured, __import__("transformers").AutoTokenizer.from_pretrained(out), test)
    if score:
        from bench_quality import export_and_score

        result["scores"], result["score_s"] = export_and_score(out, captured, surgery, settings, modules, report, test)
        print(f"s{seed} {condition:8s} {variant:10s} scores {result['scores']} ({result['score_s']} s)", flush=True)
    return result


def save(path: str, tag: str, run: dict) -> None:
    """Write ``run`` under ``tag``, keeping what other runs (tags, other processes) wrote meanwhile."""
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = json.load(open(path)) if os.path.exists(path) else {}
        stored.setdefault("runs", {})[tag] = run
        tmp = path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(stored, handle, indent=1)
        os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    parser.add_argument("--prepare", action="store_true", help="make DEMO_DIR first (bench_quality.py --prepare)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    parser.add_argument("--variants", nargs="+", default=["kl", "best", "best_all8"], choices=list(VARIANTS))
    parser.add_argument("--plan", nargs="*", default=None,
                        help="CONDITION:VARIANT,VARIANT,... entries (instead of --conditions x --variants)")
    parser.add_argument("--score", action="store_true", help="export every run and score it on the test sets")
    parser.add_argument("--references", action="store_true", help="also score the experts and the plain merge")
    parser.add_argument("--tag", default="synthesis")
    args = parser.parse_args()
    import torch

    from bench_quality import load_test, prepare, score_references

    torch.set_num_threads(1)  # the demo's setting
    demo_dir = os.path.abspath(args.demo_dir)
    path = os.path.join(RESULTS_DIR, "quality_synthesis.json")
    run = (json.load(open(path)) if os.path.exists(path) else {}).get("runs", {}).get(args.tag, {})
    # every invocation that added to this tag, in order (an interrupted sweep is resumed with another plan)
    run.setdefault("commands", []).append({"command": " ".join(sys.argv), "machine": machine_info()})
    run.setdefault("conditions", {}).update({c: CONDITIONS[c] for c in args.conditions})
    run.setdefault("variants", {}).update({v: VARIANTS[v] for v in args.variants})
    run.setdefault("results", {})
    if args.prepare:
        os.makedirs(demo_dir, exist_ok=True)
        run["prepare"] = prepare(demo_dir, 0)
    write_calib500(demo_dir)
    test = load_test(demo_dir)
    if args.references and "references" not in run:
        run["references"] = score_references(demo_dir, test)
    plan = [(c, v) for c in args.conditions for v in args.variants]
    if args.plan:
        plan = [(entry.split(":")[0], v) for entry in args.plan for v in entry.split(":")[1].split(",")]
        run["conditions"].update({c: CONDITIONS[c] for c, _ in plan})
        run["variants"].update({v: VARIANTS[v] for _, v in plan})
    for seed in args.seeds:
        for condition, variant in plan:
            done = run["results"].get(condition, {}).get(variant, {})
            if str(seed) in done and (done[str(seed)].get("scores") or not args.score):
                continue  # measured by an earlier, interrupted run with the same tag
            result = run_one(demo_dir, condition, variant, seed, args.score, test)
            run["results"].setdefault(condition, {}).setdefault(variant, {})[str(seed)] = result
            save(path, args.tag, run)
    print(f"wrote {path} [{args.tag}]")


if __name__ == "__main__":
    main()
