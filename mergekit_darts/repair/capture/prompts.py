"""Calibration texts -> the merged tokenizer's ids, and the checks an expert must pass before any load.

All models see the merged model's ids. An expert must share the merged model's hidden size,
vocabulary and tokenization of the calibration texts (checked from configs and tokenizers only).
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.repair.capture.models import model_sizes

LOG = logging.getLogger(__name__)


@dataclass
class Prompts:
    ids: List[List[int]]  # merged-tokenizer ids of the kept texts, truncated to max_positions
    truncated: int = 0
    skipped: int = 0
    real: Optional[int] = None  # with calibration.synthesize: ids[:real] are the user's, the rest the expert's
    synthesis: Optional[Dict[str, int]] = None  # what the synthesis sampled, kept and rejected


def split_held_out(n: int, share: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train indices, held-out indices) of ``n`` records; at least one record trains. The capture
    uses it too: only training prompts seed the expert's synthesized prompts."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = int(round(share * n)) if share > 0 and n >= 2 else 0
    held = min(held, n - 1)
    return order[held:].sort().values, order[:held].sort().values


def encode(tokenizer, text: str, add_special_tokens: Optional[bool]) -> List[int]:
    if add_special_tokens is None:
        bos = getattr(tokenizer, "bos_token", None)
        add_special_tokens = not (bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def tokenize_prompts(tokenizer, spec, max_positions: int) -> Prompts:
    special = set(tokenizer.all_special_ids)
    prompts = Prompts(ids=[])
    for text in spec.texts:
        ids = encode(tokenizer, text, spec.add_special_tokens)
        if not text.strip() or all(token in special for token in ids):  # nothing to learn from
            prompts.skipped += 1
            continue
        if len(ids) > max_positions:
            prompts.truncated += 1
            ids = ids[:max_positions]
        prompts.ids.append(ids)
    if prompts.skipped:
        LOG.warning("domain %s: %d calibration record(s) tokenized to nothing and were skipped", spec.name, prompts.skipped)
    if prompts.truncated:
        LOG.warning("domain %s: %d calibration sample(s) truncated to max_positions=%d",
                    spec.name, prompts.truncated, max_positions)
    if not prompts.ids:
        raise SurgeryConfigError(
            f"surgery.domains.{spec.name}.calibration: none of its {len(spec.texts)} texts tokenizes to "
            "anything; check the calibration field and template"
        )
    return prompts


def check_expert(spec, expert_dir, merged_sizes, merged_tokenizer, trust_remote_code) -> None:
    from transformers import AutoTokenizer

    hidden, vocab = model_sizes(expert_dir, trust_remote_code)
    for what, mine, theirs in (("hidden size", hidden, merged_sizes[0]), ("vocabulary size", vocab, merged_sizes[1])):
        if mine != theirs:
            raise SurgeryConfigError(
                f"surgery.domains.{spec.name}.model: expert {spec.expert!r} has {what} {mine} but the merged "
                f"model has {theirs}; the expert must be one of the merged models (same base architecture)"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(expert_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # e.g. a checkpoint without tokenizer files: nothing to compare against
        LOG.warning("expert %s: no tokenizer to compare with the merged one (%s); assuming they match", spec.expert, error)
        return
    for text in spec.texts:
        mine, theirs = encode(tokenizer, text, spec.add_special_tokens), encode(merged_tokenizer, text, spec.add_special_tokens)
        if mine != theirs:
            raise SurgeryConfigError(
                f"surgery.domains.{spec.name}.model: the tokenizer of expert {spec.expert!r} encodes the "
                f"calibration text {text[:60]!r} differently from the merged model's tokenizer; DARTS needs "
                "experts that share the merged model's tokenizer"
            )
