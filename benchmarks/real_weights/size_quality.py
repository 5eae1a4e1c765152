"""The size-quality picture of family v2 (issue 51, docs/results.md): per-domain size of each repair (%
of the model's parameters) against the share of each expert's score it keeps, for the rows of
``real_table_v2.py`` on one merge, with the published reference points beside them.

Reads WORK/scores.json (the experts, the plain merge, the extract curve of ``real_family_v2.py --stages
curve``, joined by a line) and WORK/table_v2.json; draws one marker per
domain (small) and the mean over domains (large) per row, the plain merge at size 0, and the published
points: Delta-CoMe (mixed-precision delta compression) keeps 95-99 % of a fine-tune's score at about 1 bit
per weight of the delta (1/16 of a bf16 model), and low-rank truncation of a 7B fine-tune's delta keeps
about 80 % (a level, its size varies with the rank). Writes a PNG and prints the numbers it drew.

Usage: python benchmarks/real_weights/size_quality.py --workdir WORK [--merge all5_linear] --out docs/size_quality.png
"""

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402,F401  (puts every benchmark folder on sys.path)
import real_family_v2 as family  # noqa: E402

PUBLISHED = {"delta_come": {"size_percent": 100 / 16, "kept": (0.95, 0.99),
                            "label": "Delta-CoMe, ~1 bit per delta weight: 95-99 %"},
             "low_rank": {"kept": 0.80, "label": "low-rank truncation of a 7B fine-tune: ~80 %"}}


def points(scores: dict, table: dict, merge: str) -> List[dict]:
    """One entry per repair row on ``merge`` (and the plain merge): its label, per-domain size % and the
    share of each expert's score it keeps (None where the expert scores 0)."""
    experts = scores["rows"]["experts"]
    plain = scores["rows"][f"merge:{merge}"]
    domains = list(plain)

    def kept(row: Dict[str, float]) -> Dict[str, float]:
        return {d: round(row[d] / experts[d], 3) for d in domains if experts.get(d)}

    found = [{"row": "plain merge", "size_percent": {d: 0.0 for d in domains}, "kept": kept(plain)}]
    for key, row in table["rows"].items():
        name, repair = key.split("/")
        if name != merge:
            continue
        sizes = table.get("size_percent", {}).get(key)
        if not sizes:
            continue
        found.append({"row": repair, "size_percent": sizes, "kept": kept(row)})
    # the extract curve of real_family_v2.py's curve stage (folded into the weights: its factors only)
    for rank, point in sorted(scores.get("curve", {}).get(merge, {}).items(), key=lambda item: int(item[0])):
        found.append({"row": f"extract r{rank} (curve)", "size_percent": {d: point["size_percent"] for d in domains},
                      "kept": kept(point["scores"]), "curve": True})
    return found


def draw(found: List[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4.8))
    floor = min([min(p["size_percent"].values()) for p in found if max(p["size_percent"].values()) > 0] + [0.01]) / 3
    for index, point in enumerate(found):
        if not point["kept"]:  # every expert scored 0: no share to draw
            continue
        sizes = [max(point["size_percent"][d], floor) for d in point["kept"]]
        shares = [100 * point["kept"][d] for d in point["kept"]]
        color = plt.cm.tab20(index % 20)  # up to 20 rows with a colour of their own
        axes.scatter(sizes, shares, s=12, color=color, alpha=0.5)
        mean_size = sum(sizes) / len(sizes)
        mean_share = sum(shares) / len(shares)
        marker = "D" if point.get("curve") else "o"
        axes.scatter([mean_size], [mean_share], s=70, color=color, edgecolor="black", marker=marker, label=point["row"])
    curve = [p for p in found if p.get("curve") and p["kept"]]
    if len(curve) > 1:  # the extract's means joined, rank by rank
        axes.plot([sum(p["size_percent"].values()) / len(p["size_percent"]) for p in curve],
                  [100 * sum(p["kept"].values()) / len(p["kept"]) for p in curve], color="black", linewidth=0.8)
    delta = PUBLISHED["delta_come"]
    axes.errorbar([delta["size_percent"]], [100 * sum(delta["kept"]) / 2], yerr=[[100 * (sum(delta["kept"]) / 2 - delta["kept"][0])],
                  [100 * (delta["kept"][1] - sum(delta["kept"]) / 2)]], fmt="s", color="gray", capsize=4,
                  label=delta["label"])
    axes.axhline(100 * PUBLISHED["low_rank"]["kept"], color="gray", linestyle=":", label=PUBLISHED["low_rank"]["label"])
    axes.axhline(95, color="gray", linestyle="--", linewidth=0.8, label="target: 95 % of every expert")
    axes.set_xscale("log")
    axes.set_xlabel("correction size per domain, % of the model's parameters (plain merge drawn at the left edge)")
    axes.set_ylabel("share of the expert's score kept, %")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: no point hidden
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--merge", default="all5_linear")
    parser.add_argument("--table", default="table_v2.json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    scores = family.Scores(args.workdir).data
    with open(os.path.join(args.workdir, args.table)) as handle:
        table = json.load(handle)
    found = points(scores, table, args.merge)
    draw(found, args.out, f"family v2 (SmolLM2-135M, five experts), repairs of the {args.merge} merge, seed 0")
    for point in found:
        print(json.dumps(point))


if __name__ == "__main__":
    main()
