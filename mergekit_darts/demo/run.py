"""The demo end to end: data → tiny family → mergekit YAML → merge + surgery → other surgeries and
``preset: best`` → the score table.

``run_demo(workdir, seed)`` goes through the same code path as ``mergekit-yaml`` (the pipeline's
``merge_and_repair``), then re-runs only the surgery for each other row on a copy of the merge
(``run_surgery`` with overrides; hidden states are cached on disk, so each rerun is seconds), then
``preset: best`` from a YAML that says so (``demo_best.yml`` → ``merged_best/``), and scores every
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
from mergekit_darts.demo.table import README_PRESET, markdown_table

MAIN = ("darts_ewl1", "DARTS + EWL1", {"method": "darts", "loss": "ewl1"})  # the paper's defaults
# The paper's ablations and quality options that docs/results.md#the-demo holds, measured on this family
# (seed 0): shown again only with `mergekit-darts demo --all-rows`, so that the default run has the time
# to train what the README recommends (PRESET_ROWS).
PAPER_ABLATIONS = [
    ("standard_l1", "Standard surgery + L1", {"method": "standard", "loss": "l1"}),
    ("standard_ewl1", "Standard + EWL1 (ablation)", {"method": "standard", "loss": "ewl1"}),
    ("darts_l1", "DARTS + L1 (ablation)", {"method": "darts", "loss": "l1"}),
]
KL = ("darts_kl", "DARTS + KL (beyond the paper)", {"method": "darts", "loss": "kl"})
QUALITY_ABLATIONS = [
    # what `preset: best` set before 2026-12-01 (the demo YAML's explicit rank and loss would win over a preset)
    ("darts_kl_rank64", "DARTS + KL, rank 64 (preset: best before 2026-12-01)", {"method": "darts", "loss": "kl", "rank": 64}),
    ("darts_kl_depth1", "DARTS + KL, depth 1 (block adapters)", {"method": "darts", "loss": "kl", "depth": 1}),
    # no ReLU: the content correction folds into the LM head (`mergekit-darts bake`, `export-peft`);
    # the position table does not, so this variant bakes only with --drop-position-bias
    ("darts_kl_linear", "DARTS + KL, linear (foldable)", {"method": "darts", "loss": "kl", "content": "linear"}),
    ("standard_kl_linear", "Standard + KL, linear (bakes exactly)",
     {"method": "standard", "loss": "kl", "content": "linear"}),
]
# what a user could pick instead of training: the truncated SVD of expert - merge of every block
# linear at rank 8, no data (mergekit-extract-lora's LoRA on the blocks; adapter_init: delta, steps 0)
EXTRACT = ("extract_all8", "Data-free extract, rank 8 in every block (no training)",
           {"loss": "kl", "depth": "all", "depth_rank": 8, "adapter_init": "delta", "steps": 0})
ALL_ROWS_ONLY = [*PAPER_ABLATIONS, *QUALITY_ABLATIONS]


def surgery_rows(all_rows: bool = False) -> list:
    """The surgeries retrained after MAIN, in table order: (key, label, overrides of the demo YAML)."""
    return [*(PAPER_ABLATIONS if all_rows else []), KL, *(QUALITY_ABLATIONS if all_rows else []), EXTRACT]


# What the README recommends, run from a YAML that says `preset: best` (no explicit method, loss, rank,
# steps or lr, which would win over the preset): (key, label, prompts written by the merge's base model
# per domain, as a DemoSizes field name or None).
PRESET_ROWS = [
    ("preset_best", "preset: best (50 prompts per domain)", None),
    ("preset_best_synth", "preset: best + 450 prompts the base writes (synthesize)", "synthesize"),
]


def preset_rows(all_rows: bool = False) -> list:
    """The preset rows a run trains: writing and answering 450 prompts per domain and training on them
    does not fit the default run's 10 minutes on 2 cores, so the synthesize row comes with all_rows."""
    return PRESET_ROWS if all_rows else [row for row in PRESET_ROWS if row[2] is None]


VARIANTS_DIR, PRESET_DIR, PRESET_YAML = "variants", "merged_best", "demo_best.yml"  # in the workdir


@dataclass(frozen=True)
class DemoSizes:
    family: FamilySpec = field(default_factory=FamilySpec)
    test: int = 100
    calib: int = 50
    merge_weight: float = 0.5
    rank: int = 16
    surgery_steps: int = 500
    continue_calibration: bool = True  # calibrate on prompt + the expert's greedy answer
    synthesize: int = 450  # prompts the merge's base model writes per domain for the synthesize row
    preset_steps: Optional[int] = None  # None: the preset's own; the reduced test demo sets a few

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


