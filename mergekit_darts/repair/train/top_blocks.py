"""``train_blocks: k``: every adapted block starts from the data-free extract, only the last ``k`` train
(docs/quality.md, "Training only the top blocks").

The blocks below the trained ones keep their extract, so what they compute never changes during
training: their output — the input of the first trained block — is computed once per record, with the
extract's adapters on (``first_trained_inputs``), and every step runs only the ``k`` trained blocks from
it, the final norm and the corrections (``k = 0``: only the final norm). The lower adapters are frozen
(``requires_grad`` off: no gradient, so the optimizer never moves them) and exported as they are.
"""

from typing import Any, Dict, Optional

import torch

from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.repair.train.tail import adapters_on


def trained_blocks(surgery, tail) -> Optional[int]:
    """``k``, the adapted blocks that train, when fewer than all of them; None when every one trains
    (``train_blocks`` unset or ``all``, or no block adapters)."""
    k = surgery.train_blocks
    if tail is None or k is None or k == "all":
        return None
    adapted = len(tail.layers)
    if k > adapted:  # the checks before the merge refuse it where they know the layer count
        raise SurgeryConfigError(f"surgery.train_blocks: {k} exceeds the {adapted} adapted decoder block(s) "
                                 f"(depth: {surgery.depth}); use at most {adapted}")
    return None if k == adapted else k


def split_tail(tail, k: int):
    """(the frozen blocks below, the last ``k`` blocks with the final norm): views of ``tail``."""
    lower = len(tail.layers) - k
    return tail.view(0, lower), tail.view(lower, len(tail.layers))


def freeze_below(module, first_trained: int):
    """Freeze the block adapters of the layers below ``first_trained`` (they keep their start); returns ``module``."""
    for index, _, adapter in module.block_adapters():
        if index < first_trained:
            adapter.requires_grad_(False)
    return module


@torch.no_grad()
def first_trained_inputs(lower, module, inputs: torch.Tensor, position_ids: torch.Tensor, batch_size: int,
                         device) -> torch.Tensor:
    """The input of the first trained block for every row (float32, on the cpu): ``inputs`` (the first
    adapted block's input) run through the ``lower`` blocks with ``module``'s adapters on, ``batch_size``
    rows at a time, once — as the corrected model computes it, and as every training step did before."""
    out = torch.empty(inputs.shape, dtype=torch.float32)
    with adapters_on(lower, module):
        for start in range(0, inputs.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            out[rows] = lower.blocks(inputs[rows].to(device), position_ids[rows].to(device)).cpu()
    return out


def blocks_entry(tail, k: int, module) -> Dict[str, Any]:
    """The report's ``blocks``: which adapted layers trained, which keep the extract (untrained), and how
    many parameters trained (the exported module's ``parameters`` counts both kinds)."""
    layers = list(range(tail.first, tail.first + len(tail.layers)))
    first = layers[-1] + 1 - k
    return {"trained": [i for i in layers if i >= first], "extract": [i for i in layers if i < first],
            "also_trained": ["final-state correction"] + (["head correction"] if module.head_rank > 0 else []),
            "trained_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad)}
