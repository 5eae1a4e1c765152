"""``depth: k``: the cached input of the merged model's first adapted block, and its frozen last blocks
(docs/quality.md, "Deeper correction").

The capture keeps, per domain, the input of the first adapted block ([N, T, H]) and one frozen float32
copy of the last k blocks, the final norm and the rotary embedding (``FrozenTail``). Training
(``train/tail.py``) runs only those k blocks with a domain's adapters, never the whole model.
"""

import copy
import logging
from typing import Dict, Optional

import torch
from torch import nn

from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.remote_code.blocks import block_linear_targets

LOG = logging.getLogger(__name__)

# Replaying the cached block input through the copied blocks must give the captured final states:
# mean |difference| over mean |state|, above which the blocks need arguments we do not pass. The
# tail runs in float32; a model captured in bfloat16/float16 differs from it by its own rounding.
REPLAY_TOLERANCE = {torch.float32: 1e-2}
REPLAY_TOLERANCE_LOW_PRECISION = 5e-2


class FrozenTail(nn.Module):
    """The merged model's last ``depth`` decoder blocks, final norm and rotary embedding (float32,
    frozen), run from a block input of right-padded rows with ``arange`` positions."""

    def __init__(self, model, depth: int):
        super().__init__()
        layers = model.model.layers
        self.targets = block_linear_targets(layers, depth)
        self.first = len(layers) - depth
        self.layers = copy.deepcopy(layers[self.first:]).float()
        self.norm = copy.deepcopy(model.model.norm).float()
        self.rotary = copy.deepcopy(model.model.rotary_emb).float()
        config = model.config
        uses_window = getattr(config, "use_sliding_window", True) is not False
        self.sliding_window = getattr(config, "sliding_window", None) if uses_window else None
        self.requires_grad_(False).eval()

    def attention_mask(self, length: int, device) -> torch.Tensor:
        """Additive causal mask [1, 1, T, T] (with the sliding window where the config has one).
        Padding needs no mask: rows are right padded, so a real token never attends to padding."""
        query = torch.arange(length, device=device).unsqueeze(1)
        key = torch.arange(length, device=device).unsqueeze(0)
        allowed = key <= query
        if self.sliding_window:
            allowed &= key > query - self.sliding_window
        mask = torch.zeros(length, length, device=device)
        return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        mask = self.attention_mask(hidden.shape[1], hidden.device)
        position_ids = position_ids.to(hidden.device)
        embeddings = self.rotary(hidden, position_ids)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings,
                        use_cache=False)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.norm(hidden)


def check_depth(depth: int, layers: int) -> None:
    if depth > layers:
        raise SurgeryConfigError(f"surgery.depth: {depth} exceeds the merged model's {layers} decoder "
                                 f"layers; use at most {layers}")


@torch.no_grad()
def capture_block_inputs(ctx, domains: Dict[str, object], depth: int, check_replay: bool = True) -> FrozenTail:
    """Set ``block_inputs`` ([N, T, H] float32, zero at padding) on each captured domain of ``domains``
    and return the frozen tail (float32, on ``ctx.device``). Loads the merged model once through the
    run's ``CaptureContext`` ``ctx``. ``check_replay``: the tail run from the block inputs must reproduce
    the captured final states."""
    slot = ctx.slot(ctx.merged_dir)
    device = ctx.device
    try:
        model = slot.get()
        check_depth(depth, len(model.model.layers))
        tail = FrozenTail(model, depth).to(device)
        first = model.model.layers[tail.first]
        for name, data in domains.items():
            data.block_inputs = _block_inputs(model, first, data, ctx.batch_size, device)
            if check_replay:
                tolerance = REPLAY_TOLERANCE.get(ctx.dtype, REPLAY_TOLERANCE_LOW_PRECISION)
                _check_replay(name, tail, data, ctx.batch_size, tolerance)
        del model
    finally:
        slot.free()
    LOG.info("depth %d: block inputs captured for %d domain(s)", depth, len(domains))
    return tail


def _block_inputs(model, first: nn.Module, data, batch_size: int, device) -> torch.Tensor:
    seen = []
    handle = first.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    parts = []
    try:
        for start in range(0, data.input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            seen.clear()
            model.model(input_ids=data.input_ids[rows].to(device), attention_mask=data.attention_mask[rows].long().to(device),
                        position_ids=data.position_ids[rows].to(device), use_cache=False)
            parts.append(seen[-1].float().cpu() * data.attention_mask[rows].unsqueeze(-1))
    finally:
        handle.remove()
    return torch.cat(parts)


def _check_replay(name: str, tail: FrozenTail, data, batch_size: int, tolerance: float) -> None:
    mask = data.attention_mask.bool()
    worst: Optional[float] = None
    for start in range(0, mask.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        device = tail.norm.weight.device
        replayed = tail(data.block_inputs[rows].to(device), data.position_ids[rows]).cpu()
        valid = mask[rows]
        captured = data.merged_hidden[rows].float()[valid]
        error = float((replayed[valid] - captured).abs().mean() / captured.abs().mean().clamp_min(1e-12))
        worst = error if worst is None else max(worst, error)
    if worst is not None and worst > tolerance:
        raise SurgeryConfigError(
            f"surgery.depth: running the last {len(tail.layers)} decoder block(s) from their cached input does "
            f"not reproduce the merged model's final states for domain {name!r} (relative error {worst:.3g}); "
            "this architecture's blocks need arguments mergekit-darts does not pass. Use depth: 0."
        )