def merge_yaml(workdir: str, paths: Dict[str, str], seed: int, sizes: DemoSizes, preset: Optional[str] = None,
               synthesize: int = 0) -> str:
    """The demo's mergekit YAML: the paper's surgery (DARTS + EWL1, rank 16), or with ``preset``
    the preset's settings instead of those keys, and ``synthesize`` prompts per domain written by the
    base model (``synthesize_writer``)."""
    lines = ["merge_method: task_arithmetic", f"base_model: {paths['base']}", "models:"]
    for domain in tasks.DOMAINS:
        lines += [f"  - model: {paths[domain]}", f"    parameters: {{weight: {sizes.merge_weight}}}"]
    lines += ["dtype: float32", "surgery:"]
    if preset is None:
        lines += ["  method: darts", "  loss: ewl1", f"  rank: {sizes.rank}", f"  steps: {sizes.surgery_steps}",
                  "  lr: 1.0e-3"]
    else:
        lines.append(f"  preset: {preset}")
        if sizes.preset_steps is not None:
            lines.append(f"  steps: {sizes.preset_steps}")
    lines += [
        f"  max_positions: {sizes.family.seq_len}",
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
        if synthesize:
            extra += f", synthesize: {synthesize}, synthesize_writer: {paths['base']}"
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
             log: Callable[[str], None] = print, lines: bool = False, all_rows: bool = False) -> dict:
    """Build (or reuse) the family, merge + repair, run the other surgeries and ``preset: best``, score,
    write the table. ``progress``: tqdm bars; ``lines``: a line every few seconds from the long stages
    instead (stderr is a log file); ``all_rows``: the paper's ablations and quality options too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _run_demo(workdir, seed, quick, sizes, progress, log, lines, all_rows)
    finally:
        torch.set_num_threads(threads)


def _run_demo(workdir, seed, quick, sizes, progress, log, lines, all_rows) -> dict:
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
                         progress=progress, log=log, lines=lines)
    tick("family")

    config = merge_yaml(workdir, paths, seed, sizes)
    config_path = os.path.join(workdir, "demo.yml")
    with open(config_path, "w") as f:
        f.write(config)
    out = os.path.join(workdir, "merged")
    for stale in (out, os.path.join(workdir, VARIANTS_DIR), os.path.join(workdir, PRESET_DIR)):
        shutil.rmtree(stale, ignore_errors=True)
    log(f"merging with mergekit and running the surgery ({config_path} -> {out})")
    # a log file (lines) gets the surgery's stage lines: progress None lets the run decide from stderr
    surgery_progress = None if lines else progress
    options = MergeOptions(quiet=not (progress or lines), random_seed=seed)
    reports = {MAIN[0]: merge_and_repair(config, out, original_run_merge(), options=options)}
    if os.path.exists(os.path.join(out, "darts_report.json")):
        shutil.copy(os.path.join(out, "darts_report.json"), os.path.join(workdir, "darts_report.json"))
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
    labels[MAIN[0]] = MAIN[1]
    log(f"scoring {MAIN[1]}")
    rows[MAIN[0]] = score_surgery(out, tokenizer, test, domains, progress=progress)
    tick("score experts+merged")

    # every other surgery runs on a copy of the merge, so `merged/` stays what demo.yml makes
    variants = shutil.copytree(out, os.path.join(workdir, VARIANTS_DIR))
    routing: Dict[str, Dict[str, float]] = {}
    for key, label, overrides in surgery_rows(all_rows):
        log(f"surgery: {label}")
        # a reduced family (tests) may be narrower than a row's rank: surgery rejects rank > hidden
        sized = {**overrides, "rank": min(overrides["rank"], sizes.family.hidden_size)} if "rank" in overrides else overrides
        reports[key] = run_surgery(config, variants, overrides=sized, options=options, progress=surgery_progress)
        labels[key] = label
        log(f"scoring {label}")
        rows[key] = score_surgery(variants, tokenizer, test, domains, progress=progress)
        if key == ROUTED[0]:
            log(f"scoring {ROUTED[2]}")
            scores, routing = score_routed(variants, tokenizer, test, domains, progress=progress)
            if scores is not None:
                rows[ROUTED[1]], labels[ROUTED[1]] = scores, ROUTED[2]
    tick("surgeries+scoring")

    # what the README recommends, from YAMLs that say `preset: best`; the 50-prompt one runs last, in
    # its own folder, and stays there as the recommended recipe's output
    preset_out = os.path.join(workdir, PRESET_DIR)
    for key, label, written in sorted(preset_rows(all_rows), key=lambda row: row[2] is None):
        preset_config = merge_yaml(workdir, paths, seed, sizes, preset="best",
                                   synthesize=getattr(sizes, written) if written else 0)
        target = variants if written else shutil.copytree(out, preset_out)
        if not written:
            with open(os.path.join(workdir, PRESET_YAML), "w") as f:
                f.write(preset_config)
        log(f"surgery: {label}")
        reports[key] = run_surgery(preset_config, target, options=options, progress=surgery_progress)
        labels[key] = label
        log(f"scoring {label}")
        rows[key] = score_surgery(target, tokenizer, test, domains, progress=progress)
        tick(key)
    shutil.rmtree(variants, ignore_errors=True)
    # the table in PRESET_ROWS' order (the synthesize row ran first, in the scratch copy)
    shown = [key for key, _, _ in preset_rows(all_rows)]
    rows = {**{k: v for k, v in rows.items() if k not in README_PRESET}, **{k: rows[k] for k in shown}}
    reports = {**{k: v for k, v in reports.items() if k not in README_PRESET}, **{k: reports[k] for k in shown}}
    # one figure for every variant, so the KL one the README recommends is seen next to the paper's
    from mergekit_darts.repair.report.plot import plot_bias

    plot_bias({labels[key]: r for key, r in reports.items()}, os.path.join(workdir, "darts_bias.png"))

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
        "routing": {"variant": ROUTED[0], "label": ROUTED[2], "test_prompts": routing,
                    "held_out_calibration": (reports[ROUTED[0]].get("router") or {}).get("accuracy")},
        "samples": samples, "timings_s": timings, "output_dir": out, "config": config_path,
        "preset_output_dir": preset_out, "preset_config": os.path.join(workdir, PRESET_YAML), "all_rows": all_rows,
        # what the README says of the preset rows: [label, six-seed mean, seed 0], math / code / instruct
        "readme_preset": {key: [label, *README_PRESET[key]] for key, label, _ in PRESET_ROWS},
        # the README's own run (seed 0, full size): its rows are the README's when the kernels are too
        "reference_run": seed == 0 and sizes == DemoSizes(),
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
