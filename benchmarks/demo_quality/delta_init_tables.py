"""Tables of docs/quality.md "Starting from the weight deltas" from benchmarks/results/quality_synthesis.json:
the data-free extract (``extract_all{r}``) against the same adapters trained from it (``best_delta{r}``)
by rank, and the six-seed comparisons with the previous ``preset: best`` (``best_all1``) and with the same
adapters trained from zero (``best_all8``), Mann–Whitney U; then the same variants with 450 prompts
more written by the base model and answered by the expert (condition ``synth500``, ``synthesize``).

    python benchmarks/demo_quality/delta_init_tables.py [--json]

The runs come from ``bench_synthesis.py`` (condition ``real50``: the demo's 50 prompts per domain;
``synth500``: those and 450 synthesized); every (variant, seed) found under any tag is pooled.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR  # noqa: E402

DOMAINS = ("math", "code", "instruct")
RANKS = (1, 2, 4, 8, 16)


def pooled(condition: str = "real50") -> dict:
    """{variant: {seed: result}} over every tag of quality_synthesis.json."""
    with open(os.path.join(RESULTS_DIR, "quality_synthesis.json")) as handle:
        runs = json.load(handle)["runs"]
    found: dict = {}
    for run in runs.values():
        for variant, seeds in run.get("results", {}).get(condition, {}).items():
            found.setdefault(variant, {}).update(seeds)
    return found


def _mean(values):
    return statistics.mean(values) if values else None


def summary(results: dict, variant: str) -> dict:
    seeds = results.get(variant, {})
    scored = [r for r in seeds.values() if r.get("scores")]
    return {
        "seeds": sorted(int(s) for s in seeds),
        "scores": {d: _mean([r["scores"][d] for r in scored]) for d in DOMAINS},
        "gap_closed": {d: _mean([r["domains"][d]["gap_closed"] for r in seeds.values()]) for d in DOMAINS},
        "train_s_median": {d: statistics.median([r["domains"][d]["train_seconds"] for r in seeds.values()])
                           if seeds else None for d in DOMAINS},
        "parameters": {d: next(iter(seeds.values()))["domains"][d]["parameters"] if seeds else None for d in DOMAINS},
        "share_7b": (next(iter(seeds.values())).get("share_7b") or {}).get("share") if seeds else None,
    }


def mann_whitney(results: dict, a: str, b: str, results_b: dict = None) -> dict:
    """Two-sided p per domain of ``a``'s task scores against ``b``'s (``b`` from ``results_b`` if given)."""
    from scipy.stats import mannwhitneyu

    out = {}
    for domain in DOMAINS:
        xs = [r["scores"][domain] for r in results.get(a, {}).values() if r.get("scores")]
        ys = [r["scores"][domain] for r in (results_b or results).get(b, {}).values() if r.get("scores")]
        if len(xs) >= 2 and len(ys) >= 2:
            out[domain] = float(mannwhitneyu(xs, ys, alternative="two-sided").pvalue)
    return out


def curve(results: dict) -> dict:
    """Per rank, the trained adapters' (``best_delta{r}``) mean task scores and gap over the seeds every
    rank was trained on, beside the extract's (one number: no data, no training)."""
    trained = [results.get(f"best_delta{r}", {}) for r in RANKS]
    seeds = sorted(set.intersection(*(set(t) for t in trained)), key=int) if all(trained) else []
    rows = {}
    for rank, runs in zip(RANKS, trained):
        picked = [runs[s] for s in seeds]
        extract = next(iter(results.get(f"extract_all{rank}", {}).values()), None)
        rows[rank] = {
            "extract_scores": extract and extract.get("scores"),
            "trained_scores": {d: _mean([r["scores"][d] for r in picked]) for d in DOMAINS},
            "trained_scores_by_seed": {d: [r["scores"][d] for r in picked] for d in DOMAINS},
            "trained_gap_closed": {d: _mean([r["domains"][d]["gap_closed"] for r in picked]) for d in DOMAINS},
        }
    return {"seeds": [int(s) for s in seeds], "ranks": rows}


def _cells(values, digits=1):
    return " / ".join("–" if v is None else f"{v:.{digits}f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results, synthesized = pooled(), pooled("synth500")
    table = {v: summary(results, v) for v in [*(f"extract_all{r}" for r in RANKS), *(f"best_delta{r}" for r in RANKS),
                                              "best_all1", "best_all8", "kl"] if v in results}
    table.update({f"synth500 {v}": summary(synthesized, v) for v in ("best_delta8", "best_all8", "best_all1", "best")
                  if v in synthesized})
    tests = {"best_delta8 vs best_all1": mann_whitney(results, "best_delta8", "best_all1"),
             "best_delta8 vs best_all8 (zero start)": mann_whitney(results, "best_delta8", "best_all8"),
             "best_delta16 vs best_delta8": mann_whitney(results, "best_delta16", "best_delta8"),
             "best_delta4 vs best_delta8": mann_whitney(results, "best_delta4", "best_delta8"),
             "best_delta1 vs best_all1 (within 0.1 %: the deltas vs zero at rank 1)":
                 mann_whitney(results, "best_delta1", "best_all1"),
             "synth500 best_delta8 vs synth500 best_all8 (zero start)":
                 mann_whitney(synthesized, "best_delta8", "best_all8"),
             "synth500 best_delta8 vs real50 best_delta8": mann_whitney(synthesized, "best_delta8", "best_delta8", results),
             "synth500 best_delta8 vs real50 best_all1": mann_whitney(synthesized, "best_delta8", "best_all1", results)}
    with open(os.path.join(RESULTS_DIR, "quality_synthesis.json")) as handle:  # the same family's references
        references = json.load(handle)["runs"].get("delta_references", {}).get("references", {})
    by_rank = curve(results)
    if args.json:
        print(json.dumps({"references": references, "variants": table, "mann_whitney_p": tests,
                          "rank_curve": by_rank}, indent=1))
        return
    for name, scores in references.items():
        print(f"reference {name}: " + " / ".join(f"{scores[d]:.0f}" for d in DOMAINS))
    print("| variant (condition real50 unless named) | seeds | task scores math / code / instruct | gap closed | train s (median) | params (demo) |")
    print("|---|---|---|---|---|---|")
    for variant, row in table.items():
        print(f"| `{variant}` | {len(row['seeds'])} | {_cells(row['scores'].values())} | "
              f"{_cells(row['gap_closed'].values(), 3)} | {_cells(row['train_s_median'].values(), 0)} | "
              f"{row['parameters']['math']:,} |")
    print(f"\nrank curve, trained from the deltas: mean over seeds {by_rank['seeds']} (the extract: one number)")
    print("| rank | extract math / code / instruct | trained | trained math by seed | trained gap closed |")
    print("|---|---|---|---|---|")
    for rank, row in by_rank["ranks"].items():
        extract = row["extract_scores"] or {}
        by_seed = " / ".join(f"{v:.0f}" for v in row["trained_scores_by_seed"]["math"])
        print(f"| {rank} | {_cells([extract.get(d) for d in DOMAINS], 0)} | {_cells(row['trained_scores'].values())} | "
              f"{by_seed} | {_cells(row['trained_gap_closed'].values(), 2)} |")
    for name, ps in tests.items():
        print(f"Mann–Whitney p ({name}): " + ", ".join(f"{d} {p:.3f}" for d, p in ps.items()))


if __name__ == "__main__":
    main()
