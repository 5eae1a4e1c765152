"""``depth: k``: the input of the merged model's first adapted block, and its frozen last blocks
(docs/quality.md, "Depth: adapters inside the last decoder blocks").

The capture keeps, per domain, the input of the first adapted block ([N, T, H], taken in the same
forward as the merged final states, ``capture/domains.py``) and one frozen float32 copy of the last k
blocks, the final norm and the rotary embedding (``FrozenTail``). The tail is built from its tensors
on an empty (meta) skeleton of the model, so a cached tail needs no model load, and tensors that
accelerate offloaded to cpu or disk are read like any other. Training (``train/tail.py``) runs only
those k blocks with a domain's adapters, never the whole model.

On a GPU the blocks run under bfloat16 autocast (``tail_compute_dtype``): their matmuls are the bulk of
a ``depth: all`` step (docs/scale.md), and bfloat16 is what the capture's own forward used there. The
weights stay float32, the adapters add their float32 output (``train/tail.py``), and the residual
stream, the norms, the loss and the optimizer stay float32. On a CPU nothing changes: float32 throughout.
"""

import contextlib
import copy
import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.remote_code.blocks import block_linear_targets
from mergekit_darts.repair.capture.placement import read_weight

LOG = logging.getLogger(__name__)

# Replaying the cached block input through the copied blocks must give the captured final states:
# mean |difference| over mean |state|, above which the blocks need arguments we do not pass. The
# tail runs in float32; a model captured in bfloat16/float16 differs from it by its own rounding.
REPLAY_TOLERANCE = {torch.float32: 1e-2}
REPLAY_TOLERANCE_LOW_PRECISION = 5e-2


def _cuda_bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def tail_compute_dtype(device, bf16_supported: Callable[[], bool] = _cuda_bf16_supported) -> Optional[torch.dtype]:
    """The autocast dtype of the frozen blocks on ``device``: bfloat16 on a CUDA device that has it,
    None (plain float32, no autocast) anywhere else — so a CPU run computes what it always did."""
    if torch.device(device).type == "cuda" and bf16_supported():
        return torch.bfloat16
    return None


def _tail_parts(model, depth: int) -> List[Tuple[str, nn.Module]]:
    """(name in the tail, module of ``model``) of what the tail copies."""
    layers = model.model.layers
    first = len(layers) - depth
    return ([(f"layers.{i - first}", layers[i]) for i in range(first, len(layers))]
            + [("norm", model.model.norm), ("rotary", model.model.rotary_emb)])


def read_tail_tensors(model, depth: int) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of the last ``depth`` blocks, the final norm and the rotary embedding,
    as float32 cpu copies named as in ``FrozenTail`` (offloaded ones read through accelerate)."""
    tensors = {}
    for prefix, part in _tail_parts(model, depth):
        for path, module in part.named_modules():
            names = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
            for name in names:
                full = ".".join(x for x in (prefix, path, name) if x)
                tensors[full] = read_weight(module, name).to("cpu", torch.float32, copy=True)
    return tensors


def empty_model(config, trust_remote_code: bool = False):
    """The model's module tree with its weights on the meta device (buffers real): no load, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


