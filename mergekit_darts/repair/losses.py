"""Surgery losses (docs/design.md §3) and the chunked vocabulary computations they need.

Hidden-state losses compare corrected merged states with the expert's states over valid positions.
``kl`` compares next-token distributions instead: the expert's (own head) against the corrected
state pushed through the merged head. Everything that touches the vocabulary is chunked over
positions so a [N, T, V] logits tensor never exists whole.
"""

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from mergekit_darts.config import LOSSES  # noqa: E402  (the one list of loss names)

HIDDEN_LOSSES = tuple(name for name in LOSSES if name != "kl")
ENTROPY_WEIGHTED = ("ewl1", "ewmse")
DEFAULT_CHUNK = 1024


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


def _kl_chunk(
    h: torch.Tensor,
    h_expert: torch.Tensor,
    expert_head: torch.Tensor,
    merged_head: torch.Tensor,
    head_correction: Optional[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    with torch.no_grad():
        log_p = torch.log_softmax(h_expert.float() @ expert_head.float().T, dim=-1)
    logits = h.float() @ merged_head.float().T
    if head_correction is not None:
        logits = logits + head_correction(h)
    log_q = torch.log_softmax(logits, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum()


def kl_loss(
    corrected: torch.Tensor,
    expert_hidden: torch.Tensor,
    expert_head: torch.Tensor,
    merged_head: torch.Tensor,
    head_correction: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean over M positions of KL(softmax(W_E h*) || softmax(W_M h_hat [+ head correction])).

    corrected, expert_hidden: [M, H] (valid positions only). Each chunk of ``chunk_size`` positions
    is checkpointed: its [chunk, V] logits are recomputed in backward instead of kept, so peak
    memory is a few [chunk, V] float32 tensors whatever M is.
    """
    if corrected.dim() != 2 or tuple(corrected.shape) != tuple(expert_hidden.shape):
        raise ValueError(
            f"kl_loss: corrected {tuple(corrected.shape)} and expert_hidden {tuple(expert_hidden.shape)} "
            "must both be [M, H]"
        )
    for name, head in (("expert_head", expert_head), ("merged_head", merged_head)):
        if head.dim() != 2 or head.shape[1] != corrected.shape[1]:
            raise ValueError(f"{name}: expected [V, {corrected.shape[1]}], got {tuple(head.shape)}")
    if expert_head.shape[0] != merged_head.shape[0]:
        raise ValueError(
            f"expert_head has {expert_head.shape[0]} vocabulary rows but merged_head has {merged_head.shape[0]}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    count = corrected.shape[0]
    if count == 0:
        raise ValueError("kl_loss: no positions")
    # promote once here, not per chunk: a [V, H] conversion per chunk would dominate the step
    expert_head = expert_head.to(corrected.device, torch.float32)
    merged_head = merged_head.to(corrected.device, torch.float32)
    needs_grad = torch.is_grad_enabled()
    total = corrected.new_zeros((), dtype=torch.float32)
    for start in range(0, count, chunk_size):
        args = (corrected[start:start + chunk_size], expert_hidden[start:start + chunk_size].to(corrected.device))
        if needs_grad:
            total = total + checkpoint(
                _kl_chunk, *args, expert_head, merged_head, head_correction, use_reentrant=False
            )
        else:
            total = total + _kl_chunk(*args, expert_head, merged_head, head_correction)
    return total / count


# Elements of one [chunk, V] float32 buffer in token_entropy (16 MiB): at most two exist at once,
# so the entropy pass stays small next to the model whatever the vocabulary size.
ENTROPY_CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def token_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-position entropy of softmax(W h [+ b]) in float32: [..., H] -> [...].

    Computed ``chunk_size`` positions at a time (default: as many as fit in ENTROPY_CHUNK_ELEMENTS
    per [chunk, V] buffer); only the entropies are kept, never the logits. In-place ops keep two
    [chunk, V] buffers alive at most.
    """
    if hidden_states.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(
            f"hidden_states: hidden size {hidden_states.shape[-1]} does not match lm_head_weight "
            f"{tuple(lm_head_weight.shape)}"
        )
    if chunk_size is None:
        chunk_size = max(1, ENTROPY_CHUNK_ELEMENTS // lm_head_weight.shape[0])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    weight = lm_head_weight.to(flat.device).float()
    bias = None if lm_head_bias is None else lm_head_bias.to(flat.device).float()
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_size):
        log_p = flat[start:start + chunk_size].float() @ weight.T
        if bias is not None:
            log_p += bias
        log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
        # H = -sum p log p, with p = exp(log_p) as the second buffer, multiplied in place
        out[start:start + chunk_size] = -log_p.exp().mul_(log_p).sum(dim=-1)
    return out.reshape(hidden_states.shape[:-1])


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
