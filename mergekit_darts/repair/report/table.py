"""The plain-text summary table (Table 3 style) and ``mergekit-darts report OUT``: re-draw the figure
and print the table from an output directory's ``darts_report.json``."""

import json
import os
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from mergekit_darts.console import format_table, pack
from mergekit_darts.repair.report.plot import plot_bias

REPORT_FILE = "darts_report.json"
PLOT_FILE = "darts_bias.png"


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _sig(value: Optional[float]) -> str:
    # KL values of a good repair are small: significant digits, not fixed decimals
    return "-" if value is None else f"{value:.4g}"


def behaviour_cells(behaviour: Optional[Dict[str, Any]]):
    """(prompts, exact match, top-1 agreement, first diff), each 'plain merge -> corrected'; figures
    taken on too few prompts are ``not_measured`` with their counts (docs/quality.md, Behaviour)."""
    if row_counted(behaviour):
        return [str(behaviour["prompts"]), "not measured", "-", "-"]
    if not behaviour or "before" not in behaviour:
        return ["-", "-", "-", "-"]
    before, after = behaviour["before"], behaviour["after"]
    return [str(behaviour["prompts"]), f"{100 * before['exact_match']:.0f}% -> {100 * after['exact_match']:.0f}%",
            f"{before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}",
            f"{before['first_disagreement']:.1f} -> {after['first_disagreement']:.1f}"]


def baseline_cells(entry: Dict[str, Any]) -> Optional[Tuple[str, Tuple[str, str], Tuple[str, str], Tuple[str, str]]]:
    """(extract's shape, parameters, KL gap closed, greedy exact match) of a domain whose report has a
    measured ``baseline`` (the untrained delta-initialised adapters), the last three as (data-free
    extract, trained correction); None when it has none."""
    baseline = entry.get("baseline") or {}
    if "held_out_kl" not in baseline:
        return None

    def gap(kl):
        return "-" if (kl or {}).get("gap_closed") is None else f"{100 * kl['gap_closed']:.1f}%"

    def exact(behaviour):
        return f"{100 * behaviour['after']['exact_match']:.0f}%" if behaviour and "after" in behaviour else "-"

    def count(value):
        return "-" if value is None else f"{value:,}"

    parts = ([f"rank {baseline['rank']}"] if baseline.get("linears", 1) else []) + (
        [f"head {baseline['head_rank']}"] if baseline.get("head_rank") else [])
    size = " + ".join(parts) or "-"
    return (size, (count(baseline.get("parameters")), count(entry.get("parameters"))),
            (gap(baseline["held_out_kl"]), gap(entry.get("held_out_kl"))),
            (exact(baseline.get("behaviour")), exact(entry.get("behaviour"))))


def baseline_line(entry: Dict[str, Any]) -> List[str]:
    """The console's line on a domain's data-free extract (none when it was not measured)."""
    cells = baseline_cells(entry)
    if cells is None:
        return []
    size, (extract_size, trained_size), (extract, trained), _ = cells
    return [f"  data-free extract ({size}, {extract_size} params; the trained correction {trained_size}): "
            f"KL gap closed {extract} (trained {trained})"]


def baseline_intro(report: Dict[str, Any]) -> str:
    """What the baseline comparison shows, true to the run: the start the training had (the extract
    itself, or the zero start beside it), what the trained correction carries on top of the extract's
    adapters, and the records both were measured on."""
    settings = report.get("surgery") or {}
    entries = list((report.get("domains") or {}).values())
    on_train = any(entry.get("bias_split") == "train" for entry in entries)
    where = ("the same training records (held_out: 0 or too few records: there are no held-out ones)" if on_train
             else "the same held-out records")
    extract = ("the same adapters, untrained: the truncated SVD of expert - merge, what mergekit-extract-lora "
               "gives")
    if settings.get("extract_fit") == "activations":
        extract = ("the same adapters, untrained: the truncated SVD of expert - merge fitted to their outputs on the "
                   "merge's inputs (extract_fit: activations), not the weights' SVD that mergekit-extract-lora gives")
    if settings.get("adapter_init") == "delta":
        what = f"The trained correction against the data-free extract it started from ({extract})"
    else:
        what = f"The data-free extract ({extract}) beside the correction trained from the zero start"
    carried = f"a rank-{settings['rank']} content correction" if settings.get("rank") else "a content correction"
    if settings.get("method", "darts") == "darts":
        carried += f" and a {settings.get('max_positions', '?')}-position table"
    kept_start = [name for name, entry in (report.get("domains") or {}).items()
                  if (entry.get("no_regret") or {}).get("kept") == "start"]
    shipped = (f" No regret shipped the untrained start for {', '.join(kept_start)}: its 'trained' cells are "
               "that start's." if kept_start else "")
    return (f"{what}, on {where}. The trained correction also carries {carried} the extract has not: "
            f"both parameter counts are shown.{shipped}")


