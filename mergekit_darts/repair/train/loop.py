"""The surgery training loop: cached tensors in, a trained DomainSurgery out (docs/design.md §3).

The models are frozen and their hidden states cached, so a step is a few small matmuls (plus two
vocabulary-sized ones per chunk for ``kl``): take the step's rows, correct them, the loss, one Adam
step. Full batch unless ``batch_size`` is given; ``micro_batch_size`` runs a step's rows a few at a
time and sums their gradients, weighted by their share of the step's loss, so a step is the same step
in less memory (docs/scale.md). ``train_surgery`` reads top to bottom; the helpers below it pick the
rows and hold the KL target at scale.
"""

import logging
from typing import Callable, List, Optional

import torch

from mergekit_darts.console import progress_bar
from mergekit_darts.repair.train.kl import build_kl_target, kl_to_target, prepare_head
from mergekit_darts.repair.train.losses import ENTROPY_WEIGHTED, LOSSES, DEFAULT_CHUNK, surgery_loss
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
    micro_batch_size: Optional[int] = None,
    expert_head: Optional[torch.Tensor] = None,
    merged_head: Optional[torch.Tensor] = None,
    kl_chunk_size: int = DEFAULT_CHUNK,
    kl_target: str = "exact",
    kl_top_k: int = 256,
    kl_precision: str = "float32",
    kl_positions_per_step: Optional[int] = None,
    progress: bool = False,
    lines: bool = False,
    desc: str = "surgery",
    weight_decay: float = 0.0,
    on_step: Optional[Callable[[int, DomainSurgery], bool]] = None,
) -> List[float]:
    """Train ``surgery`` in place with Adam(lr, betas 0.9/0.999; AdamW with ``weight_decay``); per-step losses.

    merged / target: [N, T, H] final hidden states of the merged model and of the expert (any float
    dtype; each batch is promoted to float32). mask: [N, T], true at real tokens. position_ids:
    [N, T]. entropy: [N, T] expert entropies (ewl1/ewmse). ``kl`` needs ``expert_head`` and
    ``merged_head`` ([V, H]). The module moves to ``merged.device``.
    ``micro_batch_size``: at most that many rows per forward and backward; the step's gradient is the
    sum of theirs, each weighted by its rows' share of the loss's weight (valid positions, or the
    entropy for ewl1/ewmse), so it equals the whole batch's up to float rounding.
    ``weight_decay > 0`` uses AdamW (decoupled decay on every parameter of the correction).
    ``on_step(steps_done, module)`` is called after each step; returning True stops training
    (early stopping, train/selection.py). ``progress``: a tqdm bar; ``lines``: a line every few seconds
    instead (stderr is a log file; console.ProgressLines).

    KL at scale (train/kl.py): ``kl_target`` "topk"/"bf16" computes the expert's distribution
    once; ``kl_precision="mixed"`` uses bfloat16 logit matmuls on CUDA; ``kl_positions_per_step`` draws
    that many valid positions of the batch per step (seeded by ``seed``). The defaults keep the exact
    float32 loss over every position.
    """
    _check_inputs(surgery, merged, target, mask, position_ids, entropy, loss)
    _check_settings(steps, lr, batch_size, weight_decay, kl_positions_per_step, micro_batch_size)
    device = merged.device
    surgery.to(device).train()
    adam = torch.optim.AdamW if weight_decay > 0 else torch.optim.Adam
    trained = [p for p in surgery.parameters() if p.requires_grad]  # train_blocks: frozen adapters stay the extract
    optimizer = adam(trained, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    # one generator for the batch order and the KL position draws, in that order at every step
    generator = torch.Generator(device="cpu").manual_seed(seed)
    batches = _Batches(merged.shape[0], batch_size, generator)
    head_correction = surgery.head_correction if surgery.head_rank > 0 else None
    scaled = None
    if loss == "kl" and (kl_target != "exact" or kl_precision != "float32" or kl_positions_per_step is not None):
        scaled = _ScaledKL(target, mask, expert_head, merged_head, device, kl_target, kl_top_k, kl_precision,
                           kl_positions_per_step, kl_chunk_size, generator)

    row_weight = (entropy.float() * mask if loss in ENTROPY_WEIGHTED else mask).float().sum(dim=1)

    def batch_loss(index: Optional[torch.Tensor]) -> torch.Tensor:
        corrected = surgery(_take(merged, index).float(), _take(position_ids, index))
        if scaled is not None:
            return scaled.loss(corrected, index, head_correction)
        return surgery_loss(loss, corrected, _take(target, index), _take(mask, index),
                            entropy=_take(entropy, index), expert_head=expert_head, merged_head=merged_head,
                            head_correction=head_correction, chunk_size=kl_chunk_size)

    history: List[float] = []
    bar = progress_bar(steps, desc, bars=progress, lines=lines, unit="steps")
    for step in range(steps):
        index = batches.next()  # None: the whole set
        optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for part, share in _micro_batches(index, merged.shape[0], micro_batch_size, row_weight):
            part_loss = batch_loss(part) if share is None else batch_loss(part) * share
            part_loss.backward()  # this part's activations are freed before the next part runs
            value += float(part_loss.detach())
        optimizer.step()
        history.append(value)
        bar.update(1)
        if on_step is not None and on_step(step + 1, surgery):
            break
    bar.close()
    surgery.eval()
    if history:
        LOG.info("%s: loss %.5f -> %.5f after %d steps", desc, history[0], history[-1], len(history))
    return history


def _check_settings(steps, lr, batch_size, weight_decay, kl_positions_per_step, micro_batch_size=None) -> None:
    if steps < 0:
        raise ValueError(f"steps: must be >= 0, got {steps}")
    if lr <= 0:
        raise ValueError(f"lr: must be positive, got {lr}")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"batch_size: must be positive, got {batch_size}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
    if kl_positions_per_step is not None and kl_positions_per_step <= 0:
        raise ValueError(f"kl_positions_per_step: must be positive, got {kl_positions_per_step}")
    if micro_batch_size is not None and micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size: must be positive, got {micro_batch_size}")
    if micro_batch_size is not None and kl_positions_per_step is not None:
        raise ValueError("micro_batch_size together with kl_positions_per_step: the positions are drawn from the "
                         "whole batch, not per micro-batch; remove one of them")


def _take(tensor: Optional[torch.Tensor], index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The batch's rows of ``tensor`` (all of it for a full batch)."""
    if tensor is None or index is None:
        return tensor
    return tensor[index.to(tensor.device)]


def _micro_batches(index: Optional[torch.Tensor], n: int, size: Optional[int], row_weight: torch.Tensor):
    """(rows, share of the step's loss) for each micro-batch of the step's rows ``index`` (None: all
    ``n``): one part with share None when no split is asked for or needed; parts whose rows carry no
    weight (padding only) are left out, as the whole batch's loss leaves those rows out."""
    rows = torch.arange(n) if index is None else index
    if size is None or size >= rows.numel():
        yield index, None
        return
    total = float(row_weight[rows.to(row_weight.device)].sum())
    if total <= 0:  # no weight at all: the whole batch's loss says what is wrong
        yield index, None
        return
    for part in rows.split(size):
        weight = float(row_weight[part.to(row_weight.device)].sum())
        if weight > 0:
            yield part, weight / total


class _Batches:
    """Row indices of each step: None (full batch), or ``batch_size`` rows of a seeded permutation, a
    new permutation whenever the current one has fewer rows left than a batch."""

    def __init__(self, n: int, batch_size: Optional[int], generator: torch.Generator):
        self.n, self.batch_size, self.generator = n, batch_size, generator
        self.full = batch_size is None or batch_size >= n
        self.order, self.cursor = None, 0

    def next(self) -> Optional[torch.Tensor]:
        if self.full:
            return None
        if self.order is None or self.cursor + self.batch_size > self.n:
            self.order, self.cursor = torch.randperm(self.n, generator=self.generator), 0
        index = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return index


class _ScaledKL:
    """``loss: kl`` at scale (train/kl.py): the expert's target built once for every valid position,
    optionally a seeded draw of positions per step."""

    def __init__(self, target, mask, expert_head, merged_head, device, kind, top_k, precision,
                 positions_per_step, chunk_size, generator):
        if expert_head is None or merged_head is None:
            raise ValueError("loss 'kl' needs expert_head and merged_head (the [V, H] LM head weights)")
        valid = mask.bool()
        # row_of[i, t]: the target row of valid position (i, t)
        self.row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        self.row_of[valid] = torch.arange(int(valid.sum()), device=mask.device)
        self.mask, self.positions_per_step, self.chunk_size, self.generator = mask, positions_per_step, chunk_size, generator
        self.target = build_kl_target(kind, target[valid].float(), expert_head, top_k=top_k,
                                      chunk_size=chunk_size, precision=precision)
        self.head = prepare_head(merged_head, device, precision)

    def loss(self, corrected: torch.Tensor, index: Optional[torch.Tensor], head_correction) -> torch.Tensor:
        batch_valid = _take(self.mask, index).bool()
        rows, states = _take(self.row_of, index)[batch_valid], corrected[batch_valid]
        if self.positions_per_step is not None and self.positions_per_step < rows.numel():
            pick = torch.randperm(rows.numel(), generator=self.generator)[:self.positions_per_step]
            rows, states = rows[pick.to(rows.device)], states[pick.to(states.device)]
        return kl_to_target(states, rows.to(corrected.device), self.target, self.head,
                            head_correction=head_correction, chunk_size=self.chunk_size)