class FrozenTail(nn.Module):
    """The merged model's last ``depth`` decoder blocks, final norm and rotary embedding (float32,
    frozen), run from a block input of right-padded rows with ``arange`` positions. Build it with
    ``from_model`` (a loaded model) or ``from_tensors`` (its cached tensors and the model's config)."""

    def __init__(self, skeleton, depth: int):
        super().__init__()
        layers = skeleton.model.layers
        self.targets = block_linear_targets(layers, depth)
        self.first = len(layers) - depth
        self.layers = copy.deepcopy(layers[self.first:])
        self.norm = copy.deepcopy(skeleton.model.norm)
        self.rotary = copy.deepcopy(skeleton.model.rotary_emb)
        config = skeleton.config
        uses_window = getattr(config, "use_sliding_window", True) is not False
        self.sliding_window = getattr(config, "sliding_window", None) if uses_window else None
        # None: float32; bfloat16: the blocks' matmuls under autocast (set by cached_tail on a GPU)
        self.compute_dtype: Optional[torch.dtype] = None

    @classmethod
    def from_tensors(cls, skeleton, depth: int, tensors: Dict[str, torch.Tensor]) -> "FrozenTail":
        """``skeleton``: ``empty_model`` of the merged model; ``tensors``: ``read_tail_tensors`` of it."""
        tail = cls(skeleton, depth)
        expected = tail.tensor_shapes()
        if set(tensors) != set(expected):
            raise ValueError(f"tail tensors: expected {sorted(expected)}, got {sorted(tensors)}")
        for name, tensor in tensors.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = tail.get_submodule(owner_path)
            if leaf in owner._parameters:
                owner._parameters[leaf] = nn.Parameter(tensor.float(), requires_grad=False)
            else:
                owner._buffers[leaf] = tensor.float()
        return tail.requires_grad_(False).eval()

    @classmethod
    def from_model(cls, model, depth: int) -> "FrozenTail":
        from accelerate import init_empty_weights

        with init_empty_weights():
            skeleton = type(model)(model.config)
        return cls.from_tensors(skeleton, depth, read_tail_tensors(model, depth))

    def coverage(self) -> Dict[str, List[str]]:
        """Which weights of the adapted blocks carry an adapter (paths inside a block) and which do
        not: every weight matrix outside an adapted ``nn.Linear``, e.g. fused MoE experts (Mixtral's
        ``mlp.experts.gate_up_proj`` under transformers 5) and the MoE router, left as they are so the
        expert routing does not change."""
        adapted = sorted({path for linears in self.targets.values() for path in linears})
        missing = set()
        for layer in self.layers:
            for name, parameter in layer.named_parameters():
                owner = name.rpartition(".")[0]
                if parameter.dim() >= 2 and owner not in adapted:
                    missing.add(name)
        return {"adapted": adapted, "not_adapted": sorted(missing)}

    def tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """{name: shape} of every parameter and buffer (what ``from_tensors`` needs)."""
        return {name: tuple(t.shape) for name, t in [*self.named_parameters(), *self.named_buffers()]}

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

    def autocast(self, device) -> contextlib.AbstractContextManager:
        """The blocks' autocast region: ``compute_dtype`` on ``device``'s type, or nothing (float32)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute_dtype)

    def view(self, start: int, stop: int) -> "FrozenTail":
        """Blocks ``[start, stop)`` of this tail (counted inside it) with its final norm and rotary
        embedding: the same modules and tensors, not copies. ``train_blocks`` (train/top_blocks.py) runs
        the blocks below the trained ones once through one view and trains through the other."""
        part = copy.copy(self)
        part._modules = dict(self._modules)  # its own registry, so that replacing ``layers`` leaves this tail's
        part.layers = self.layers[start:stop]  # a new ModuleList of the same blocks
        part.first = self.first + start
        part.targets = {index: linears for index, linears in self.targets.items()
                        if part.first <= index < part.first + len(part.layers)}
        return part

    def blocks(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream after the blocks (float32), before the final norm."""
        hidden = hidden.float()
        if not len(self.layers):  # a view without blocks (train_blocks: 0): the final norm only
            return hidden
        mask = self.attention_mask(hidden.shape[1], hidden.device)
        position_ids = position_ids.to(hidden.device)
        embeddings = self.rotary(hidden, position_ids)
        with self.autocast(hidden.device):
            for layer in self.layers:
                out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings,
                            use_cache=False)
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden.float()

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(hidden, position_ids))  # the final norm in float32: what the correction reads


def cached_tail(slot, ctx, depth: int) -> FrozenTail:
    """The frozen tail of ``slot``'s model (on ``ctx.device``): from the cache when it holds it (no
    load: the tail is rebuilt on an empty skeleton), else read from the model through its placement."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(slot.model_dir, trust_remote_code=ctx.trust_remote_code)
    skeleton = empty_model(config, ctx.trust_remote_code)
    shapes = FrozenTail(skeleton, depth).tensor_shapes()
    key = ctx.key("tail", slot.model_dir, layer=len(skeleton.model.layers) - depth)
    entry = ctx.cache.load("merged.tail", key, {name: (shape, torch.float32) for name, shape in shapes.items()})
    if entry is None:
        entry = read_tail_tensors(slot.get(), depth)
        ctx.cache.save("merged.tail", key, entry)
    tail = FrozenTail.from_tensors(skeleton, depth, entry).to(ctx.device)
    tail.compute_dtype = tail_compute_dtype(ctx.device)
    if tail.compute_dtype is not None:
        LOG.info("depth: the %d frozen block(s) run under %s autocast on %s (adapters, loss and optimizer float32)",
                 depth, str(tail.compute_dtype).replace("torch.", ""), ctx.device)
    return tail


def check_depth(depth: int, layers: int) -> None:
    if depth > layers:
        raise SurgeryConfigError(f"surgery.depth: {depth} exceeds the merged model's {layers} decoder "
                                 f"layers; use at most {layers}")


@torch.no_grad()
def check_replay(name: str, tail: FrozenTail, data, batch_size: int, dtype: torch.dtype) -> None:
    """The tail run from ``data.block_inputs`` must reproduce ``data.merged_hidden`` (the merged final
    states captured in the same forward); else this architecture's blocks need arguments we do not pass."""
    # a float32 capture replayed under bfloat16 autocast differs by the autocast's rounding
    tolerance = REPLAY_TOLERANCE.get(dtype if tail.compute_dtype is None else tail.compute_dtype,
                                     REPLAY_TOLERANCE_LOW_PRECISION)
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
