"""Representation-bias report (the paper's Figure 1 and Table 3): L1 bias vs token position.

``bias_by_position`` measures, on held-out calibration records, how far the merged model's final
hidden states are from the expert's at each token position, before and after surgery, plain and
entropy-weighted. ``plot_bias`` draws it; ``render_report`` re-draws it from an output directory's
``darts_report.json`` (the ``mergekit-darts report OUT`` command).
"""

import json
import math
import os
from typing import Any, Dict, List, Optional

import torch

REPORT_FILE = "darts_report.json"
PLOT_FILE = "darts_bias.png"


def _bin_means(values: torch.Tensor, weights: torch.Tensor, bins: torch.Tensor, nbins: int) -> List[Optional[float]]:
    """Weighted mean of ``values`` per bin index; None (JSON null) for bins without weight."""
    sums = torch.zeros(nbins, dtype=torch.float64).index_add_(0, bins, values.double() * weights.double())
    norms = torch.zeros(nbins, dtype=torch.float64).index_add_(0, bins, weights.double())
    return [float(s / n) if n > 0 else None for s, n in zip(sums.tolist(), norms.tolist())]


def _mean(values: torch.Tensor, weights: torch.Tensor) -> Optional[float]:
    total = float(weights.double().sum())
    return float((values.double() * weights.double()).sum() / total) if total > 0 else None


def bin_edges(positions: int, bins: int) -> List[int]:
    """Integer bin edges over [0, positions): at most ``bins`` bins, none empty of positions."""
    bins = max(1, min(bins, positions))
    edges = sorted({int(round(i * positions / bins)) for i in range(bins + 1)})
    return edges