def baseline_lines(report: Dict[str, Any]) -> List[str]:
    """The data-free extract beside the trained correction, per domain (empty when none was measured):
    every cell "extract | trained"; the exact-match column only where it was measured, else one line why."""
    found = [(name, cells) for name, entry in report.get("domains", {}).items()
             if (cells := baseline_cells(entry)) is not None]
    if not found:
        return []
    measured = any(cell != "-" for _, cells in found for cell in cells[3])
    rows = [["domain", "extract", "parameters", "KL gap closed"] + (["exact match"] if measured else [])]
    rows += [[name, size, " | ".join(params), " | ".join(gap)] + ([" | ".join(exact)] if measured else [])
             for name, (size, params, gap, exact) in found]
    lines = ["", *textwrap.wrap(baseline_intro(report) + " Each cell: extract | trained.", 100), *format_table(rows)]
    if not measured:
        lines += textwrap.wrap(f"exact match: not measured ({behaviour_reason(report)})", 100, subsequent_indent="  ")
    return lines


def behaviour_reason(report: Dict[str, Any]) -> str:
    """Why no domain has behaviour figures, once: the reasons the report recorded, without repeats."""
    reasons = []
    for entry in report.get("domains", {}).values():
        reason = (entry.get("behaviour") or {}).get("not_measured")
        if reason and reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons) or "calibration.continue_tokens is 0: no expert continuation to compare with"


def no_regret_text(entry: Dict[str, Any]) -> Optional[str]:
    """Which of the trained correction and its untrained start shipped, on what and by how much (the
    ``no_regret`` comparison, train/selection.py ``keep_better``); None when there was none."""
    record = entry.get("no_regret") or {}
    if "kept" not in record:
        return None
    where = {"validation": f"the validation split ({record['records']} records)",
             "held_out": f"the held-out records ({record['records']}; no validation split: the records the report's "
                         "figures come from)",
             "train": f"the training records ({record['records']}; held_out: 0 and no validation split)"}[
        record["compared_on"]]
    trained, untrained, margin = record["trained"], record["untrained"], record["margin"]
    share = (f"{100 * abs(margin) / untrained:.1f}% {'lower' if margin > 0 else 'higher'}" if untrained and margin
             else "equal" if not margin else "")
    kept = ("kept the trained correction" if record["kept"] == "trained"
            else f"kept the untrained start ({record['start']}): training did not beat it")
    refit = ""
    if record.get("refit") and record["kept"] == "trained":  # what ships is not what was compared
        shipped, other = (entry.get("held_out_kl") or {}).get("after"), record.get("other_held_out_kl")
        measured = (f" (held-out KL to the expert: {shipped:.4g} shipped, {other:.4g} the start)"
                    if isinstance(shipped, (int, float)) and isinstance(other, (int, float)) else "")
        refit = ("; the trained side is the selected run before its refit: the shipped correction is that run "
                 "refit on the training and validation records, which was not compared with the start" + measured)
    return (f"{kept}: {record['metric']} {trained:.4g} trained against {untrained:.4g} untrained"
            f"{f' ({share})' if share else ''} on {where}{refit}")


def no_regret_line(entry: Dict[str, Any]) -> List[str]:
    """The console's line on the no-regret comparison (none when it was not made)."""
    text = no_regret_text(entry)
    return [] if text is None else [f"  no regret: {text}"]


def blocks_text(entry: Dict[str, Any]) -> Optional[str]:
    """With ``train_blocks`` (the report's ``blocks``): which adapted blocks trained and which keep the
    data-free extract; None without it (every adapted block trained)."""
    blocks = entry.get("blocks")
    if not blocks:
        return None

    def span(layers):  # the layers are consecutive: the top ones train, those below keep the extract
        return f"block {layers[0]}" if len(layers) == 1 else f"blocks {layers[0]}–{layers[-1]}"

    also = " and the ".join(blocks.get("also_trained") or ["final-state correction"])
    count = f"{blocks['trained_parameters']:,} parameters"
    trained = (f"{span(blocks['trained'])} trained with the {also} ({count})" if blocks["trained"]
               else f"only the {also} trained ({count}; train_blocks: 0)")
    kept = f"; {span(blocks['extract'])} keep{'s' * (len(blocks['extract']) == 1)} the data-free extract " \
        "(expert − merge), untrained" if blocks["extract"] else ""
    return f"{trained}{kept}; bake and export-peft fold both"


def blocks_line(entry: Dict[str, Any]) -> List[str]:
    """The console's line on ``blocks`` (none without train_blocks)."""
    text = blocks_text(entry)
    return [] if text is None else [f"  {text}"]


def row_counted(behaviour: Optional[Dict[str, Any]]) -> bool:
    """Behaviour figures counted but not shown as a score (too few prompts, or none continued)."""
    return bool(behaviour) and "not_measured" in behaviour and "prompts" in behaviour


