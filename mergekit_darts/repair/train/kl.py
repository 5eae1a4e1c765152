"""The KL to the expert's next-token distribution: the one implementation (docs/design.md §3, docs/scale.md).

``kl_loss`` (training's ``loss: kl``, the validation loss, the report's held-out KL) and the KL
targets at scale all go through ``kl_to_target``: the merged logits of a chunk of corrected states,
their log-softmax, and the target's ``chunk_kl``. The expert's distribution p = softmax(W_E h*) does
not change during training; a ``KLTarget`` holds it for every valid position, indexed by row:

* ``exact``: nothing cached; p recomputed from the expert states at every step (the default).
* ``topk``: the k largest log-probabilities, their token ids and the tail mass 1 - sum(top k). The KL
  is taken between the coarsened distributions (top k tokens + one "tail" bucket): exact when the
  top k cover all the mass, otherwise a lower bound on the full KL (coarsening never increases KL).
* ``bf16``: the full p rounded to bfloat16 and renormalised: the KL to that (slightly perturbed)
  distribution, exactly. [positions x V] x 2 bytes: 1.3 GB for 20480 positions x 32000.

Each target keeps its constant part sum(p log p) in float32, so a step only needs the merged logits.
``precision="mixed"`` makes the [positions x H] x [H x V] products bfloat16 on CUDA (log-softmax and
everything after stay float32); elsewhere it is ignored and float32 is used.
"""

import logging
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

LOG = logging.getLogger(__name__)

TARGET_KINDS = ("exact", "topk", "bf16")
DEFAULT_CHUNK = 1024
PRECISIONS = ("float32", "mixed")


def uses_mixed_precision(precision: str, device: torch.device) -> bool:
    if precision not in PRECISIONS:
        raise ValueError(f"kl_precision: unknown precision {precision!r}; choose one of {PRECISIONS}")
    return precision == "mixed" and torch.device(device).type == "cuda"