@torch.no_grad()
def bias_by_position(
    merged: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
    entropy: torch.Tensor, corrected: torch.Tensor, bins: int = 16, max_positions: Optional[int] = None,
) -> Dict[str, Any]:
    """Mean L1 (over H) between states and the expert's, per position bin, before/after surgery.

    merged / expert / corrected: [N, T, H]; mask, position_ids, entropy: [N, T]. "before" compares
    ``merged`` with ``expert``, "after" ``corrected`` with ``expert``; the ``*_weighted`` variants
    weight each token by the expert's entropy (what EWL1 optimises). Bins follow ``position_ids``
    (so left padding is handled) and are token-weighted: every valid token counts once. Positions
    run over [0, P) with P the largest observed position + 1, capped at ``max_positions``
    (tokens at or past the cap are left out; calibration is truncated there anyway).
    Empty bins are None. The returned dict is JSON-serialisable.
    """
    for name, tensor in (("expert", expert), ("corrected", corrected)):
        if tuple(tensor.shape) != tuple(merged.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match merged {tuple(merged.shape)}")
    for name, tensor in (("mask", mask), ("position_ids", position_ids), ("entropy", entropy)):
        if tuple(tensor.shape) != tuple(merged.shape[:2]):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match [N, T] = {tuple(merged.shape[:2])}")
    valid = mask.bool() & (position_ids >= 0)
    if max_positions is not None:
        valid &= position_ids < max_positions
    pos = position_ids[valid].long().cpu()
    if pos.numel() == 0:
        raise ValueError("mask: no valid (non-padding) positions to report on")
    positions = int(pos.max()) + 1
    edges = bin_edges(positions, bins)
    # bucketize with right=True maps position p to the bin whose [lo, hi) holds it
    bin_index = torch.bucketize(pos, torch.tensor(edges[1:-1]), right=True)
    nbins = len(edges) - 1

    target = expert.float()
    before = (merged.float() - target).abs().mean(dim=-1)[valid].cpu()
    after = (corrected.float() - target).abs().mean(dim=-1)[valid].cpu()
    ones = torch.ones_like(before)
    weight = entropy.float()[valid].cpu()
    return {
        "bin_edges": edges,
        "tokens": [int(c) for c in torch.bincount(bin_index, minlength=nbins).tolist()],
        "before": _bin_means(before, ones, bin_index, nbins),
        "after": _bin_means(after, ones, bin_index, nbins),
        "before_weighted": _bin_means(before, weight, bin_index, nbins),
        "after_weighted": _bin_means(after, weight, bin_index, nbins),
        "mean_before": _mean(before, ones),
        "mean_after": _mean(after, ones),
        "mean_before_weighted": _mean(before, weight),
        "mean_after_weighted": _mean(after, weight),
        "positions": positions,
    }


def _centers(edges: List[int]) -> List[float]:
    # the mean position of each [lo, hi) bin
    return [(lo + hi - 1) / 2 for lo, hi in zip(edges[:-1], edges[1:])]


def _nan(values: List[Optional[float]]) -> List[float]:
    return [math.nan if v is None else v for v in values]


def plot_bias(report: Dict[str, Any], path: str) -> str:
    """Draw before/after bias vs position, one subplot per domain, to ``path`` (PNG); returns path.

    ``report`` is the full ``darts_report.json`` dict ({"surgery": ..., "domains": {name: {"bias": ...}}}).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    domains = {name: d for name, d in report.get("domains", {}).items() if d.get("bias")}
    if not domains:
        raise ValueError("report: no domain has a 'bias' section to plot")
    fig, axes = plt.subplots(1, len(domains), figsize=(4.5 * len(domains), 3.6), squeeze=False)
    method = report.get("surgery", {}).get("method", "darts")
    for ax, (name, entry) in zip(axes[0], domains.items()):
        bias = entry["bias"]
        x = _centers(bias["bin_edges"])
        ax.plot(x, _nan(bias["before"]), "o-", color="tab:red", label="merged (before)")
        ax.plot(x, _nan(bias["after"]), "o-", color="tab:blue", label=f"{method} (after)")
        ax2 = ax.twinx()  # entropy-weighted values live on a different scale
        ax2.plot(x, _nan(bias["before_weighted"]), "--", color="tab:red", alpha=0.5, label="before, entropy-weighted")
        ax2.plot(x, _nan(bias["after_weighted"]), "--", color="tab:blue", alpha=0.5, label="after, entropy-weighted")
        ax2.set_ylabel("entropy-weighted L1", fontsize=8)
        ax.set_title(f"{name} (vs {os.path.basename(str(entry.get('expert', '')).rstrip('/')) or 'expert'})", fontsize=9)
        ax.set_xlabel("token position")
        ax.set_ylabel("mean L1 to expert")
        ax.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper left")
    held_out = all(d.get("bias_split", "held_out") == "held_out" for d in domains.values())
    fig.suptitle("Representation bias vs position (" + ("held-out calibration" if held_out else
                 "measured on TRAINING records: held_out 0 or too few records") + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summary_table(report: Dict[str, Any]) -> str:
    """A plain-text table (Table 3 style) of the per-domain bias before/after surgery."""
    header = ["domain", "train", "held-out", "measured on", "final loss", "L1 before", "L1 after", "reduction",
              "EW-L1 before", "EW-L1 after", "verdict"]
    rows = [header]
    for name, entry in report.get("domains", {}).items():
        bias = entry.get("bias") or {}
        calib = entry.get("calibration") or {}
        before, after = bias.get("mean_before"), bias.get("mean_after")
        reduction = f"{100 * (1 - after / before):.1f}%" if before and after is not None else "-"
        measured = "held-out" if entry.get("bias_split", "held_out") == "held_out" else "TRAINING records"
        status = (entry.get("verdict") or {}).get("status", "-")
        rows.append([name, _fmt(calib.get("train")), _fmt(calib.get("held_out")), measured,
                     _fmt(entry.get("final_loss")), _fmt(before), _fmt(after), reduction,
                     _fmt(bias.get("mean_before_weighted")), _fmt(bias.get("mean_after_weighted")),
                     status if status in ("improved", "-") else status.upper()])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    settings = report.get("surgery") or {}
    if settings:
        keys = ("method", "content", "loss", "rank", "head_rank", "max_positions", "steps", "seed")
        lines.insert(0, "surgery: " + ", ".join(f"{k}={settings[k]}" for k in keys if k in settings))
    return "\n".join(lines)


def load_report(out_dir: str) -> Dict[str, Any]:
    path = os.path.join(out_dir, REPORT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{out_dir}: no {REPORT_FILE} (is this a mergekit-darts output directory?)")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def render_report(out_dir: str, plot: bool = True) -> str:
    """Re-draw ``darts_bias.png`` from ``darts_report.json`` in ``out_dir``; return the summary table."""
    report = load_report(out_dir)
    if plot:
        # write next to the final name first so a failed draw never leaves a truncated PNG behind
        final = os.path.join(out_dir, PLOT_FILE)
        tmp = final + ".tmp.png"
        plot_bias(report, tmp)
        os.replace(tmp, final)
    return summary_table(report)


# ---------------------------------------------------------------------------------------------- verdicts

def _headline(entry: Dict[str, Any], loss: str):
    """(label, before, after) of the held-out metric the training loss optimises: the KL to the expert
    for ``kl``, the entropy-weighted L1 bias for the ``ew*`` losses, the plain L1 bias otherwise."""
    if loss == "kl":
        kl = entry.get("held_out_kl") or {}
        return "KL to expert", kl.get("before"), kl.get("after")
    bias = entry.get("bias") or {}
    if loss.startswith("ew"):
        return "entropy-weighted bias", bias.get("mean_before_weighted"), bias.get("mean_after_weighted")
    return "bias", bias.get("mean_before"), bias.get("mean_after")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def domain_verdict(entry: Dict[str, Any], loss: str) -> Dict[str, Any]:
    """``{"status": "improved" | "worse" | "non_finite", "metric", "before", "after", "measured_on"}``:
    whether the correction made the domain's headline metric better than the plain merge."""
    label, before, after = _headline(entry, loss)
    verdict = {"metric": label, "before": before, "after": after,
               "measured_on": "held-out records" if entry.get("bias_split", "held_out") == "held_out"
               else "training records"}
    if not (_finite(before) and _finite(after)):
        verdict["status"] = "non_finite"
    elif after > before:
        verdict["status"] = "worse"
    else:
        verdict["status"] = "improved"
    return verdict


def choose_default(report: Dict[str, Any], requested: str, allow_worse: bool) -> str:
    """The domain the output loads with. A requested domain whose verdict is not "improved" becomes
    "none" (the plain merge) unless ``allow_worse`` (surgery.allow_worse_default); the choice and
    its reason are recorded in ``report["default_domain"]``."""
    entry = report.get("domains", {}).get(requested)
    verdict = (entry or {}).get("verdict") or {}
    chosen, reason = requested, None
    if entry is not None and verdict.get("status") != "improved":
        if verdict.get("status") == "non_finite":
            chosen, reason = "none", "its metric is not finite"
        elif allow_worse:
            reason = "kept although worse than the plain merge (surgery.allow_worse_default: true)"
        else:
            chosen, reason = "none", "worse than the plain merge"
    report["default_domain"] = {"requested": requested, "used": chosen, **({"reason": reason} if reason else {})}
    return chosen


def finite_report(data: Any, path: str = "", found: Optional[List[str]] = None):
    """``data`` with every NaN/inf float replaced by None, and the JSON paths replaced: the report
    must stay valid JSON (``write_json`` refuses NaN) and say which values were not finite."""
    found = [] if found is None else found
    if isinstance(data, float) and not math.isfinite(data):
        found.append(path or "$")
        return None
    if isinstance(data, dict):
        return {key: finite_report(value, f"{path}.{key}" if path else str(key), found) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_report(value, f"{path}[{i}]", found) for i, value in enumerate(data)]
    return data


def sanitized_report(report: Dict[str, Any]) -> Dict[str, Any]:
    """The report as written to darts_report.json: non-finite numbers -> null, listed under
    ``"non_finite_values"`` (absent when there were none)."""
    found: List[str] = []
    clean = finite_report({k: v for k, v in report.items() if k != "non_finite_values"}, "", found)
    if found:
        clean["non_finite_values"] = found
    return clean
