"""The demo's quality table on real weights: the SmolLM2-135M family of ``benchmarks/real_weights/real_family.py``.

Rows (100 test problems per domain, the demo's scorers, greedy decoding of the chat prompt): the
base, each expert on its own domain, the plain merge (task arithmetic 0.5 each, and TIES), and
repairs of the task-arithmetic merge through the unchanged ``mergekit-yaml`` pipeline with a
``surgery:`` block: the paper's DARTS + EWL1, ``loss: kl``, the data-free extract of every block
linear at the preset's adapter size (``adapter_init: delta``, ``steps: 0``) and ``preset: best``
(which trains those adapters from the extract). Rows whose cost on 2 cores is out of reach at the
demo's settings run with fewer steps or a smaller batch; the record and the table say which.

Each finished row is written to ``WORK/table.json`` at once, and a rerun skips it, so the script can
be stopped and resumed. Also measured: seconds and peak memory of each stage, and for every repair
with a router the share of unseen prompts (their user turn cut to 16 / 32 / 64 tokens, and whole)
routed to their own domain and the share of 60 everyday requests sent to ``none``.

Usage: python benchmarks/real_weights/real_table.py --workdir WORK [--rows a,b] [--seed 0] [--table NAME.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import DATA_DIR, log  # noqa: E402
from real_family import MAX_NEW_TOKENS, chat_prompt  # noqa: E402

DOMAINS = ("math", "code", "instruct")
ROUTE_TOKENS = (16, 32, 64)
# what 2 cores allow: kl through the 49k head on 256 sampled positions a step; the preset's block
# adapters on every layer cost a whole forward and backward of the 30 layers per step
KL_POSITIONS = 256
BEST_STEPS, BEST_BATCH = 30, 8

SURGERY_ROWS = [
    ("darts_ewl1", "DARTS + EWL1 (the paper's method)", {"method": "darts", "loss": "ewl1"}),
    ("darts_kl", "DARTS + KL", {"method": "darts", "loss": "kl", "kl_positions_per_step": KL_POSITIONS}),
    ("best", f"preset: best ({BEST_STEPS} steps, batch {BEST_BATCH})",
     {"preset": "best", "steps": BEST_STEPS, "batch_size": BEST_BATCH, "kl_positions_per_step": KL_POSITIONS}),
    ("extract_all8", "Data-free extract, rank 8 in every block (no training)",
     {"loss": "kl", "depth": "all", "depth_rank": 8, "adapter_init": "delta", "steps": 0}),
]
# the paper's row again, through the mergekit-yaml command itself (merge + surgery in one process);
# the last field: an empty capture cache of the row's own (the capture's seconds without the cache)
CLI_ROWS = [
    ("cli_ewl1", "DARTS + EWL1 through the `mergekit-yaml` command", {"method": "darts", "loss": "ewl1"}, False),
    ("cli_ewl1_uncached", "DARTS + EWL1 through `mergekit-yaml`, nothing cached",
     {"method": "darts", "loss": "ewl1"}, True),
]
ALL_ROWS = (["base", "experts", "merge_ta", "merge_ties"] + [key for key, _, _ in SURGERY_ROWS]
            + [key for key, _, _, _ in CLI_ROWS])


def load_splits(workdir: str) -> Dict[str, Dict[str, List[dict]]]:
    splits = {}
    for domain in DOMAINS:
        with open(os.path.join(workdir, "data", f"{domain}.json")) as handle:
            splits[domain] = json.load(handle)
    return splits


def score(model, tokenizer, test: Dict[str, List[dict]], domains) -> Dict[str, float]:
    """Accuracy (%) per domain: greedy completions of the chat prompts, the demo's scorers (and family
    v2's for its new domains)."""
    from family_v2_tasks import score_completions

    from mergekit_darts.demo.evaluate import generate

    scores = {}
    for domain in domains:
        examples = test[domain]
        completions = generate(model, tokenizer, [ex["chat"] for ex in examples], MAX_NEW_TOKENS[domain], batch_size=50)
        ok = score_completions(domain, examples, completions)
        scores[domain] = 100.0 * sum(ok) / max(1, len(ok))
    return scores


