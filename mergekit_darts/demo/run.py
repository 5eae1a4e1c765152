"""The demo end to end: data → tiny family → mergekit YAML → merge + surgery → ablations → Table 1.

``run_demo(workdir, seed)`` goes through the same code path as ``mergekit-yaml`` (the pipeline's
``merge_and_repair``), then re-runs only the surgery for each ablation (``run_surgery`` with
overrides; hidden states are cached on disk, so each rerun is a few seconds) and scores every
variant on the held-out test sets with greedy decoding.
"""

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from mergekit_darts.demo import tasks
from mergekit_darts.demo.evaluate import score_model
from mergekit_darts.demo.family import FAMILY_VERSION, THREADS, FamilySpec, build_family

MAIN = ("darts_ewl1", "DARTS + EWL1", {"method": "darts", "loss": "ewl1"})
ABLATIONS = [
    ("standard_l1", "Standard surgery + L1", {"method": "standard", "loss": "l1"}),
    ("standard_ewl1", "Standard + EWL1 (ablation)", {"method": "standard", "loss": "ewl1"}),
    ("darts_l1", "DARTS + L1 (ablation)", {"method": "darts", "loss": "l1"}),
    ("darts_kl", "DARTS + KL (beyond the paper)", {"method": "darts", "loss": "kl"}),
    # quality options (docs/quality.md): what `preset: best` sets (the demo YAML's explicit rank and
    # loss would win over the preset itself), and adapters inside the last decoder block
    ("darts_kl_rank64", "DARTS + KL, rank 64 (preset: best before 2026-12-01)", {"method": "darts", "loss": "kl", "rank": 64}),
    ("darts_kl_depth1", "DARTS + KL, depth 1 (block adapters)", {"method": "darts", "loss": "kl", "depth": 1}),
    # no ReLU: the content correction folds into the LM head (`mergekit-darts bake`, `export-peft`);
    # the position table does not, so this variant bakes only with --drop-position-bias
    ("darts_kl_linear", "DARTS + KL, linear (foldable)", {"method": "darts", "loss": "kl", "content": "linear"}),
    ("standard_kl_linear", "Standard + KL, linear (bakes exactly)",
     {"method": "standard", "loss": "kl", "content": "linear"}),
    # what a user could pick instead of training: the truncated SVD of expert - merge of every block
    # linear at rank 8, no data (mergekit-extract-lora's LoRA on the blocks; adapter_init: delta, steps 0)
    ("extract_all8", "Data-free extract, rank 8 in every block (no training)",
     {"loss": "kl", "depth": "all", "depth_rank": 8, "adapter_init": "delta", "steps": 0}),
]


@dataclass(frozen=True)
class DemoSizes:
    family: FamilySpec = field(default_factory=FamilySpec)
    test: int = 100
    calib: int = 50
    merge_weight: float = 0.5
    rank: int = 16
    surgery_steps: int = 500
    continue_calibration: bool = True  # calibrate on prompt + the expert's greedy answer

    @classmethod
    def quick(cls) -> "DemoSizes":
        return cls(family=FamilySpec.quick(), test=50, calib=50, surgery_steps=200)


