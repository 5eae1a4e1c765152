"""The surgery training loop: cached tensors in, a trained DomainSurgery out (docs/design.md §3).

The models are frozen and their hidden states cached, so a step is a few small matmuls (plus two
vocabulary-sized ones per chunk for ``kl``). Full batch unless ``batch_size`` is given.
"""

import logging
from typing import Callable, List, Optional

import torch
from tqdm.auto import tqdm

from mergekit_darts.repair.kl_targets import build_kl_target, kl_to_target, prepare_head
from mergekit_darts.repair.losses import ENTROPY_WEIGHTED, LOSSES, DEFAULT_CHUNK, surgery_loss
from mergekit_darts.remote_code.surgery import DomainSurgery

LOG = logging.getLogger(__name__)


def _check_inputs(surgery, merged, target, mask, position_ids, entropy, loss):
    if loss not in LOSSES:
        raise ValueError(f"loss: unknown loss {loss!r}; choose one of {LOSSES}")
    if merged.dim() != 3:
        raise ValueError(f"merged: expected [N, T, H], got shape {tuple(merged.shape)}")
    if merged.shape[-1] != surgery.hidden_size:
        raise ValueError(
            f"merged: hidden size {merged.shape[-1]} does not match the surgery module's {surgery.hidden_size}"
        )
    if tuple(target.shape) != tuple(merged.shape):
        raise ValueError(f"target: shape {tuple(target.shape)} does not match merged {tuple(merged.shape)}")
    for name, tensor in (("mask", mask), ("position_ids", position_ids), ("entropy", entropy)):
        if tensor is not None and tuple(tensor.shape) != tuple(merged.shape[:2]):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match [N, T] = {tuple(merged.shape[:2])}"
            )
    if loss in ENTROPY_WEIGHTED and entropy is None:
        raise ValueError(f"loss {loss!r} needs the expert's per-position entropy (entropy=...)")


def train_surgery(
    surgery: DomainSurgery,
    merged: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    loss: str = "ewl1",
    steps: int = 500,
    lr: float = 1e-3,
    batch_size: Optional[int] = None,
    seed: int = 0,
    *,
    expert_head: Optional[torch.Tensor] = None,
    merged_head: Optional[torch.Tensor] = None,
    kl_chunk_size: int = DEFAULT_CHUNK,
    kl_target: str = "exact",
    kl_top_k: int = 256,
    kl_precision: str = "float32",
    kl_positions_per_step: Optional[int] = None,
    progress: bool = False,
    desc: str = "surgery",
    weight_decay: float = 0.0,
    on_step: Optional[Callable[[int, DomainSurgery], bool]] = None,
) -> List[float]:
    """Train ``surgery`` in place with Adam(lr, betas 0.9/0.999; AdamW with ``weight_decay``); per-step losses.

    merged / target: [N, T, H] final hidden states of the merged model and of the expert (any float
    dtype; each batch is promoted to float32). mask: [N, T], true at real tokens. position_ids:
    [N, T]. entropy: [N, T] expert entropies (ewl1/ewmse). ``kl`` needs ``expert_head`` and
    ``merged_head`` ([V, H]). The module moves to ``merged.device``.
    ``weight_decay > 0`` uses AdamW (decoupled decay on every parameter of the correction).
    ``on_step(steps_done, module)`` is called after each step; returning True stops training
    (early stopping, repair/selection.py).

    KL at scale (repair/kl_targets.py): ``kl_target`` "topk"/"bf16" computes the expert's distribution
    once; ``kl_precision="mixed"`` uses bfloat16 logit matmuls on CUDA; ``kl_positions_per_step`` draws
    that many valid positions of the batch per step (seeded by ``seed``). The defaults keep the exact
    float32 loss over every position.
    """
    _check_inputs(surgery, merged, target, mask, position_ids, entropy, loss)
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    if lr <= 0:
        raise ValueError(f"lr: must be positive, got {lr}")
    n = merged.shape[0]
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size: must be positive, got {batch_size}")
    device = merged.device
    surgery.to(device).train()
    if weight_decay < 0:
        raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
    if weight_decay > 0:
        optimizer = torch.optim.AdamW(surgery.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    else:
        optimizer = torch.optim.Adam(surgery.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    full_batch = batch_size is None or batch_size >= n

    def batch_slice(tensor, index):
        if tensor is None:
            return None
        return tensor if index is None else tensor[index.to(tensor.device)]

    scaled_kl = loss == "kl" and (kl_target != "exact" or kl_precision != "float32"
                                  or kl_positions_per_step is not None)
    if scaled_kl:
        if expert_head is None or merged_head is None:
            raise ValueError("loss 'kl' needs expert_head and merged_head (the [V, H] LM head weights)")
        if kl_positions_per_step is not None and kl_positions_per_step <= 0:
            raise ValueError(f"kl_positions_per_step: must be positive, got {kl_positions_per_step}")
        valid = mask.bool()
        # row_of[i, t]: the target row of valid position (i, t); the target is built once, for all rows
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row_of[valid] = torch.arange(int(valid.sum()), device=mask.device)
        target_cache = build_kl_target(kl_target, target[valid].float(), expert_head, top_k=kl_top_k,
                                       chunk_size=kl_chunk_size, precision=kl_precision)
        head = prepare_head(merged_head, device, kl_precision)
    order = None
    cursor = 0
    history: List[float] = []
    for step in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        index = None
        if not full_batch:
            if order is None or cursor + batch_size > n:
                order, cursor = torch.randperm(n, generator=generator), 0
            index = order[cursor:cursor + batch_size]
            cursor += batch_size
        h = batch_slice(merged, index).float()
        corrected = surgery(h, batch_slice(position_ids, index))
        if scaled_kl:
            batch_valid = batch_slice(mask, index).bool()
            rows, states = batch_slice(row_of, index)[batch_valid], corrected[batch_valid]
            if kl_positions_per_step is not None and kl_positions_per_step < rows.numel():
                pick = torch.randperm(rows.numel(), generator=generator)[:kl_positions_per_step].to(device)
                rows, states = rows[pick], states[pick]
            value = kl_to_target(states, rows.to(device), target_cache, head,
                                 head_correction=surgery.head_correction if surgery.head_rank > 0 else None,
                                 chunk_size=kl_chunk_size)
        else:
            value = surgery_loss(
                loss, corrected, batch_slice(target, index), batch_slice(mask, index),
                entropy=batch_slice(entropy, index),
                expert_head=expert_head, merged_head=merged_head,
                head_correction=surgery.head_correction if surgery.head_rank > 0 else None,
                chunk_size=kl_chunk_size,
            )
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        history.append(float(value.detach()))
        if on_step is not None and on_step(step + 1, surgery):
            break
    surgery.eval()
    if history:
        LOG.info("%s: loss %.5f -> %.5f after %d steps", desc, history[0], history[-1], len(history))
    return history
