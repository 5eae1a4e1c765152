"""What the report measures on held-out records: the representation bias per position (Figure 1 and
Table 3 of the DARTS paper, arXiv 2608.28547) and the KL to the expert before and after surgery."""

from typing import Any, Dict, List, Optional

import torch

from mergekit_darts.remote_code.blocks import BlockAdapter
from mergekit_darts.repair.train.kl import kl_loss
from mergekit_darts.repair.train.tail import final_states


def _bin_means(values: torch.Tensor, weights: torch.Tensor, bins: torch.Tensor, nbins: int) -> List[Optional[float]]:
    """Weighted mean of ``values`` per bin index; None (JSON null) for bins without weight."""
    sums = torch.zeros(nbins, dtype=torch.float64).index_add_(0, bins, values.double() * weights.double())
    norms = torch.zeros(nbins, dtype=torch.float64).index_add_(0, bins, weights.double())
    return [float(s / n) if n > 0 else None for s, n in zip(sums.tolist(), norms.tolist())]


def _mean(values: torch.Tensor, weights: torch.Tensor) -> Optional[float]:
    total = float(weights.double().sum())
    return float((values.double() * weights.double()).sum() / total) if total > 0 else None


def bin_edges(positions: int, bins: int) -> List[int]:
    """Integer bin edges over [0, positions): at most ``bins`` bins, none empty of positions."""
    bins = max(1, min(bins, positions))
    edges = sorted({int(round(i * positions / bins)) for i in range(bins + 1)})
    return edges


@torch.no_grad()
def bias_by_position(
    merged: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
    entropy: torch.Tensor, corrected: torch.Tensor, bins: int = 16, max_positions: Optional[int] = None,
) -> Dict[str, Any]:
    """Mean L1 (over H) between states and the expert's, per position bin, before/after surgery.

    merged / expert / corrected: [N, T, H]; mask, position_ids, entropy: [N, T]. "before" compares
    ``merged`` with ``expert``, "after" ``corrected`` with ``expert``; the ``*_weighted`` variants
    weight each token by the expert's entropy (what EWL1 optimises). Bins follow ``position_ids``
    (so left padding is handled) and are token-weighted: every valid token counts once. Positions
    run over [0, P) with P the largest observed position + 1, capped at ``max_positions``
    (tokens at or past the cap are left out; calibration is truncated there anyway).
    Empty bins are None. The returned dict is JSON-serialisable.
    """
    for name, tensor in (("expert", expert), ("corrected", corrected)):
        if tuple(tensor.shape) != tuple(merged.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match merged {tuple(merged.shape)}")
    for name, tensor in (("mask", mask), ("position_ids", position_ids), ("entropy", entropy)):
        if tuple(tensor.shape) != tuple(merged.shape[:2]):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match [N, T] = {tuple(merged.shape[:2])}")
    valid = mask.bool() & (position_ids >= 0)
    if max_positions is not None:
        valid &= position_ids < max_positions
    pos = position_ids[valid].long().cpu()
    if pos.numel() == 0:
        raise ValueError("mask: no valid (non-padding) positions to report on")
    positions = int(pos.max()) + 1
    edges = bin_edges(positions, bins)
    # bucketize with right=True maps position p to the bin whose [lo, hi) holds it
    bin_index = torch.bucketize(pos, torch.tensor(edges[1:-1]), right=True)
    nbins = len(edges) - 1

    target = expert.float()
    before = (merged.float() - target).abs().mean(dim=-1)[valid].cpu()
    after = (corrected.float() - target).abs().mean(dim=-1)[valid].cpu()
    ones = torch.ones_like(before)
    weight = entropy.float()[valid].cpu()
    return {
        "bin_edges": edges,
        "tokens": [int(c) for c in torch.bincount(bin_index, minlength=nbins).tolist()],
        "before": _bin_means(before, ones, bin_index, nbins),
        "after": _bin_means(after, ones, bin_index, nbins),
        "before_weighted": _bin_means(before, weight, bin_index, nbins),
        "after_weighted": _bin_means(after, weight, bin_index, nbins),
        "mean_before": _mean(before, ones),
        "mean_after": _mean(after, ones),
        "mean_before_weighted": _mean(before, weight),
        "mean_after_weighted": _mean(after, weight),
        "positions": positions,
    }


@torch.no_grad()
def held_out_kl(module, held, expert_head, merged_head, chunk_size) -> Dict[str, float]:
    """Mean KL(expert || merged) before and after the correction on held-out positions, and the
    share of that gap the correction closes (1 = the expert's distribution, 0 = the plain merge).
    ``held["merged"]``: the plain merge's final states; ``held["input"]`` (when given): what the module
    reads instead (with depth, the first adapted block's input)."""
    mask = held["mask"].bool()
    merged = held["merged"].float()
    inputs = held["input"].float() if "input" in held else merged
    target = held["target"].float()[mask]
    before = kl_loss(merged[mask], target, expert_head, merged_head, chunk_size=chunk_size)
    corrected = module(inputs, held["position_ids"])[mask]
    head = module.head_correction if module.head_rank > 0 else None
    after = kl_loss(corrected, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size)
    gap_closed = 1.0 - float(after) / float(before) if float(before) > 0 else None
    result = {"before": float(before), "after": float(after), "gap_closed": gap_closed}
    surgery = getattr(module, "surgery", module)  # with depth: the final-state module behind the tail
    states = None  # the uncorrected final states (a whole tail forward with depth): computed once
    if surgery.blocks is not None or module.head_rank > 0:
        # what `--drop-final-state-correction` exports (docs/serving.md): the block adapters and the head
        # correction without the final-state correction (no content term, no position table)
        states = final_states(module, inputs, held["position_ids"])
        result["after_without_final_state"] = float(
            kl_loss(states[mask], target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size))
    biased = [] if surgery.blocks is None else [
        adapter.up for adapter in surgery.blocks.modules() if isinstance(adapter, BlockAdapter) and adapter.up.bias is not None]
    if biased:
        # what `export-peft --drop-lora-bias` keeps (vLLM and llama.cpp take no LoRA bias): the adapters'
        # biases set to zero for this one forward, then put back
        kept = [linear.bias.detach().clone() for linear in biased]
        try:
            for linear in biased:
                linear.bias.zero_()
            unbiased = module(inputs, held["position_ids"])[mask]
        finally:
            for linear, bias in zip(biased, kept):
                linear.bias.copy_(bias)
        result["after_without_lora_bias"] = float(
            kl_loss(unbiased, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size))
    if module.position_bias is not None:
        # what `mergekit-darts bake --drop-position-bias` keeps: the correction without its table
        if states is None:
            states = final_states(module, inputs, held["position_ids"])
        unbiased = (states - module.content(states))[mask]
        result["after_without_position_bias"] = float(
            kl_loss(unbiased, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size))
    return result