def merge_yaml(workdir: str, method: str, surgery: bool, seed: int = 0, samples: int = 50,
               settings: Optional[dict] = None, domains=DOMAINS, parameters: Optional[dict] = None,
               calibration: Optional[dict] = None, surgery_domains=None) -> str:
    """The merge of ``domains``' experts in WORK (``parameters`` for each; linear has no base model) and,
    with ``surgery``, the repair towards each (``calibration``: more keys of every domain's source), or
    towards ``surgery_domains`` of them only (one alone is its own default: routing needs two)."""
    surgery_domains = list(surgery_domains or domains)
    lines = [f"merge_method: {method}"] + ([] if method == "linear" else [f"base_model: {os.path.join(workdir, 'base')}"])
    parameters = parameters or {"weight": 0.5, **({"density": 0.5} if method == "ties" else {})}
    lines.append("models:")
    for domain in domains:
        lines += [f"  - model: {os.path.join(workdir, f'expert_{domain}')}",
                  f"    parameters: {{{', '.join(f'{key}: {value}' for key, value in parameters.items())}}}"]
    lines.append("dtype: float32")
    if surgery:
        lines += ["surgery:", "  rank: 16", "  max_positions: 256", "  steps: 500", "  lr: 1.0e-3", f"  seed: {seed}",
                  "  device: cpu", "  dtype: float32", "  capture_batch_size: 10",
                  f"  default_domain: {'auto' if len(surgery_domains) > 1 else surgery_domains[0]}"]
        settings = {"cache_dir": os.path.join(workdir, "capture_cache"), **(settings or {})}
        lines += [f"  {key}: {value}" for key, value in settings.items()] + ["  domains:"]
        extra = "".join(f", {key}: {value}" for key, value in (calibration or {}).items())
        for domain in surgery_domains:
            lines += [f"    {domain}:", f"      model: {os.path.join(workdir, f'expert_{domain}')}",
                      f"      calibration: {{path: {os.path.join(workdir, f'calib_{domain}.jsonl')}, field: chat, "
                      f"samples: {samples}, continue_tokens: {MAX_NEW_TOKENS[domain]}{extra}}}"]
    return "\n".join(lines) + "\n"


def routing_shares(model, tokenizer, test: Dict[str, List[dict]], everyday: List[str]) -> dict:
    """Share of unseen prompts of each domain of ``test`` routed to their own domain, the user turn cut
    to N tokens (and whole), and the share of everyday requests routed to "none" (the plain merge)."""
    tokenizer.padding_side = "left"

    def picks(chats):
        found = []
        for start in range(0, len(chats), 50):
            batch = tokenizer(chats[start:start + 50], return_tensors="pt", padding=True, add_special_tokens=False)
            found += model.route_domains(batch["input_ids"], batch["attention_mask"])
        return found

    def cut(prompt, tokens):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return prompt if tokens is None else tokenizer.decode(ids[:tokens])

    result = {}
    for tokens in (*ROUTE_TOKENS, None):
        own, fallback = {}, {}
        for domain in test:
            chosen = picks([chat_prompt(tokenizer, cut(ex["prompt"], tokens)) for ex in test[domain]])
            own[domain] = round(chosen.count(domain) / len(chosen), 3)
            fallback[domain] = round(chosen.count("none") / len(chosen), 3)
        result["whole" if tokens is None else str(tokens)] = {"own_domain": own, "none": fallback}
    chosen = picks([chat_prompt(tokenizer, text) for text in everyday])
    result["everyday_to_none"] = round(chosen.count("none") / len(chosen), 3)
    return result


def everyday_requests() -> List[str]:
    with open(os.path.join(DATA_DIR, "general_instructions.jsonl")) as handle:
        return [json.loads(line)["instruction"] for line in handle if line.strip()]


