"""Tables of a ``bench_synthesis.py`` sweep (docs/quality.md): per condition and variant, means over
seeds of the held-out gap closed, the behaviour figures and the task scores, train seconds, the 7B
share, and two-sided Mann-Whitney U tests against a reference run.

    python benchmarks/demo_quality/synthesis_tables.py --tags sweep_a sweep_b --reference real50/best

Several tags (sweeps run in parallel processes on disjoint seeds) are pooled. Writes
benchmarks/results/quality_synthesis_summary.json and prints markdown.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, write_json  # noqa: E402

DOMAINS = ("math", "code", "instruct")


def pooled(sweep: dict, tags) -> dict:
    """{"condition/variant": {seed: result}} over ``tags``, and the references (experts' scores)."""
    runs, references, variants = {}, None, {}
    for tag in tags:
        run = sweep["runs"][tag]
        references = references or run.get("references")
        variants.update(run.get("variants") or {})
        for condition, by_variant in run["results"].items():
            for variant, seeds in by_variant.items():
                runs.setdefault(f"{condition}/{variant}", {}).update(seeds)
    return {"runs": runs, "references": references, "variants": variants}


def share_at_512(variant: dict, layers: int = 4) -> float:
    """A variant's 7B share with the paper's 512 positions (the demo's YAML uses 128)."""
    from mergekit_darts.repair.budget import share_of_7b

    return share_of_7b({"method": "darts", "rank": variant.get("rank", 16), "head_rank": variant.get("head_rank", 0),
                        "max_positions": 512, "depth": variant.get("depth", 0),
                        "depth_rank": variant.get("depth_rank", 8), "layers": layers})["share"]


def values(seeds: dict, pick) -> list:
    out = []
    for result in seeds.values():
        try:
            value = pick(result)
        except (KeyError, TypeError):
            continue
        if value is not None:
            out.append(value)
    return out


PICKS = {
    **{f"gap/{d}": (lambda d: lambda r: r["domains"][d]["gap_closed"])(d) for d in DOMAINS},
    **{f"exact/{d}": (lambda d: lambda r: r["domains"][d]["behaviour"]["after"]["exact_match"])(d) for d in DOMAINS},
    **{f"top1/{d}": (lambda d: lambda r: r["domains"][d]["behaviour"]["after"]["top1_agreement"])(d) for d in DOMAINS},
    **{f"first/{d}": (lambda d: lambda r: r["domains"][d]["behaviour"]["after"]["first_disagreement"])(d)
       for d in DOMAINS},
    **{f"score/{d}": (lambda d: lambda r: r["scores"][d])(d) for d in DOMAINS},
    "score/mean": lambda r: sum(r["scores"][d] for d in DOMAINS) / len(DOMAINS),
    "gap/mean": lambda r: sum(r["domains"][d]["gap_closed"] for d in DOMAINS) / len(DOMAINS),
    **{f"train_s/{d}": (lambda d: lambda r: r["domains"][d]["train_seconds"])(d) for d in DOMAINS},
    "share_7b": lambda r: r["share_7b"]["share"],
}


def summarize(runs: dict, reference: str) -> dict:
    from scipy import stats

    summary = {}
    for name, seeds in runs.items():
        entry = {"seeds": sorted(seeds, key=int)}
        for key, pick in PICKS.items():
            xs = values(seeds, pick)
            if not xs:
                continue
            entry[key] = {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None,
                          "min": min(xs), "n": len(xs)}
            if key.startswith("train_s"):
                entry[key]["median"] = statistics.median(xs)
            ref = values(runs.get(reference, {}), pick)
            if name != reference and len(xs) > 1 and len(ref) > 1 and not key.startswith(("train_s", "share")):
                test = stats.mannwhitneyu(xs, ref, alternative="two-sided")
                entry[key]["vs_reference_p"] = float(test.pvalue)
        summary[name] = entry
    return summary


def _cell(entry: dict, key: str, digits: int = 3) -> str:
    item = entry.get(key)
    if not item:
        return "–"
    text = f"{item['mean']:.{digits}f}"
    p = item.get("vs_reference_p")
    return text + (f" (p {p:.2g})" if p is not None and p < 0.05 else "")


def markdown(summary: dict, references: dict, reference: str) -> str:
    lines = [f"reference for p (Mann-Whitney, two-sided, shown when < 0.05): {reference}", "",
             "| run | seeds | gap closed math / code / instruct | exact match (after) | top-1 agreement (after) "
             "| first disagreement (after) | task scores math / code / instruct | train s (median) | 7B share (512 positions) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, entry in summary.items():
        cells = [name, str(len(entry["seeds"]))]
        for figure, digits in (("gap", 3), ("exact", 2), ("top1", 3), ("first", 1), ("score", 1)):
            cells.append(" / ".join(_cell(entry, f"{figure}/{d}", digits) for d in DOMAINS))
        cells.append(" / ".join(f"{entry[f'train_s/{d}']['median']:.0f}" if f"train_s/{d}" in entry else "–"
                                for d in DOMAINS))
        cells.append(f"{100 * entry['share_7b_512']:.4f}%" if "share_7b_512" in entry else "–")
        lines.append("| " + " | ".join(cells) + " |")
    if references:
        lines += ["", "experts: " + ", ".join(f"{d} {references[f'expert_{d}'][d]:.0f}" for d in DOMAINS)
                  + "; plain merge: " + ", ".join(f"{d} {references['merged'][d]:.0f}" for d in DOMAINS)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", default=os.path.join(RESULTS_DIR, "quality_synthesis.json"))
    parser.add_argument("--tags", nargs="+", required=True)
    parser.add_argument("--reference", default="real50/best")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "quality_synthesis_summary.json"))
    args = parser.parse_args()
    data = pooled(json.load(open(args.sweep)), args.tags)
    summary = summarize(data["runs"], args.reference)
    for name, entry in summary.items():
        entry["share_7b_512"] = share_at_512(data["variants"].get(name.split("/")[1], {}))
    print(markdown(summary, data["references"], args.reference))
    write_json("quality_synthesis_summary", {"command": " ".join(sys.argv), "tags": args.tags,
                                             "reference": args.reference, "references": data["references"],
                                             "summary": summary}, path=args.out)


if __name__ == "__main__":
    main()