def write_jsonl(path: str, rows: List[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(workdir: str, seed: int, sizes: DemoSizes):
    """Generate the splits, write calib_<domain>.jsonl (+ test/train jsonl under data/)."""
    splits = {d: tasks.make_splits(d, seed, train=sizes.family.train_examples, calib=sizes.calib,
                                   test=sizes.test) for d in tasks.DOMAINS}
    os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
    for domain, parts in splits.items():
        write_jsonl(os.path.join(workdir, f"calib_{domain}.jsonl"), parts["calib"])
        for name in ("train", "test"):
            write_jsonl(os.path.join(workdir, "data", f"{domain}_{name}.jsonl"), parts[name])
    return splits


def merge_yaml(workdir: str, paths: Dict[str, str], seed: int, sizes: DemoSizes) -> str:
    lines = ["merge_method: task_arithmetic", f"base_model: {paths['base']}", "models:"]
    for domain in tasks.DOMAINS:
        lines += [f"  - model: {paths[domain]}", f"    parameters: {{weight: {sizes.merge_weight}}}"]
    lines += [
        "dtype: float32",
        "surgery:",
        "  method: darts",
        "  loss: ewl1",
        f"  rank: {sizes.rank}",
        f"  max_positions: {sizes.family.seq_len}",
        f"  steps: {sizes.surgery_steps}",
        "  lr: 1.0e-3",
        f"  seed: {seed}",
        "  device: cpu",
        "  dtype: float32",
        "  capture_batch_size: 25",
        f"  cache_dir: {os.path.join(workdir, 'capture_cache')}",
        "  default_domain: math",
        "  domains:",
    ]
    for domain in tasks.DOMAINS:
        calib = os.path.join(workdir, f"calib_{domain}.jsonl")
        extra = f", continue_tokens: {tasks.MAX_NEW_TOKENS[domain]}" if sizes.continue_calibration else ""
        lines += [f"    {domain}:", f"      model: {paths[domain]}",
                  f"      calibration: {{path: {calib}, field: prompt, samples: {sizes.calib}{extra}}}"]
    return "\n".join(lines) + "\n"


def _load(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()


def score_surgery(out: str, tokenizer, test, domains, progress: bool = False) -> Dict[str, float]:
    """Each domain scored with its own correction active (one load, switched at run time)."""
    model = _load(out, trust_remote_code=True, darts_domain=domains[0])
    scores = {}
    for domain in domains:
        model.set_darts_domain(domain)
        scores.update(score_model(model, tokenizer, test, [domain], progress=progress, desc=f"scoring {domain}"))
    return scores


ROUTED = ("darts_kl", "darts_kl_auto", "DARTS + KL, routed automatically")  # (variant, row key, label)


def score_routed(out: str, tokenizer, test, domains, progress: bool = False):
    """The output with ``darts_domain="auto"``: every test prompt gets the domain the router picks from
    it (none named), so the row shows what routing keeps of the oracle-domain row. Also returns the
    share of each domain's test prompts routed to each domain or "none" ({} when there is no router)."""
    model = _load(out, trust_remote_code=True)
    if model.darts.router is None:
        return None, {}
    model.set_darts_domain("auto")
    scores = score_model(model, tokenizer, test, domains, progress=progress, desc="scoring auto")
    tokenizer.padding_side = "left"
    shares = {}
    for domain in domains:
        prompts = [ex["prompt"] for ex in test[domain]]
        picks = []
        for start in range(0, len(prompts), 64):
            batch = tokenizer(prompts[start:start + 64], return_tensors="pt", padding=True)
            picks += model.route_domains(batch["input_ids"], batch["attention_mask"])
        shares[domain] = {name: picks.count(name) / max(1, len(picks)) for name in [*domains, "none"]}
    return scores, shares


def run_demo(workdir: str = "./darts_demo", seed: int = 0, quick: bool = False,
             sizes: Optional[DemoSizes] = None, progress: bool = True,
             log: Callable[[str], None] = print) -> dict:
    """Build (or reuse) the family, merge + repair, run the ablations, score, write the table."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _run_demo(workdir, seed, quick, sizes, progress, log)
    finally:
        torch.set_num_threads(threads)


def _run_demo(workdir, seed, quick, sizes, progress, log) -> dict:
    from mergekit.options import MergeOptions
    from transformers import AutoTokenizer

    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair, run_surgery

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = sizes or (DemoSizes.quick() if quick else DemoSizes())
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    timings: Dict[str, float] = {}
    clock = time.perf_counter()

    def tick(name):
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 1)
        clock = now

    splits = make_data(workdir, seed, sizes)
    words = tasks.vocabulary(splits.values())
    paths = build_family(os.path.join(workdir, "family"), splits, words, seed=seed, spec=sizes.family,
                         progress=progress, log=log)
    tick("family")

    config = merge_yaml(workdir, paths, seed, sizes)
    config_path = os.path.join(workdir, "demo.yml")
    with open(config_path, "w") as f:
        f.write(config)
    out = os.path.join(workdir, "merged")
    shutil.rmtree(out, ignore_errors=True)
    log(f"merging with mergekit and running the surgery ({config_path} -> {out})")
    options = MergeOptions(quiet=not progress, random_seed=seed)
    reports = {MAIN[0]: merge_and_repair(config, out, original_run_merge(), options=options)}
    tick("merge+surgery")

    tokenizer = AutoTokenizer.from_pretrained(out)
    test = {d: splits[d]["test"] for d in tasks.DOMAINS}
    domains = list(tasks.DOMAINS)
    rows: Dict[str, Dict[str, float]] = {}
    labels: Dict[str, str] = {}
    samples: Dict[str, dict] = {}

    for name in ["base", *domains]:
        key = "base" if name == "base" else f"expert_{name}"
        labels[key] = "Base model" if name == "base" else f"Expert: {name}"
        log(f"scoring {labels[key]}")
        samples[key] = {}
        rows[key] = score_model(_load(paths[name]), tokenizer, test, samples=samples[key],
                                progress=progress, desc=labels[key])
    merged = _load(out, trust_remote_code=True, darts_domain="none")
    labels["merged"] = "Merged (task arithmetic)"
    log(f"scoring {labels['merged']}")
    samples["merged"] = {}
    rows["merged"] = score_model(merged, tokenizer, test, samples=samples["merged"], progress=progress,
                                 desc=labels["merged"])
    del merged
    tick("score experts+merged")

    routing: Dict[str, Dict[str, float]] = {}
    for key, label, overrides in [MAIN, *ABLATIONS]:
        if key != MAIN[0]:
            log(f"surgery: {label}")
            # a reduced family (tests) may be narrower than a row's rank: surgery rejects rank > hidden
            sized = {**overrides, "rank": min(overrides["rank"], sizes.family.hidden_size)} if "rank" in overrides else overrides
            reports[key] = run_surgery(config, out, overrides=sized, options=options, progress=progress)
        if key == MAIN[0]:
            for extra in ("darts_report.json",):
                if os.path.exists(os.path.join(out, extra)):
                    shutil.copy(os.path.join(out, extra), os.path.join(workdir, extra))
        labels[key] = label
        log(f"scoring {label}")
        rows[key] = score_surgery(out, tokenizer, test, domains, progress=progress)
        if key == ROUTED[0]:
            log(f"scoring {ROUTED[2]}")
            scores, routing = score_routed(out, tokenizer, test, domains, progress=progress)
            if scores is not None:
                rows[ROUTED[1]], labels[ROUTED[1]] = scores, ROUTED[2]
    tick("ablations+scoring")
    # one figure for every variant, so the KL one the README recommends is seen next to the paper's
    from mergekit_darts.repair.report.plot import plot_bias

    plot_bias({labels[key]: r for key, r in reports.items()}, os.path.join(workdir, "darts_bias.png"))
    # leave the output directory with the main configuration (cheap: the capture is cached)
    run_surgery(config, out, options=options, progress=progress)
    tick("restore main")

    for scores in rows.values():
        scores["average"] = sum(scores[d] for d in domains) / len(domains)
    result = {
        "seed": seed, "quick": quick, "family_version": FAMILY_VERSION, "sizes": asdict(sizes),
        # the family's float results depend on the vector kernels (docs/results.md#the-demo)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "test_examples": {d: len(test[d]) for d in domains}, "rows": rows, "labels": labels,
        "surgery_losses": {k: {d: e.get("final_loss") for d, e in r["domains"].items()} for k, r in reports.items()},
        "bias": {k: {d: [e["bias"]["mean_before"], e["bias"]["mean_after"]] for d, e in r["domains"].items()}
                 for k, r in reports.items()},
        # share of the held-out KL(expert || merged) gap each correction closes, per domain
        "kl_gap_closed": {k: {d: e["held_out_kl"]["gap_closed"] for d, e in r["domains"].items()}
                          for k, r in reports.items()},
        # share of each domain's test prompts the DARTS + KL router sent to each domain ("none": fallback)
        "routing": {"variant": ROUTED[0], "test_prompts": routing,
                    "held_out_calibration": (reports[ROUTED[0]].get("router") or {}).get("accuracy")},
        "samples": samples, "timings_s": timings, "output_dir": out, "config": config_path,
        # every variant's report, so darts_bias.png can be redrawn: plot_bias(result["reports"], path)
        "reports": {labels[key]: r for key, r in reports.items()},
    }
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown_table(result, domains)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(table)
    log("\n" + table)
    return result


def markdown_table(result: dict, domains: List[str]) -> str:
    head = "| Model | " + " | ".join(domains) + " | Average |"
    lines = [
        f"Held-out accuracy (%), greedy decoding; {', '.join(f'{d}: {n} problems' for d, n in result['test_examples'].items())}.",
        "math = exact match of `#### n`; code = hidden tests pass in a sandbox (pass@1); instruct = exact match.",
        "",
        head,
        "|" + "---|" * (len(domains) + 2),
    ]
    for key, scores in result["rows"].items():
        cells = " | ".join(f"{scores[d]:.1f}" for d in domains)
        lines.append(f"| {result['labels'][key]} | {cells} | {scores['average']:.1f} |")
    routing = (result.get("routing") or {}).get("test_prompts")
    if routing:
        own = ", ".join(f"{d} {100 * routing[d][d]:.1f}%" for d in domains)
        fallback = ", ".join(f"{d} {100 * routing[d]['none']:.1f}%" for d in domains)
        lines += ["", f"Routing ({ROUTED[2]}): test prompts routed to their own domain: {own}; "
                      f"to \"none\" (the plain merge): {fallback}."]
    gaps = result.get("kl_gap_closed") or {}
    if gaps:
        lines += [
            "",
            "Share of the held-out next-token KL gap (expert vs plain merge) each correction closes, on held-out "
            "calibration records (1 = the expert's distribution, 0 = the plain merge, < 0 = further away):",
            "",
            "| Surgery | " + " | ".join(domains) + " |",
            "|" + "---|" * (len(domains) + 1),
        ]
        for key, per_domain in gaps.items():
            cells = " | ".join("–" if per_domain.get(d) is None else f"{per_domain[d]:.2f}" for d in domains)
            lines.append(f"| {result['labels'][key]} | {cells} |")
    return "\n".join(lines) + "\n"