def summary_table(report: Dict[str, Any]) -> str:
    """A plain-text table (Table 3 style) per domain: bias before/after surgery, and the KL to the
    expert's next-token distribution before/after with the share of it closed; "measured on" says
    whether those are held-out or (held_out: 0, too few records) training records. Two tables
    (training, then what was measured) of at most 100 columns (``console.format_table``), and a third
    with the behaviour figures (greedy continuations vs the expert's) when they were measured."""
    training = [["domain", "train", "held-out", "measured on", "final loss", "train s", "measure s", "verdict"]]
    measured = [["domain", "L1 before", "L1 after", "L1 cut", "EW-L1 before", "EW-L1 after", "KL before",
                 "KL after", "gap closed"]]
    behaviour = [["domain", "prompts", "exact match", "top-1 agreement", "first diff"]]
    for name, entry in report.get("domains", {}).items():
        bias = entry.get("bias") or {}
        calib = entry.get("calibration") or {}
        kl = entry.get("held_out_kl") or {}
        before, after = bias.get("mean_before"), bias.get("mean_after")
        reduction = f"{100 * (1 - after / before):.1f}%" if before and after is not None else "-"
        split = "held-out" if entry.get("bias_split", "held_out") == "held_out" else "TRAINING records"
        status = (entry.get("verdict") or {}).get("status", "-")
        closed = kl.get("gap_closed")
        training.append([name, _fmt(calib.get("train")), _fmt(calib.get("held_out")), split,
                         _fmt(entry.get("final_loss")), _fmt(entry.get("train_seconds"), 1),
                         _fmt(entry.get("measure_seconds"), 1),
                         status if status in ("improved", "-") else status.upper()])
        measured.append([name, _fmt(before), _fmt(after), reduction, _fmt(bias.get("mean_before_weighted")),
                         _fmt(bias.get("mean_after_weighted")), _sig(kl.get("before")), _sig(kl.get("after")),
                         "-" if closed is None else f"{100 * closed:.1f}%"])
        behaviour.append([name, *behaviour_cells(entry.get("behaviour"))])
    lines = format_table(training) + [""] + format_table(measured)
    shows_behaviour = any(row[1] != "-" for row in behaviour[1:])
    if shows_behaviour:
        lines += [""] + format_table(behaviour)
    lines += baseline_lines(report)
    from mergekit_darts.repair.report.verdict import verdict_note

    notes = [f"verdict {name}: {verdict_note(entry['verdict'])}" for name, entry in report.get("domains", {}).items()
             if entry.get("verdict")]
    notes += [f"behaviour {name}: not measured: {entry['behaviour']['not_measured']}"
              for name, entry in report.get("domains", {}).items() if row_counted(entry.get("behaviour"))]
    notes += [f"no regret {name}: {text}" for name, entry in report.get("domains", {}).items()
              if (text := no_regret_text(entry)) is not None]
    notes += [f"blocks {name}: {text}" for name, entry in report.get("domains", {}).items()
              if (text := blocks_text(entry)) is not None]
    notes = [part for note in notes for part in textwrap.wrap(note, 100, subsequent_indent="  ")]
    lines += [""] + notes if notes else []
    settings = report.get("surgery") or {}
    if settings:
        keys = ("method", "content", "loss", "rank", "head_rank", "max_positions", "steps", "seed")
        if settings.get("depth"):
            keys += ("depth", "depth_rank") + (("train_blocks",) if settings.get("train_blocks") is not None else ())
        items = [f"{k}={settings[k]}" for k in keys if k in settings]
        if settings.get("preset") and items:
            items[-1] += f" (preset {settings['preset']})"
        head = pack(items, first="surgery: ")
        if all(k in settings for k in ("rank", "max_positions")):
            from mergekit_darts.repair.budget import describe_share, share_of_7b

            share, _, formula = describe_share(share_of_7b(settings)).partition(": ")
            head += [f"parameters: {share}"] + pack(formula.split(" + "), first="  ", indent="    ", separator=" + ")
        lines = head + [""] + lines
    from mergekit_darts.repair.stages import stage_line

    lines += [""] + stage_line(report.get("stages")) if report.get("stages") else []
    lines += ["", "All on the held-out calibration records ('measured on'); lower is better except the cut and gap.",
              "L1 / EW-L1: mean (entropy-weighted) L1 distance of the final hidden state to the expert's;",
              "  L1 cut: 1 - after/before. KL: KL(expert || model) of the next-token distribution",
              "  (nats/token); gap closed: 1 - KL after/before."]
    if shows_behaviour:  # the columns are explained only where they are shown
        lines += ["exact match / top-1 agreement / first diff, plain merge -> corrected: held-out prompts whose",
                  "  greedy continuation is the expert's, the share of the expert's tokens that are the model's",
                  "  top-1, the mean position of the first differing token (docs/quality.md, Behaviour)."]
    lines += ["train s: wall seconds of the domain's training (reading the weight deltas, lr choice, early",
              "  stopping, refit and the no-regret comparison included); measure s: of measuring it (the",
              "  held-out figures and the baseline). Together they are the stages line's 'train <domain>'."]
    return "\n".join(lines)


def load_report(out_dir: str) -> Dict[str, Any]:
    path = os.path.join(out_dir, REPORT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{out_dir}: no {REPORT_FILE} (is this a mergekit-darts output directory?)")
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except ValueError as error:  # the command prints it as one line: it must name the file
            raise ValueError(f"{path}: not valid JSON ({error}); rerun the surgery to write it again") from None


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
