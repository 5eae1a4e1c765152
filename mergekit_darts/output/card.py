"""The model card section that an export adds to (or replaces in) the output's README.md."""

import os
import re
from typing import Optional

from mergekit_darts.output.layout import CARD

CARD_BEGIN = "<!-- mergekit-darts:begin -->"
CARD_END = "<!-- mergekit-darts:end -->"
_CARD_SECTION = re.compile(re.escape(CARD_BEGIN) + r".*?" + re.escape(CARD_END) + r"\n?", re.S)


def _fmt(value, digits=4):
    return "–" if value is None else (f"{value:.{digits}g}" if isinstance(value, float) else str(value))


def card_section(arch: str, darts_meta: dict, default_domain: str, report: Optional[dict],
                 added: int, merged: int) -> str:
    domains = darts_meta["domains"]
    by_domain = (report or {}).get("domains", {})
    method = darts_meta["method"]
    detail = f"content correction of rank {darts_meta['rank']}"
    if method == "darts":
        detail += f" + per-position bias over {darts_meta['max_positions']} positions"
    if darts_meta.get("content") == "linear":
        detail = detail.replace("content correction", "linear content correction")
    if darts_meta["head_rank"]:
        detail += f" + logit correction of rank {darts_meta['head_rank']}"
    if darts_meta.get("depth"):
        detail += (f" + rank-{darts_meta['depth_rank']} adapters on every linear of the last "
                   f"{darts_meta['depth']} decoder block(s)")
    lines = [
        CARD_BEGIN,
        "## Representation surgery",
        "",
        "This merge carries per-domain representation surgery modules (DARTS, Decoder-Aware Representation "
        "Tuning via Surgery, [arXiv 2608.28547](https://arxiv.org/abs/2608.28547); added by "
        "[mergekit-darts](https://pypi.org/project/mergekit-darts/)): each corrects the merged model's "
        "final hidden state towards its domain's expert before the LM head.",
        "",
        "Load it with `trust_remote_code=True`. Without it, transformers loads the plain merge and its LOAD "
        "REPORT lists the `darts.*` tensors as UNEXPECTED: expected and harmless (the corrections are not "
        "applied; see mergekit-darts' docs/loading.md).",
        "",
        f"- Method: `{method}` ({detail})",
        f"- Loss: `{darts_meta['loss']}`",
        f"- Added parameters: {added:,} ({100.0 * added / max(merged, 1):.3f}% of the merged model's {merged:,})",
        f"- Default domain: `{default_domain}`",
        "",
        "| Domain | Expert | Calibration (train / held-out) | Final loss | Measured on | Bias before → after "
        "| KL to expert before → after | Greedy output = expert's, before → after | Verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    chosen = (report or {}).get("default_domain")
    if isinstance(chosen, dict) and chosen.get("used") != chosen.get("requested"):
        lines[lines.index(f"- Default domain: `{default_domain}`")] += (
            f" (requested `{chosen.get('requested')}`: {chosen.get('reason')})")
    for name, expert in domains.items():
        info = by_domain.get(name, {})
        calib = info.get("calibration") or {}
        bias = info.get("bias") or {}
        sizes = f"{_fmt(calib.get('train'))} / {_fmt(calib.get('held_out'))}" if calib else "–"
        change = f"{_fmt(bias.get('mean_before'))} → {_fmt(bias.get('mean_after'))}" if bias else "–"
        kl = info.get("held_out_kl") or {}
        kl_change = f"{_fmt(kl.get('before'))} → {_fmt(kl.get('after'))}" if kl else "–"
        # numbers from training records (held_out: 0 or too few records) must not be called held-out
        measured = "held-out records" if info.get("bias_split", "held_out") == "held_out" else "**training records**"
        verdict = (info.get("verdict") or {}).get("status", "–")
        if verdict in ("worse", "non_finite", "mixed", "unchanged"):
            from mergekit_darts.repair.report.verdict import STATUS_WORDS

            verdict = f"**{STATUS_WORDS[verdict]}**"
        if info.get("verdict"):  # which metric decided, and any that disagrees
            from mergekit_darts.repair.report.verdict import verdict_note

            verdict += f" ({verdict_note(info['verdict'])})"
        lines.append(f"| `{name}` | {expert} | {sizes} | {_fmt(info.get('final_loss'))} | {measured} | {change} "
                     f"| {kl_change} | {_behaviour_cell(info.get('behaviour'))} | {verdict} |")
    lines += _blocks_lines(by_domain)
    lines += _baseline_lines(report or {})
    lines += _router_lines(darts_meta.get("router"), (report or {}).get("router"))
    example = next(iter(domains))
    lines += [
        "",
        "Load with the correction (the domain is chosen at load time or switched at run time):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this-model", trust_remote_code=True)',
        'model = AutoModelForCausalLM.from_pretrained(',
        f'    "path/to/this-model", trust_remote_code=True, darts_domain="{example}"',
        ")",
        'model.set_darts_domain("none")  # the plain merged model',
        "```",
        "",
        "lm-evaluation-harness: `--model hf --model_args "
        f"pretrained=path/to/this-model,trust_remote_code=True,darts_domain={example}`. "
        f"Without `trust_remote_code` the directory loads as the plain merged `{arch}`.",
        CARD_END,
        "",
    ]
    return "\n".join(lines)


