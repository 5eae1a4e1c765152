"""What an export without the final-state correction keeps and drops (``--drop-final-state-correction``).

A domain's correction has up to three parts (docs/design.md §3): block adapters (``depth``), the
final-state correction ``ĥ = h − U·c(D·h) − b[t]`` and the head correction (``head_rank``). The block
adapters and the head correction are LoRAs; the final-state correction is not a weight when its content
is ReLU (``c = relu``), and its position table never is. ``bake`` and ``export-peft`` can drop it on
request. One description of what was kept and what was dropped serves the command's output, the
adapter's README.md and the baked model's card, so the three cannot disagree.
"""

from typing import List, Optional

from mergekit_darts.remote_code.surgery import SurgeryShape

SERVING_DOC = "docs/serving.md#dropping-the-final-state-correction-content-relu"


def final_state_description(shape: SurgeryShape, hidden_size: int) -> str:
    """The final-state correction as its formula and parameter count."""
    content = "U·relu(D·h)" if shape.content == "relu" else "U·D·h"
    parts = [f"content `{shape.content}` of rank {shape.rank} ({2 * shape.rank * hidden_size:,} parameters)"]
    formula = f"ĥ = h − {content}"
    if shape.method == "darts":
        formula += " − b[position]"
        parts.append(f"position table {shape.max_positions} × {hidden_size} "
                     f"({shape.max_positions * hidden_size:,} parameters)")
    return f"the final-state correction `{formula}`: {' and '.join(parts)}"


def kept_description(shape: SurgeryShape, block_linears: int, head_kept: bool) -> str:
    kept = []
    if block_linears:
        kept.append(f"the block adapters ({block_linears} linears of the last {shape.depth} decoder blocks, "
                    f"rank {shape.depth_rank})")
    if head_kept:
        kept.append(f"the head correction (rank {shape.head_rank})")
    return " and ".join(kept)


def kl_sentence(kl: Optional[dict]) -> str:
    """What dropping it cost on this output's held-out records, if training measured it."""
    if not kl or "after_without_final_state" not in kl:
        return ("Its effect on this output was not measured (darts_report.json has no "
                "held_out_kl.after_without_final_state: re-run the surgery with this mergekit-darts to measure "
                f"it); what it was worth on a tiny family: {SERVING_DOC}.")
    return (f"Held-out KL to the expert (darts_report.json, measured on the held-out calibration records at "
            f"training): plain merge {kl['before']:.4g}, whole correction {kl['after']:.4g}, without the "
            f"final-state correction (what was exported) {kl['after_without_final_state']:.4g}.")


def dropped_lines(domain: str, shape: SurgeryShape, hidden_size: int, block_linears: int, head_kept: bool,
                  kl: Optional[dict]) -> List[str]:
    """The statement the command prints for ``domain``: what was dropped, what was kept, what it cost."""
    return [f"{domain}: DROPPED {final_state_description(shape, hidden_size)} "
            f"(--drop-final-state-correction); kept exactly: {kept_description(shape, block_linears, head_kept)}. "
            "These weights give the repaired model's logits with the final-state correction switched off, "
            "not the repaired model's. " + kl_sentence(kl)]


def adapter_readme(domain: str, shape: SurgeryShape, hidden_size: int, block_linears: int, head_rank_in_lora: int,
                   dropped: bool, dropped_position_bias: bool, kl: Optional[dict]) -> str:
    """README.md of ``DEST/<domain>/``: what the adapter is, and exactly what it leaves out."""
    head_kept = head_rank_in_lora > 0
    lines = [f"# mergekit-darts adapter: domain `{domain}`", "",
             "A PEFT LoRA (scaling 1) on `../base-model`, the plain merge it was exported from "
             "(`mergekit-darts export-peft`). Targets: "
             + ", ".join(([f"{block_linears} linears of the last {shape.depth} decoder blocks (rank {shape.depth_rank})"]
                          if block_linears else [])
                         + ([f"`lm_head` (rank {head_rank_in_lora})"] if head_kept else [])) + ".", ""]
    if dropped:
        lines += [f"**Dropped** (`--drop-final-state-correction`): {final_state_description(shape, hidden_size)}. "
                  "It has no weight form, so this adapter gives the repaired model's logits with that correction "
                  f"switched off — exactly: {kept_description(shape, block_linears, head_kept)} — and not the "
                  "repaired model's logits.", "", kl_sentence(kl), ""]
    elif dropped_position_bias:
        lines += [f"**Dropped** (`--drop-position-bias`): the position table ({shape.max_positions} × {hidden_size}) "
                  "of `method: darts`; everything else of the correction is in this adapter exactly.", ""]
    else:
        lines += ["Nothing was dropped: on the base this adapter gives the repaired model's logits for this "
                  "domain (up to float32 rounding).", ""]
    return "\n".join(lines)


def baked_section(summary: dict, darts_meta: dict) -> str:
    """The card section of a ``bake`` directory with block adapters folded into their linears or the
    final-state correction dropped (``card.baked_section`` describes a head-only fold)."""
    from mergekit_darts.output.card import CARD_BEGIN, CARD_END

    domain, shape = summary["domain"], summary["shape"]
    folded = [f"the block adapters of {summary['block_linears']} linears (`W + A_up·A_down`)"] if summary[
        "block_linears"] else []
    if summary["dropped_final_state"]:
        folded += ["the head correction (`lm_head.weight = W + H_u·H_d`)"] if shape.head_rank else []
    else:
        folded.append("the final-state correction" + (" and the head correction" if shape.head_rank else "")
                      + " (`lm_head.weight = (W + H_u·H_d)·(I − U·D)`)")
    lines = [CARD_BEGIN, "## Representation surgery, folded into the weights", "",
             f"This is the merge with the `{domain}` domain's representation surgery (expert: "
             f"{summary.get('expert') or '–'}; trained by [mergekit-darts](https://pypi.org/project/mergekit-darts/) "
             f"with loss `{darts_meta.get('loss')}`) folded in by `mergekit-darts bake`: {' and '.join(folded)}. "
             "Every other tensor is the merge's. It loads as a plain model (no remote code).", ""]
    if summary["dropped_final_state"]:
        lines += [f"- **Dropped** (`--drop-final-state-correction`): {final_state_description(shape, summary['hidden_size'])}. "
                  "Its logits are the repaired model's with that correction switched off, not the repaired model's. "
                  + kl_sentence(summary.get("held_out_kl"))]
    elif summary["dropped_position_bias"]:
        lines += ["- **Dropped** (`--drop-position-bias`): the per-position bias table of `method: darts`."]
    if summary.get("head_source") is not None:
        lines.append("- The input embeddings are unchanged; `tie_word_embeddings` is false because the head is "
                     "now domain-specific.")
    lines += [CARD_END, ""]
    return "\n".join(lines)
