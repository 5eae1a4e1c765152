"""A sweep's outputs: results.jsonl (one line per cell), results.md, sweep_plot.png, stats.json.

results.jsonl is appended to as cells finish (a crash loses nothing finished) and rewritten at the
end with one line per cell: the current grid's cells in grid order, then any cells of earlier runs
that the edited YAML no longer lists (kept, never dropped). Statistics across seeds are the
``compare`` ones (``evaluation.compare.summarize_groups``): per merge setting, each surgery
variant's mean/std/Shapiro-Wilk, and a two-sided Mann-Whitney U test between every pair of variants.
"""

import json
import logging
import math
import os
from typing import Any, Dict, List, Optional

LOG = logging.getLogger(__name__)
RESULTS = "results.jsonl"
TABLE = "results.md"
PLOT = "sweep_plot.png"
STATS = "stats.json"


def read_records(path: str) -> Dict[str, Dict[str, Any]]:
    """The last record of each cell in results.jsonl ({} when there is none yet)."""
    records: Dict[str, Dict[str, Any]] = {}
    if not os.path.exists(path):
        return records
    with open(path, "r", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[record["cell"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                # a line cut short by a crash: that cell simply runs again
                LOG.warning("%s:%d: not a cell record; ignoring it (the cell will run again)", path, number)
    return records


def append_record(path: str, record: Dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _rewrite(path: str, records: List[Dict[str, Any]]) -> None:
    staging = path + ".tmp"
    with open(staging, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True, default=str) + "\n")
    os.replace(staging, path)


def _metric(record: Dict[str, Any], metric: str) -> Optional[float]:
    value = (record.get("scores") or {}).get(metric)
    return float(value) if value is not None and math.isfinite(float(value)) else None


def collect(cells, records: Dict[str, Dict[str, Any]], metric: str):
    """{merge label: {variant: [(seed, score)]}} over the finished cells, in grid order."""
    table: Dict[str, Dict[str, List]] = {}
    for cell in cells:
        row = table.setdefault(cell.merge.label, {}).setdefault(cell.variant.name, [])
        record = records.get(cell.hash)
        if record and record.get("status") == "done" and _metric(record, metric) is not None:
            row.append((cell.seed, _metric(record, metric)))
    return table


def statistics(table, metric: str) -> Dict[str, Any]:
    from mergekit_darts.evaluation.compare import summarize_groups

    return {"metric": metric, "by_merge": {
        label: summarize_groups({variant: [score for _, score in runs] for variant, runs in by_variant.items()})
        for label, by_variant in table.items()}}


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def markdown(cells, records, stats: Dict[str, Any], sweep_block) -> str:
    metric = stats["metric"]
    direction = "lower is better" if sweep_block.scoring.lower_is_better else "higher is better"
    failed_by_row: Dict[tuple, int] = {}
    for cell in cells:
        record = records.get(cell.hash)
        if record is not None and record.get("status") != "done":
            key = (cell.merge.label, cell.variant.name)
            failed_by_row[key] = failed_by_row.get(key, 0) + 1
    lines = [f"# Sweep results: `{metric}` ({direction})", "",
             "| merge | surgery variant | n | mean ± std | per seed | failed |",
             "|---|---|---|---|---|---|"]
    for label, by_variant in stats["by_merge"].items():
        for variant, group in by_variant["groups"].items():
            per_seed = " ".join(_num(v) for v in group["scores"])
            lines.append(f"| {label} | {variant} | {group['n']} | {_num(group['mean'])} ± {_num(group['std'])} "
                         f"| {per_seed} | {failed_by_row.get((label, variant), 0)} |")
    lines += ["", "## Across seeds: two-sided Mann-Whitney U between surgery variants", "",
              "| merge | variants | U | p |", "|---|---|---|---|"]
    for label, summary in stats["by_merge"].items():
        for pair, test in summary["mann_whitney"].items():
            lines.append(f"| {label} | {pair} | {_num((test or {}).get('U'))} | {_num((test or {}).get('p'))} |")
    failures = [(cell, records[cell.hash]) for cell in cells
                if cell.hash in records and records[cell.hash].get("status") != "done"]
    if failures:
        lines += ["", "## Failed cells", "", "| cell | merge | variant | seed | stage | error |", "|---|---|---|---|---|---|"]
        for cell, record in failures:
            error = str(record.get("error", "")).replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {cell.hash} | {cell.merge.label} | {cell.variant.name} | {cell.seed} "
                         f"| {record.get('stage')} | {error} |")
    return "\n".join(lines) + "\n"


def plot(table, stats: Dict[str, Any], sweep_block, path: str, baseline=None) -> str:
    """Score vs merge setting, one line per surgery variant (mean over seeds, std as error bars);
    ``baseline`` ({merge label: {variant: [(seed, score)]}}, e.g. the plain merge's held-out KL) as a
    dashed line where given."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    labels = list(table)
    axes = sweep_block.merge
    numeric = len(axes) == 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in axes[0].values)
    xs = list(axes[0].values) if numeric else list(range(len(labels)))
    variants = list(dict.fromkeys(v for by_variant in table.values() for v in by_variant))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 3), 4.5))
    for variant in variants:
        means, stds = [], []
        for label in labels:
            group = stats["by_merge"][label]["groups"].get(variant) or {}
            means.append(group.get("mean") if group.get("mean") is not None else float("nan"))
            stds.append(group.get("std") or 0.0)
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=variant)
    if baseline:
        values = [[score for runs in baseline.get(label, {}).values() for _, score in runs] for label in labels]
        if all(values):
            ax.plot(xs, [sum(v) / len(v) for v in values], linestyle="--", color="gray", marker="x",
                    label="plain merge (no surgery)")
    ax.set_xlabel(axes[0].label if numeric else "merge setting")
    if not numeric:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=20, ha="right")
    direction = "lower is better" if sweep_block.scoring.lower_is_better else "higher is better"
    ax.set_ylabel(f"{stats['metric']} ({direction})")
    seeds = len(sweep_block.seeds)
    ax.set_title(f"{stats['metric']}: mean ± std over {seeds} seed{'s' if seeds != 1 else ''}")
    ax.grid(alpha=0.3)
    ax.legend(title="surgery variant", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(output_dir: str, cells, records: Dict[str, Dict[str, Any]], sweep_block) -> Dict[str, Any]:
    """Rewrite results.jsonl (one line per cell) and write results.md, stats.json and the plot."""
    from mergekit_darts.output.layout import write_json

    listed = {cell.hash for cell in cells}
    ordered = [records[c.hash] for c in cells if c.hash in records]
    ordered += [record for cell_hash, record in records.items() if cell_hash not in listed]
    _rewrite(os.path.join(output_dir, RESULTS), ordered)
    metric = sweep_block.scoring.metric
    table = collect(cells, records, metric)
    stats = statistics(table, metric)
    write_json(os.path.join(output_dir, STATS), stats)
    with open(os.path.join(output_dir, TABLE), "w", encoding="utf-8") as handle:
        handle.write(markdown(cells, records, stats, sweep_block))
    done = [r for r in records.values() if r.get("status") == "done"]
    if done and not any(metric in (r.get("scores") or {}) for r in done):
        known = sorted({k for r in done for k in (r.get("scores") or {})})
        LOG.warning("sweep.scoring.metric %r is in no finished cell's scores; recorded metrics: %s", metric, known)
    if any(runs for by_variant in table.values() for runs in by_variant.values()):
        try:
            baseline = collect(cells, records, metric + "_before")
            plot(table, stats, sweep_block, os.path.join(output_dir, PLOT), baseline=baseline)
        except Exception as error:  # a plot must never cost the user their results
            LOG.warning("could not draw %s: %s", PLOT, error)
    return stats