def _logits(h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """[m, V] float32 logits; the matmul runs in ``head``'s dtype (bfloat16 in mixed precision)."""
    return (h.to(head.dtype) @ head.T).float()


class KLTarget:
    """The expert's distribution at ``count`` positions; ``chunk_kl`` sums KL(p || q) over some rows."""

    count: int

    def chunk_kl(self, log_q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ExactTarget(KLTarget):
    def __init__(self, expert_hidden: torch.Tensor, expert_head: torch.Tensor):
        self.hidden, self.head, self.count = expert_hidden, expert_head, expert_hidden.shape[0]

    def chunk_kl(self, log_q, rows):
        with torch.no_grad():
            log_p = torch.log_softmax(_logits(self.hidden[rows], self.head), dim=-1)
        return (log_p.exp() * (log_p - log_q)).sum()


class TopKTarget(KLTarget):
    def __init__(self, indices, log_p, tail_mass, plogp):
        self.indices, self.log_p, self.tail_mass, self.plogp = indices, log_p, tail_mass, plogp
        self.count = indices.shape[0]

    def chunk_kl(self, log_q, rows):
        index = self.indices[rows]
        cross = (self.log_p[rows].exp() * log_q.gather(1, index)).sum(-1)
        # log q(tail) over the tokens outside the top k; a finite fill keeps the gradient 0 (not NaN)
        # where the top k cover the whole vocabulary and the tail mass is 0
        outside = log_q.scatter(1, index, torch.finfo(log_q.dtype).min)
        cross = cross + self.tail_mass[rows] * torch.logsumexp(outside, dim=-1)
        return (self.plogp[rows] - cross).sum()


class DenseTarget(KLTarget):
    def __init__(self, probs: torch.Tensor, plogp: torch.Tensor):
        self.probs, self.plogp, self.count = probs, plogp, probs.shape[0]

    def chunk_kl(self, log_q, rows):
        p = _renormalised(self.probs[rows])
        return (self.plogp[rows] - (p * log_q).sum(-1)).sum()


def _renormalised(probs_bf16: torch.Tensor) -> torch.Tensor:
    p = probs_bf16.float()
    return p / p.sum(-1, keepdim=True)


@torch.no_grad()
def build_kl_target(kind: str, expert_hidden: torch.Tensor, expert_head: torch.Tensor, *, top_k: int = 256,
                    chunk_size: int = DEFAULT_CHUNK, precision: str = "float32") -> KLTarget:
    """The expert's target at the M rows of ``expert_hidden`` ([M, H], valid positions only).

    Cached targets are computed once here in float32 whatever ``precision`` says, on the device of
    ``expert_hidden``; the caches stay there.
    """
    if kind not in TARGET_KINDS:
        raise ValueError(f"kl_target: unknown target {kind!r}; choose one of {TARGET_KINDS}")
    if expert_hidden.dim() != 2 or expert_head.dim() != 2 or expert_head.shape[1] != expert_hidden.shape[1]:
        raise ValueError(f"kl target: expert_hidden {tuple(expert_hidden.shape)} must be [M, H] and expert_head "
                         f"{tuple(expert_head.shape)} [V, H]")
    device = expert_hidden.device
    mixed = uses_mixed_precision(precision, device)
    head = expert_head.to(device, torch.bfloat16 if (mixed and kind == "exact") else torch.float32)
    if kind == "exact":
        return ExactTarget(expert_hidden, head)
    if top_k <= 0:
        raise ValueError(f"kl_top_k: must be positive, got {top_k}")
    count, vocab = expert_hidden.shape[0], head.shape[0]
    k = min(top_k, vocab)
    parts = {"indices": [], "log_p": [], "tail": [], "probs": [], "plogp": []}
    for start in range(0, count, chunk_size):
        log_p = torch.log_softmax(expert_hidden[start:start + chunk_size].float() @ head.T, dim=-1)
        if kind == "topk":
            values, indices = log_p.topk(k, dim=-1)
            log_tail = torch.logsumexp(log_p.scatter(1, indices, float("-inf")), dim=-1)
            tail = log_tail.exp()
            parts["indices"].append(indices)
            parts["log_p"].append(values)
            parts["tail"].append(tail)
            parts["plogp"].append((values.exp() * values).sum(-1) + torch.where(tail > 0, tail * log_tail, 0.0))
        else:
            probs = log_p.exp().to(torch.bfloat16)
            p = _renormalised(probs)
            parts["probs"].append(probs)
            parts["plogp"].append(torch.xlogy(p, p).sum(-1))
    plogp = torch.cat(parts["plogp"])
    if kind == "topk":
        return TopKTarget(torch.cat(parts["indices"]), torch.cat(parts["log_p"]), torch.cat(parts["tail"]), plogp)
    return DenseTarget(torch.cat(parts["probs"]), plogp)


def _chunk(h, rows, target: KLTarget, head, head_correction):
    logits = _logits(h, head)
    if head_correction is not None:
        logits = logits + head_correction(h)
    return target.chunk_kl(torch.log_softmax(logits, dim=-1), rows)


def kl_to_target(corrected: torch.Tensor, rows: torch.Tensor, target: KLTarget, merged_head: torch.Tensor,
                 head_correction: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Mean over the m rows of KL(target[rows] || softmax(merged_head h [+ head correction])).

    corrected: [m, H]; rows: [m] indices into the target. ``merged_head`` is used in its dtype
    (prepare it once with ``prepare_head``). Chunks are checkpointed only when there is more than one:
    with a single chunk the recompute would save no memory.
    """
    if corrected.dim() != 2 or rows.shape != corrected.shape[:1]:
        raise ValueError(f"kl_to_target: corrected {tuple(corrected.shape)} must be [m, H] with one row index "
                         f"each, got rows {tuple(rows.shape)}")
    count = corrected.shape[0]
    if count == 0:
        raise ValueError("kl_to_target: no positions")
    chunked = torch.is_grad_enabled() and count > chunk_size
    total = corrected.new_zeros((), dtype=torch.float32)
    for start in range(0, count, chunk_size):
        args = (corrected[start:start + chunk_size], rows[start:start + chunk_size], target, merged_head,
                head_correction)
        total = total + (checkpoint(_chunk, *args, use_reentrant=False) if chunked else _chunk(*args))
    return total / count


def prepare_head(head: torch.Tensor, device: torch.device, precision: str) -> torch.Tensor:
    """The merged head on ``device`` in the matmul dtype: bfloat16 in mixed precision on CUDA."""
    dtype = torch.bfloat16 if uses_mixed_precision(precision, device) else torch.float32
    return head.to(device, dtype)


def kl_loss(
    corrected: torch.Tensor,
    expert_hidden: torch.Tensor,
    expert_head: torch.Tensor,
    merged_head: torch.Tensor,
    head_correction: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean over M positions of KL(softmax(W_E h*) || softmax(W_M h_hat [+ head correction])), exact,
    in float32: ``kl_to_target`` with the ``exact`` target.

    corrected, expert_hidden: [M, H] (valid positions only). With more than one chunk of
    ``chunk_size`` positions each chunk is checkpointed: its [chunk, V] logits are recomputed in
    backward instead of kept, so peak memory is a few [chunk, V] float32 tensors whatever M is.
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
    if corrected.shape[0] == 0:
        raise ValueError("kl_loss: no positions")
    device = corrected.device
    # promote once here, not per chunk: a [V, H] conversion per chunk would dominate the step
    target = ExactTarget(expert_hidden.to(device), expert_head.to(device, torch.float32))
    rows = torch.arange(corrected.shape[0], device=device)
    return kl_to_target(corrected, rows, target, merged_head.to(device, torch.float32),
                        head_correction=head_correction, chunk_size=chunk_size)
