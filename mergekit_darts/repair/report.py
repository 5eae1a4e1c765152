"""Representation-bias report (Figure 1 and Table 3 of the DARTS paper, arXiv 2608.28547): L1 bias vs position.

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


def variant_label(report: Dict[str, Any]) -> str:
    """``DARTS + EWL1``-style name of a report's surgery (method + loss, then what differs from the
    defaults among content and depth)."""
    settings = report.get("surgery") or {}
    method = {"darts": "DARTS", "standard": "standard"}.get(settings.get("method"), settings.get("method") or "surgery")
    loss = str(settings.get("loss") or "").upper()
    label = f"{method} + {loss}" if loss else method
    content = settings.get("content")
    if content and content != "relu":
        label += f", {content}"
    if settings.get("depth"):
        label += f", depth {settings['depth']}"
    return label


def _variants(reports: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """One report (``darts_report.json``) or {label: report}: always {label: report}."""
    if "domains" in reports:
        return {variant_label(reports): reports}
    return dict(reports)


def _title(name: str, expert: str) -> str:
    # the expert's folder name only when it says more than the domain name does
    base = os.path.basename(str(expert or "").rstrip("/"))
    return name if not base or base == name else f"{name} (expert: {base})"


# rows of the figure: (bias key prefix, y label); KL is a third row when any report has it
_BIAS_ROWS = (("", "mean L1 to expert"), ("_weighted", "entropy-weighted L1 to expert"))
_BEFORE_COLOR = "0.35"
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def plot_bias(reports: Dict[str, Any], path: str) -> str:
    """Draw the held-out representation bias before/after surgery to ``path`` (PNG); returns path.

    ``reports``: one ``darts_report.json`` dict, or {variant label: report} to draw several surgery
    variants (e.g. DARTS + EWL1 and DARTS + KL) on the same merged model. One column per domain; rows:
    mean L1 to the expert by token position, the entropy-weighted L1 (each on its own scale, both from
    0), and the held-out next-token KL to the expert (the number that matters for generation) as
    bars. The merged model's curve ("before") is drawn once when every variant shares it. The legend
    sits below the panels, never over data.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    variants = _variants(reports)
    domains: List[str] = []
    for report in variants.values():
        domains += [n for n, d in report.get("domains", {}).items() if d.get("bias") and n not in domains]
    if not domains:
        raise ValueError("report: no domain has a 'bias' section to plot")
    has_kl = any((r["domains"].get(n) or {}).get("held_out_kl") for r in variants.values() for n in domains)
    rows = len(_BIAS_ROWS) + (1 if has_kl else 0)
    fig, axes = plt.subplots(rows, len(domains), figsize=(3.9 * len(domains) + 0.6, 2.5 * rows + 1.0),
                             squeeze=False)
    colors = {label: _COLORS[i % len(_COLORS)] for i, label in enumerate(variants)}
    for col, name in enumerate(domains):
        entries = {label: r["domains"][name] for label, r in variants.items() if (r["domains"].get(name) or {}).get("bias")}
        first = next(iter(entries.values()))
        for row, (suffix, ylabel) in enumerate(_BIAS_ROWS):
            ax = axes[row][col]
            befores = [tuple(_nan(e["bias"]["before" + suffix])) for e in entries.values()]
            shared = all(b == befores[0] for b in befores)  # NaN != NaN: unequal empty bins draw per variant
            if shared or len(entries) == 1:
                bias = first["bias"]
                ax.plot(_centers(bias["bin_edges"]), _nan(bias["before" + suffix]), "o-", ms=3, lw=1.6,
                        color=_BEFORE_COLOR, label="merged, no surgery (before)")
            for label, entry in entries.items():
                x = _centers(entry["bias"]["bin_edges"])
                if not (shared or len(entries) == 1):
                    ax.plot(x, _nan(entry["bias"]["before" + suffix]), ":", lw=1.2, color=colors[label],
                            label=f"merged (before), {label}")
                ax.plot(x, _nan(entry["bias"]["after" + suffix]), "o-", ms=3, lw=1.6, color=colors[label],
                        label=f"after {label}")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(ylabel, fontsize=8)
            if row == 0:
                ax.set_title(_title(name, first.get("expert")), fontsize=10)
            ax.set_xlabel("token position", fontsize=8)
            ax.tick_params(labelsize=7)
        if has_kl:
            _kl_bars(axes[len(_BIAS_ROWS)][col], entries, colors, first_col=col == 0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # a variant missing from the first domain still gets its entry
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    held_out = all(r["domains"][n].get("bias_split", "held_out") == "held_out"
                   for r in variants.values() for n in domains if n in r["domains"])
    fig.suptitle(("Held-out" if held_out else "TRAINING-record (held_out 0 or too few records)")
                 + " representation bias of the merged model, before and after surgery "
                 "(lower = closer to the domain's expert)", fontsize=10)
    per_row = max(2, min(len(labels), int(fig.get_figwidth() / 1.9)))  # ~1.9 inches per legend entry
    fig.legend(handles, labels, loc="lower center", ncol=per_row, fontsize=8, frameon=False)
    legend_inches = 0.1 + 0.22 * math.ceil(len(labels) / per_row)
    fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1 - 0.3 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _kl_bars(ax, entries: Dict[str, Dict[str, Any]], colors: Dict[str, str], first_col: bool) -> None:
    """Held-out KL(expert || model): the plain merge, then each variant after surgery."""
    from matplotlib.ticker import MaxNLocator

    names, values, bar_colors, notes = [], [], [], []
    kls = {label: e.get("held_out_kl") or {} for label, e in entries.items()}
    befores = {kl.get("before") for kl in kls.values() if kl.get("before") is not None}
    if len(befores) == 1:
        names.append("merged")
        values.append(befores.pop())
        notes.append("")
        bar_colors.append(_BEFORE_COLOR)
    for label, kl in kls.items():
        if kl.get("after") is None:
            continue
        names.append(label if len(befores) <= 1 else f"{label}\n(before {kl.get('before'):.3g})")
        values.append(kl["after"])
        closed = kl.get("gap_closed")
        notes.append("" if closed is None else f"  ({100 * closed:.0f}%)")
        bar_colors.append(colors[label])
    ax.barh(range(len(values)), values, color=bar_colors, height=0.7)
    ax.set_yticks(range(len(values)), names, fontsize=7)
    ax.invert_yaxis()
    top = max(values) if values else 1.0
    for i, (value, note) in enumerate(zip(values, notes)):
        ax.text(value + 0.01 * top, i, f"{value:.3g}{note}", va="center", fontsize=7)
    ax.set_xlim(0, top * 1.4 if top > 0 else 1.0)
    ax.xaxis.set_major_locator(MaxNLocator(3))
    ax.set_xlabel("held-out KL to expert, nats/token\n(%: share of the merge's KL closed)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_axisbelow(True)
    ax.grid(axis="x", alpha=0.3)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _sig(value: Optional[float]) -> str:
    # KL values of a good repair are small: significant digits, not fixed decimals
    return "-" if value is None else f"{value:.4g}"


def summary_table(report: Dict[str, Any]) -> str:
    """A plain-text table (Table 3 style) per domain: bias before/after surgery, and the KL to the
    expert's next-token distribution before/after with the share of it closed; "measured on" says
    whether those are held-out or (held_out: 0, too few records) training records."""
    header = ["domain", "train", "held-out", "measured on", "final loss", "train s", "L1 before", "L1 after",
              "reduction", "EW-L1 before", "EW-L1 after", "KL before", "KL after", "KL gap closed", "verdict"]
    rows = [header]
    for name, entry in report.get("domains", {}).items():
        bias = entry.get("bias") or {}
        calib = entry.get("calibration") or {}
        kl = entry.get("held_out_kl") or {}
        before, after = bias.get("mean_before"), bias.get("mean_after")
        reduction = f"{100 * (1 - after / before):.1f}%" if before and after is not None else "-"
        measured = "held-out" if entry.get("bias_split", "held_out") == "held_out" else "TRAINING records"
        status = (entry.get("verdict") or {}).get("status", "-")
        closed = kl.get("gap_closed")
        rows.append([name, _fmt(calib.get("train")), _fmt(calib.get("held_out")), measured,
                     _fmt(entry.get("final_loss")), _fmt(entry.get("train_seconds"), 1), _fmt(before), _fmt(after),
                     reduction,
                     _fmt(bias.get("mean_before_weighted")), _fmt(bias.get("mean_after_weighted")),
                     _sig(kl.get("before")), _sig(kl.get("after")), "-" if closed is None else f"{100 * closed:.1f}%",
                     status if status in ("improved", "-") else status.upper()])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    settings = report.get("surgery") or {}
    if settings:
        keys = ("method", "content", "loss", "rank", "head_rank", "max_positions", "steps", "seed")
        if settings.get("depth"):
            keys += ("depth", "depth_rank")
        lines.insert(0, "surgery: " + ", ".join(f"{k}={settings[k]}" for k in keys if k in settings)
                     + (f" (preset {settings['preset']})" if settings.get("preset") else ""))
        if all(k in settings for k in ("rank", "max_positions")):
            from mergekit_darts.repair.budget import describe_share, share_of_7b

            lines.insert(1, describe_share(share_of_7b(settings)))
    lines += ["", "All on the held-out calibration records; lower is better except 'KL gap closed'.",
              "L1 / EW-L1: mean (entropy-weighted) L1 distance of the final hidden state to the expert's.",
              "KL: KL(expert || model) of the next-token distribution (nats/token); gap closed = 1 - after/before.",
              "train s: wall seconds of the domain's training (lr choice, early stopping and refit included)."]
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
