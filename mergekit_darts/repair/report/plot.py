"""The bias figure (``darts_bias.png``): held-out bias by position and KL to the expert, before and
after surgery, for one report or several variants on the same merged model."""

import math
import os
from typing import Any, Dict, List, Optional


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
# distinct from each other and from the grey "before" curve: the demo draws ten variants
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
           "tab:red", "black", "gold", "navy", "lime", "teal", "maroon", "magenta")


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
    while True:  # fewer entries per row until the legend fits the figure's width (long labels were cut off)
        legend = fig.legend(handles, labels, loc="lower center", ncol=per_row, fontsize=8, frameon=False)
        fig.canvas.draw()
        extent = legend.get_window_extent()
        if per_row == 1 or extent.width <= 0.98 * fig.bbox.width:
            break
        legend.remove()
        per_row -= 1
    legend_inches = 0.1 + extent.height / fig.dpi
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
