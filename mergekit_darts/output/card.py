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
    lines = [
        CARD_BEGIN,
        "## Representation surgery",
        "",
        "This merge carries per-domain representation surgery modules (DARTS, Decoder-Aware Representation "
        "Tuning via Surgery, [arXiv 2608.28547](https://arxiv.org/abs/2608.28547); added by "
        "[mergekit-darts](https://pypi.org/project/mergekit-darts/)): each corrects the merged model's "
        "final hidden state towards its domain's expert before the LM head.",
        "",
        f"- Method: `{method}` ({detail})",
        f"- Loss: `{darts_meta['loss']}`",
        f"- Added parameters: {added:,} ({100.0 * added / max(merged, 1):.3f}% of the merged model's {merged:,})",
        f"- Default domain: `{default_domain}`",
        "",
        "| Domain | Expert | Calibration (train / held-out) | Final loss | Held-out bias before → after "
        "| Held-out KL to expert before → after |",
        "|---|---|---|---|---|---|",
    ]
    for name, expert in domains.items():
        info = by_domain.get(name, {})
        calib = info.get("calibration") or {}
        bias = info.get("bias") or {}
        sizes = f"{_fmt(calib.get('train'))} / {_fmt(calib.get('held_out'))}" if calib else "–"
        change = f"{_fmt(bias.get('mean_before'))} → {_fmt(bias.get('mean_after'))}" if bias else "–"
        kl = info.get("held_out_kl") or {}
        kl_change = f"{_fmt(kl.get('before'))} → {_fmt(kl.get('after'))}" if kl else "–"
        lines.append(f"| `{name}` | {expert} | {sizes} | {_fmt(info.get('final_loss'))} | {change} | {kl_change} |")
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


def updated_card(out_dir: str, section: str) -> str:
    path = os.path.join(out_dir, CARD)
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    text = _CARD_SECTION.sub("", text).rstrip("\n")
    return (text + "\n\n" if text else "") + section