def run(workdir: str, rows: List[str], seed: int = 0, table_name: Optional[str] = None) -> dict:
    from mergekit.options import MergeOptions
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair, run_surgery
    from mergekit_darts.repair.stages import peak_rss_gib

    # seed 0 has every row; another seed repeats the rows that depend on it (the repairs)
    table_path = os.path.join(workdir, table_name or ("table.json" if seed == 0 else f"table_seed{seed}.json"))
    table = {"rows": {}, "labels": {}, "seconds": {}, "peak_rss_gib": {}, "routing": {}, "reports": {}}
    if os.path.exists(table_path):
        with open(table_path) as handle:
            table = json.load(handle)

    def save(key, label, scores, started, extra=None):
        table["rows"][key], table["labels"][key] = scores, label
        table["seconds"][key] = round(time.perf_counter() - started, 1)
        # the process's peak so far (ru_maxrss never falls): a row's figure includes the rows before it
        table["peak_rss_gib"][key] = round(peak_rss_gib(), 2)
        for name, value in (extra or {}).items():
            table[name][key] = value
        with open(table_path + ".tmp", "w") as handle:
            json.dump(table, handle, indent=1)
        os.replace(table_path + ".tmp", table_path)
        log(f"{label}: {scores} ({table['seconds'][key]} s)")

    splits = load_splits(workdir)
    test = {d: splits[d]["test"] for d in DOMAINS}
    for domain in DOMAINS:
        with open(os.path.join(workdir, f"calib_{domain}.jsonl"), "w") as handle:
            for example in splits[domain]["calib"]:
                handle.write(json.dumps({"chat": example["chat"]}) + "\n")
    base = os.path.join(workdir, "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    options = MergeOptions(quiet=True, random_seed=seed)
    todo = [row for row in rows if row not in table["rows"]]

    if "base" in todo:
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        save("base", "Base: SmolLM2-135M-Instruct", score(model, tokenizer, test, DOMAINS), started)
    if "experts" in todo:
        started, scores = time.perf_counter(), {}
        for domain in DOMAINS:
            path = os.path.join(workdir, f"expert_{domain}")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            scores.update(score(model, tokenizer, test, [domain]))
        save("experts", "Each expert on its own domain", scores, started)
    for key, method, label in (("merge_ta", "task_arithmetic", "Merged: task arithmetic (0.5 each)"),
                               ("merge_ties", "ties", "Merged: TIES (density 0.5, weight 0.5)")):
        if key not in todo:
            continue
        started = time.perf_counter()
        out = os.path.join(workdir, key)
        if not os.path.exists(os.path.join(out, "config.json")):
            merge_and_repair(merge_yaml(workdir, method, surgery=False), out, original_run_merge(), options=options)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        save(key, label, score(model, tokenizer, test, DOMAINS), started)

    config = merge_yaml(workdir, "task_arithmetic", surgery=True, seed=seed,
                        samples=min(len(splits[d]["calib"]) for d in DOMAINS))
    with open(os.path.join(workdir, "repair.yml"), "w") as handle:
        handle.write(config)
    out = os.path.join(workdir, "repaired")
    for key, label, overrides in SURGERY_ROWS:
        if key not in todo:
            continue
        started = time.perf_counter()
        if not os.path.exists(os.path.join(out, "config.json")):
            shutil.copytree(os.path.join(workdir, "merge_ta"), out)
        report = run_surgery(config, out, overrides=overrides, options=options, progress=False)
        scores, extra = repaired_row(out, report, overrides, started, tokenizer, test)
        save(key, label, scores, started, extra)

    for key, label, settings, own_cache in CLI_ROWS:
        if key not in todo:
            continue
        started = time.perf_counter()
        out = os.path.join(workdir, key)
        if own_cache:
            settings = {**settings, "cache_dir": os.path.join(workdir, f"{key}_cache")}
        if not os.path.exists(os.path.join(out, "config.json")):
            if own_cache:  # emptied: every state captured afresh
                shutil.rmtree(settings["cache_dir"], ignore_errors=True)
            path = os.path.join(workdir, f"{key}.yml")
            with open(path, "w") as handle:
                handle.write(merge_yaml(workdir, "task_arithmetic", surgery=True, seed=seed, settings=settings,
                                        samples=min(len(splits[d]["calib"]) for d in DOMAINS)))
            command = [os.path.join(os.path.dirname(sys.executable), "mergekit-yaml"), path, out]
            with open(os.path.join(workdir, f"{key}.log"), "w") as log_file:
                subprocess.run(command, check=True, stdout=log_file, stderr=subprocess.STDOUT)
        with open(os.path.join(out, "darts_report.json")) as handle:
            report = json.load(handle)
        scores, extra = repaired_row(out, report, settings, started, tokenizer, test)
        save(key, label, scores, started, extra)
    return table


def repaired_row(out: str, report: dict, settings: dict, started: float, tokenizer, test):
    """(scores, extra columns) of a repaired directory: each domain's (of ``test``) with that domain active,
    the router's shares, and the report's figures (held-out KL, baseline, seconds of each stage)."""
    from transformers import AutoModelForCausalLM

    surgery_seconds = time.perf_counter() - started
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain=next(iter(test))).eval()
    scores = {}
    for domain in test:
        model.set_darts_domain(domain)
        scores.update(score(model, tokenizer, test, [domain]))
    routing = routing_shares(model, tokenizer, test, everyday_requests()) if model.darts.router is not None else None
    summary = {d: {"held_out_kl": e.get("held_out_kl"), "baseline": e.get("baseline"),
                   "train_seconds": e.get("train_seconds"), "final_loss": e.get("final_loss"),
                   "selection": e.get("selection")}
               for d, e in report["domains"].items()}
    summary.update(surgery_seconds=round(surgery_seconds, 1), settings=settings, stages=report.get("stages"))
    return scores, {"routing": routing, "reports": summary}


def markdown(table: dict, domains=DOMAINS) -> str:
    lines = ["| Model | " + " | ".join(domains) + " | seconds |", "|---|" + "---|" * (len(domains) + 1)]
    for key, scores in table["rows"].items():
        cells = " | ".join(f"{scores[d]:.0f}" if d in scores else "–" for d in domains)
        lines.append(f"| {table['labels'][key]} | {cells} | {table['seconds'][key]:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--rows", default=",".join(ALL_ROWS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", default=None, help="file name in WORK for the rows (default table.json, "
                        "table_seedN.json for --seed N): rows there are not run again")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    unknown = [row for row in args.rows.split(",") if row not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {unknown}; choose from {ALL_ROWS}")
    table = run(args.workdir, args.rows.split(","), args.seed, args.table)
    print(markdown(table))


if __name__ == "__main__":
    main()
