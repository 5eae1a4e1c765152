"""Held-out, validation and refit splits of a captured domain (docs/design.md §3).

Splits are by prompt: every sampled continuation of a prompt (``calibration.continue_samples``)
lands on the same side, so a held-out number never measures a prompt the correction trained on.
"""

from typing import Dict

import torch

from mergekit_darts.repair.capture.prompts import split_held_out  # noqa: F401  (re-exported)


def prompt_count(data) -> int:
    """How many prompts a captured domain holds: its rows ``[0, prompts)`` are one per prompt; sampled
    continuations (``data.groups``) follow them."""
    groups = getattr(data, "groups", None)
    return int(data.merged_hidden.shape[0]) if groups is None else int(groups.max()) + 1


def real_prompt_count(data) -> int:
    """How many of a captured domain's prompts the user wrote; prompts ``[real, prompts)`` were
    written by the expert (``calibration.synthesize``) and only ever train."""
    real = getattr(data, "real_prompts", None)
    return prompt_count(data) if real is None else int(real)


def split_rows(data, surgery, seed: int) -> Dict[str, torch.Tensor]:
    """Row indices {train, validation, held_out} of a captured domain, split by prompt.

    Rows ``[0, prompts)`` are the prompts' greedy (or plain) rows; sampled continuations follow,
    ``data.groups`` naming each row's prompt. The held-out split is the same prompts as without
    samples, and is measured on their greedy rows only, so numbers stay comparable across settings.
    Validation prompts (``surgery.validation`` of the training prompts) are kept only when something
    is chosen with them (``lr_candidates`` / ``early_stopping``)."""
    n_rows = data.merged_hidden.shape[0]
    groups = getattr(data, "groups", None)
    groups = torch.arange(n_rows) if groups is None else groups
    prompts, real = prompt_count(data), real_prompt_count(data)
    # held out among the user's prompts only, the same ones as without synthesized prompts
    train_prompts, held_prompts = split_held_out(real, surgery.held_out, seed)
    train_prompts = torch.cat([train_prompts, torch.arange(real, prompts)])
    validation_prompts = train_prompts[:0]
    if surgery.early_stopping or (surgery.lr_candidates and len(surgery.lr_candidates) > 1):
        fit_idx, val_idx = split_held_out(train_prompts.numel(), surgery.validation, seed + 1)
        train_prompts, validation_prompts = train_prompts[fit_idx], train_prompts[val_idx]
    in_train = torch.isin(groups, train_prompts)
    in_validation = torch.isin(groups, validation_prompts) & (torch.arange(n_rows) < prompts)
    in_refit = in_train | torch.isin(groups, validation_prompts)
    return {"train": torch.nonzero(in_train).flatten(), "validation": torch.nonzero(in_validation).flatten(),
            "held_out": held_prompts, "refit": torch.nonzero(in_refit).flatten()}
