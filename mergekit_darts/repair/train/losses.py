"""Surgery losses (docs/design.md §3): every loss the ``loss:`` setting names, by name.

Hidden-state losses compare corrected merged states with the expert's states over valid positions.
``kl`` compares next-token distributions instead: the expert's (own head) against the corrected
state pushed through the merged head; it is the one exact KL of ``train/kl.py``.
"""

from typing import Callable, Optional

import torch

from mergekit_darts.config import LOSSES  # the one list of loss names
from mergekit_darts.repair.train.kl import DEFAULT_CHUNK, kl_loss

HIDDEN_LOSSES = tuple(name for name in LOSSES if name != "kl")
ENTROPY_WEIGHTED = ("ewl1", "ewmse")


def _check_shapes(corrected: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
    if corrected.dim() != 3:
        raise ValueError(f"corrected: expected [N, T, H], got shape {tuple(corrected.shape)}")
    if tuple(target.shape) != tuple(corrected.shape):
        raise ValueError(
            f"target: shape {tuple(target.shape)} does not match corrected {tuple(corrected.shape)}"
        )
    if tuple(mask.shape) != tuple(corrected.shape[:2]):
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match [N, T] = {tuple(corrected.shape[:2])}")


def surgery_loss(
    name: str,
    corrected: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    *,
    expert_head: Optional[torch.Tensor] = None,
    merged_head: Optional[torch.Tensor] = None,
    head_correction: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Loss ``name`` over positions where ``mask`` is true; a float32 scalar.

    corrected, target: [N, T, H]; mask: [N, T] (bool or 0/1); entropy: [N, T] for ewl1/ewmse.
    For ``kl``: ``expert_head`` / ``merged_head`` are the [V, H] LM head weights and
    ``head_correction`` an optional callable adding logit-space corrections to the merged logits.
    """
    if name not in LOSSES:
        raise ValueError(f"loss: unknown loss {name!r}; choose one of {LOSSES}")
    _check_shapes(corrected, target, mask)
    m = mask.to(device=corrected.device, dtype=torch.float32)
    if m.sum() <= 0:
        raise ValueError("mask: no valid (non-padding) positions to compute the loss on")

    if name == "kl":
        if expert_head is None or merged_head is None:
            raise ValueError("loss 'kl' needs expert_head and merged_head (the [V, H] LM head weights)")
        valid = m.bool()
        return kl_loss(
            corrected[valid], target[valid], expert_head, merged_head,
            head_correction=head_correction, chunk_size=chunk_size,
        )

    diff = corrected.float() - target.float()
    if name == "cosine":
        per_position = 1.0 - torch.nn.functional.cosine_similarity(corrected.float(), target.float(), dim=-1)
        return (per_position * m).sum() / m.sum()
    if name in ("l1", "ewl1"):
        per_position = diff.abs().mean(dim=-1)
    else:
        per_position = diff.pow(2).mean(dim=-1)

    if name in ENTROPY_WEIGHTED:
        if entropy is None:
            raise ValueError(f"loss {name!r} needs the expert's per-position entropy (entropy=...)")
        if tuple(entropy.shape) != tuple(mask.shape):
            raise ValueError(f"entropy: shape {tuple(entropy.shape)} does not match mask {tuple(mask.shape)}")
        weight = entropy.to(device=corrected.device, dtype=torch.float32) * m
        total = weight.sum()
        if total <= 0:
            raise ValueError("entropy: all weights are zero on the valid positions; use loss 'l1'")
        return (per_position * weight).sum() / total
    return (per_position * m).sum() / m.sum()


@torch.no_grad()
def per_position_l1(
    states: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mean |states - target| (over H) per position index: [T_max+1] with NaN where no data.

    ``position_ids`` decide the bin, so left padding is handled. With ``weight`` the mean is
    weighted (entropy-weighted bias).
    """
    _check_shapes(states, target, mask)
    d = (states.float() - target.float()).abs().mean(dim=-1)
    m = mask.bool() & (position_ids >= 0)
    pos = position_ids[m].long()
    w = torch.ones_like(d[m]) if weight is None else weight[m].float()
    size = int(pos.max().item()) + 1 if pos.numel() else 0
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, pos.cpu(), (d[m] * w).double().cpu())
    norms = torch.zeros(size, dtype=torch.float64).index_add_(0, pos.cpu(), w.double().cpu())
    return (sums / norms).float()
