"""How well each held-out figure of the report predicts the demo's task scores (docs/quality.md,
"Which figure predicts the task scores"): Spearman rank correlation over rows x domains.

    python benchmarks/demo_quality/behaviour_correlation.py --demo DEMO_WORKDIR/results.json \
        [--sweep benchmarks/results/quality_synthesis.json --tags NAME ...] [--out ...]

Points: every demo row that has a surgery report (the DARTS/standard variants; not the experts, the
base or the routed row, which have no report of their own), plus the plain merge (gap closed 0, the
behaviour figures "before"), per domain; and, with ``--sweep``, every scored run of a
``bench_synthesis.py`` sweep (conditions x variants x seeds x domains). Each figure is correlated with
the task score (accuracy %) and with the score as a share of the domain expert's, pooled over
domains and within each domain.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, machine_info, write_json  # noqa: E402

FIGURES = ("gap_closed", "exact_match", "top1_agreement", "first_disagreement")


def figures(entry: dict, side: str = "after") -> dict:
    """The four figures of one report entry (``side``: "after" the correction, "before" = plain merge)."""
    behaviour = entry["behaviour"][side]
    kl = entry["held_out_kl"]
    return {"gap_closed": kl["gap_closed"] if side == "after" else 0.0, **behaviour}


def demo_points(results: dict) -> list:
    points, experts = [], {}
    for domain in ("math", "code", "instruct"):
        experts[domain] = results["rows"][f"expert_{domain}"][domain]
    merged_added = set()
    for label, report in results["reports"].items():
        key = next(k for k, v in results["labels"].items() if v == label)
        for domain, entry in report["domains"].items():
            if "before" not in (entry.get("behaviour") or {}):
                continue
            points.append({"row": key, "domain": domain, "score": results["rows"][key][domain],
                           "expert": experts[domain], **figures(entry)})
            if domain not in merged_added:  # the plain merge's figures are every report's "before"
                merged_added.add(domain)
                points.append({"row": "merged", "domain": domain, "score": results["rows"]["merged"][domain],
                               "expert": experts[domain], **figures(entry, "before")})
    return points


def sweep_points(sweep: dict, tags) -> list:
    """Every scored run of the sweep's ``tags`` (pooled: sweeps run in parallel on disjoint seeds)."""
    runs = [sweep["runs"][tag] for tag in tags]
    references = next((run["references"] for run in runs if "references" in run), None)
    experts = {d: references[f"expert_{d}"][d] for d in ("math", "code", "instruct")} if references else {}
    points = []
    for run in runs:
        for condition, variants in run["results"].items():
            for variant, seeds in variants.items():
                for seed, result in seeds.items():
                    for domain, entry in result["domains"].items():
                        if "scores" not in result or "before" not in (entry.get("behaviour") or {}):
                            continue
                        points.append({"row": f"{condition}/{variant}/s{seed}", "domain": domain,
                                       "score": result["scores"][domain], "expert": experts.get(domain),
                                       "gap_closed": entry["gap_closed"], **entry["behaviour"]["after"]})
    return points


def correlations(points: list) -> dict:
    from scipy import stats

    def rho(xs, ys):
        if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
            return None
        result = stats.spearmanr(xs, ys)
        return {"rho": round(float(result.statistic), 3), "p": float(result.pvalue), "n": len(xs)}

    out = {}
    for figure in FIGURES:
        pooled = [p for p in points if p.get(figure) is not None]
        entry = {"pooled_score": rho([p[figure] for p in pooled], [p["score"] for p in pooled])}
        relative = [p for p in pooled if p.get("expert")]
        entry["pooled_share_of_expert"] = rho([p[figure] for p in relative],
                                              [p["score"] / p["expert"] for p in relative])
        for domain in sorted({p["domain"] for p in pooled}):
            mine = [p for p in pooled if p["domain"] == domain]
            entry[domain] = rho([p[figure] for p in mine], [p["score"] for p in mine])
        out[figure] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", help="a demo work directory's results.json (mergekit-darts demo)")
    parser.add_argument("--sweep", help="bench_synthesis.py's JSON")
    parser.add_argument("--tags", nargs="+", help="the sweep's tags (pooled)")
    add_output_options(parser)
    args = parser.parse_args()
    record = {"command": " ".join(sys.argv), "machine": machine_info(), "figures": list(FIGURES)}
    if args.demo:
        with open(args.demo) as handle:
            points = demo_points(json.load(handle))
        record["demo"] = {"points": points, "spearman": correlations(points)}
    if args.sweep:
        with open(args.sweep) as handle:
            points = sweep_points(json.load(handle), args.tags)
        record["sweep"] = {"tags": args.tags, "points": len(points), "spearman": correlations(points)}
    for part in ("demo", "sweep"):
        if part in record:
            print(f"\n{part}: Spearman rho (p) of each figure with the task score, over rows x domains")
            for figure, entry in record[part]["spearman"].items():
                cells = ", ".join(f"{k} {v['rho']:+.2f} (p {v['p']:.2g}, n {v['n']})" for k, v in entry.items() if v)
                print(f"  {figure:20s} {cells}")
    write_json("behaviour_correlation", record, path=args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