def _blocks_lines(by_domain: dict) -> list:
    """With ``train_blocks``: per domain, which adapted blocks trained and which keep the extract."""
    from mergekit_darts.repair.report.table import blocks_text

    lines = [f"- `{name}`: {text}" for name, info in by_domain.items() if (text := blocks_text(info)) is not None]
    return ["", "Which blocks trained (`train_blocks`) and which ship the data-free extract untrained:", "", *lines] \
        if lines else []


def _baseline_lines(report: dict) -> list:
    """The data-free extract (the same adapters from the SVD of expert − merge, untrained) beside the
    trained correction, both sizes, and which of the two each domain ships (no regret)."""
    from mergekit_darts.repair.report.table import baseline_cells, baseline_intro, behaviour_reason, no_regret_text

    by_domain = report.get("domains", {})
    lines = [f"- `{name}`, no regret: {text}" for name, info in by_domain.items()
             if (text := no_regret_text(info)) is not None]
    lines = ["", "Each domain's trained correction against its untrained start (the better one ships):", "", *lines] \
        if lines else []
    rows = [(name, cells) for name, info in by_domain.items() if (cells := baseline_cells(info)) is not None]
    if not rows:
        return lines
    measured = any(cell != "–" and cell != "-" for _, cells in rows for cell in cells[3])
    lines += ["", baseline_intro(report).replace("mergekit-extract-lora", "`mergekit-extract-lora`"), "",
              "| Domain | Extract | Parameters: extract / trained | KL gap closed: extract / trained |"
              + (" Greedy exact match: extract / trained |" if measured else ""),
              "|---|---|---|---|" + ("---|" if measured else "")]
    lines += [f"| `{name}` | {size} | {' / '.join(params)} | {' / '.join(gap)} |" + (f" {' / '.join(exact)} |" if measured else "")
              for name, (size, params, gap, exact) in rows]
    return lines + ([] if measured else ["", f"Greedy exact match: not measured ({behaviour_reason(report)})."])


