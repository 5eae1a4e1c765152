"""Corrections inside the merged model's last decoder blocks (``depth: k``, docs/quality.md).

Imports torch only and is copied with ``surgery.py`` into every output directory. A domain with
``depth = k`` carries one low-rank adapter per ``nn.Linear`` of the last ``k`` decoder blocks: the
linear's output ``y = W x`` becomes ``y + up(down(x))`` (a LoRA with scaling 1), ``up`` starting at
zero so an untrained adapter changes nothing. The adapters are stored under the domain's module as
``blocks.<layer index>.<path of the linear in its block>.{down,up}.weight``, i.e. the tensor of the
adapter on ``model.layers.3.self_attn.q_proj`` of domain ``math`` is
``darts.math.blocks.3.self_attn.q_proj.down.weight``. The adapter on a linear that has a bias (Qwen2's
q/k/v) has one too, ``up.bias`` (PEFT's ``lora_B.bias``), zero at the start: ``y + up(down(x)) + b``.
A directory written before adapters had biases has no ``up.bias`` tensors; they then load as zero
(``modeling_darts.py``), which computes what that directory always did.
"""

from typing import Callable, Dict, Iterator, Tuple

import torch
from torch import nn

# {layer index: {path of a linear inside the block: (in_features, out_features, has a bias)}}; a
# two-tuple (in_features, out_features) is read as a linear without a bias
BlockTargets = Dict[int, Dict[str, Tuple]]


def float32_linear(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    """``layer(inputs)`` in float32. The layer is *called* (not its ``.weight`` read) so hooks that load
    offloaded weights (accelerate cpu/disk offload) run; a layer cast away from float32 (e.g.
    ``model.half()``) is upcast on the fly."""
    if layer.weight.dtype == torch.float32:
        return layer(inputs)
    bias = layer.bias
    return nn.functional.linear(inputs, layer.weight.float(), None if bias is None else bias.float())


class BlockAdapter(nn.Module):
    """``delta(x) = up(down(x))`` in float32, added to one linear's output; ``up`` starts at zero.
    ``bias``: ``up`` has a bias (the adapted linear has one), also zero at the start."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)
        nn.init.zeros_(self.up.weight)
        if bias:
            nn.init.zeros_(self.up.bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=inputs.device.type, enabled=False):
            return float32_linear(self.up, float32_linear(self.down, inputs.float()))


def is_moe_router(path: str, has_experts: Callable[[str], bool]) -> bool:
    """Whether the linear at ``path`` (in a block) is a MoE router: a ``gate``/``router`` whose parent (its
    path, "" for the block) has ``experts`` (``has_experts(parent)``). Adapting it would change which experts
    run. ``preflight_weights`` asks the same of tensor names."""
    parent, _, leaf = path.rpartition(".")
    return leaf in ("gate", "router") and has_experts(parent)


def _is_moe_router(block: nn.Module, path: str) -> bool:
    return is_moe_router(path, lambda parent: hasattr(block.get_submodule(parent) if parent else block, "experts"))


def block_linear_targets(layers: nn.ModuleList, depth: int) -> BlockTargets:
    """Every ``nn.Linear`` (quantized subclasses included) of the last ``depth`` decoder layers, but a
    MoE router, as ``(in_features, out_features, has a bias)``."""
    if not isinstance(depth, int) or not 0 < depth <= len(layers):
        raise ValueError(f"depth: must be between 1 and the model's {len(layers)} decoder layers, got {depth!r}")
    targets: BlockTargets = {}
    for index in range(len(layers) - depth, len(layers)):
        linears = {path: (module.in_features, module.out_features, module.bias is not None)
                   for path, module in layers[index].named_modules()
                   if isinstance(module, nn.Linear) and not _is_moe_router(layers[index], path)}
        if not linears:
            raise ValueError(f"depth: decoder layer {index} has no nn.Linear to adapt")
        targets[index] = linears
    return targets


def build_block_adapters(targets: BlockTargets, rank: int) -> nn.ModuleDict:
    """Nested ModuleDicts mirroring the blocks' module paths, an adapter at each linear (with a bias
    where the linear has one)."""
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"depth_rank: must be a positive integer, got {rank!r}")
    blocks = nn.ModuleDict()
    for index, linears in targets.items():
        block = blocks[str(index)] = nn.ModuleDict()
        for path, (in_features, out_features, *bias) in linears.items():
            *parents, leaf = path.split(".")
            node = block
            for part in parents:
                if part not in node:
                    node[part] = nn.ModuleDict()
                node = node[part]
            node[leaf] = BlockAdapter(in_features, out_features, rank, bias=bool(bias and bias[0]))
    return blocks


def block_adapters(blocks: nn.ModuleDict) -> Iterator[Tuple[int, str, BlockAdapter]]:
    """(layer index, path in the block, adapter) for every adapter of ``blocks``."""
    for index, block in blocks.items():
        for path, module in block.named_modules():
            if isinstance(module, BlockAdapter):
                yield int(index), path, module


def first_adapted_layer(blocks: nn.ModuleDict) -> int:
    return min(int(index) for index in blocks.keys())