def _behaviour_cell(behaviour: Optional[dict]) -> str:
    """Exact-match share and top-1 agreement of greedy continuations with the expert's, plain merge →
    corrected (docs/quality.md, Behaviour)."""
    if behaviour and "not_measured" in behaviour and "prompts" in behaviour:  # too few prompts: no score
        return (f"not measured ({behaviour['prompts']} prompts with a continuation, "
                f"{behaviour.get('empty_continuations', 0)} the expert ended at once)")
    if not behaviour or "before" not in behaviour:
        return "–"
    before, after = behaviour["before"], behaviour["after"]
    return (f"{_pct(before['exact_match'])} → {_pct(after['exact_match'])} of {behaviour['prompts']} prompts "
            f"(top-1 agreement {before['top1_agreement']:.2f} → {after['top1_agreement']:.2f})")


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _router_lines(settings: Optional[dict], measured: Optional[dict]) -> list:
    """The routing section: settings, accuracy and fallback by prompt length, and the confusion
    matrices (docs/routing.md)."""
    if not settings:
        return []
    measured = measured or {}
    labels = [*settings["domains"], "none"]
    split = "held-out" if measured.get("split") == "held_out" else "training"
    how = (measured.get("calibration") or {}).get("threshold")
    rate = (measured.get("calibration") or {}).get("fallback_rate")
    gate = (f"calibrated so that about {_pct(rate)} of in-domain prompts fall back" if how == "conformal" and rate is not None
            else "set in the configuration" if how == "explicit" else "the default")
    states = ("input of the first adapted block" if settings.get("states") == "block_input"
              else "final hidden states, without the correction")
    lines = [
        "",
        "### Automatic domain routing",
        "",
        f"`darts_domain=\"auto\"` picks each prompt's domain from the merged model's own {states} "
        f"(mean-pooled prompt, {settings['kind']} router); a prompt whose confidence is below "
        f"{settings['threshold']:.4g} ({gate}) gets `none` (the plain merge).",
        "",
    ]
    prefixes = measured.get("by_prefix") or {}
    if not prefixes and measured.get("confusion"):  # a report written before prefixes were measured
        prefixes = {"all": {"accuracy": measured.get("accuracy") or {}, "confusion": measured["confusion"]}}
    if prefixes:
        names = list(settings["domains"])
        lines += [f"Routing of {split} calibration records cut to their first 16 / 32 / 64 tokens and whole "
                  "(routed to their own domain / sent to `none`):", "",
                  "| Prompt length | " + " | ".join(f"`{name}`" for name in names) + " |",
                  "|---|" + "---|" * len(names)]
        for label, summary in prefixes.items():
            nones = summary.get("none_share") or {}
            cells = " | ".join(f"{_pct((summary.get('accuracy') or {}).get(n))} / {_pct(nones.get(n))}" for n in names)
            lines.append(f"| {_length(label)} | {cells} |")
        lines += ["", "Confusion matrices (rows: true domain, columns: routed to):", "",
                  "| Prompt length | Domain | " + " | ".join(f"→ `{label}`" for label in labels) + " |",
                  "|---|---|" + "---|" * len(labels)]
        for label, summary in prefixes.items():
            for name, row in (summary.get("confusion") or {}).items():
                cells = " | ".join(str(row.get(column, 0)) for column in labels)
                lines.append(f"| {_length(label)} | `{name}` | {cells} |")
    ood = measured.get("out_of_domain") or {}
    if ood.get("none_share") is not None:
        what = ("the `router_eval` texts" if ood.get("source") == "router_eval" else
                "each domain's prompts routed by a router trained without that domain")
        lines += ["", f"Out-of-domain prompts sent to `none`: {_pct(ood['none_share'])} (on {what})."]
    return lines


def _length(label: str) -> str:
    return "whole prompt" if label == "all" else f"{label} tokens"


def updated_card(out_dir: str, section: str) -> str:
    path = os.path.join(out_dir, CARD)
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    text = _CARD_SECTION.sub("", text).rstrip("\n")
    return (text + "\n\n" if text else "") + section


def baked_section(summary: dict, darts_meta: dict) -> str:
    """The card section of a ``mergekit-darts bake`` directory: which correction was folded, and how."""
    domain = summary["domain"]
    folded = f"linear content correction of rank {summary['rank']}"
    if summary["head_rank"]:
        folded += f" and logit correction of rank {summary['head_rank']}"
    lines = [
        CARD_BEGIN,
        "## Representation surgery, folded into the LM head",
        "",
        f"This is the merge with the `{domain}` domain's representation surgery (expert: "
        f"{summary.get('expert') or '–'}; trained by [mergekit-darts](https://pypi.org/project/mergekit-darts/) "
        f"with loss `{darts_meta.get('loss')}`) folded into its LM head by `mergekit-darts bake`: the "
        f"{folded} became `lm_head.weight = (W + H_u·H_d)·(I − U·D)`. Every other tensor is the merge's.",
        "It loads as a plain model (no remote code); its logits equal the repaired model's with "
        f"`darts_domain=\"{domain}\"`" + (" except for the position table (see below)." if summary[
            "dropped_position_bias"] else "."),
        "",
        "- The input embeddings are unchanged; `tie_word_embeddings` is false because the head is now domain-specific.",
    ]
    if summary["dropped_position_bias"]:
        kl = summary.get("held_out_kl") or {}
        measured = (f" Held-out KL to the expert: {_fmt(kl.get('after'))} with the table, "
                    f"{_fmt(kl.get('after_without_position_bias'))} without it (plain merge: {_fmt(kl.get('before'))})."
                    if "after_without_position_bias" in kl else "")
        lines.append("- The per-position bias table of `method: darts` cannot be folded and was **dropped** "
                     "(`--drop-position-bias`)." + measured)
    lines += [CARD_END, ""]
    return "\n".join(lines)
