"""Representation-surgery correction modules (docs/design.md §3).

This file imports torch only: it is copied next to ``modeling_darts.py`` into every output
directory, so the package and the published model share exactly one implementation of the math,
and one description of a module's shape (``SurgeryShape``): ``from_config`` reads it from the
``surgery:`` block, the export writes ``to_meta()`` into ``config.json``, the emitted model reads it
back with ``from_meta``.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .blocks import BlockTargets, block_adapters, build_block_adapters, float32_linear

METHODS = ("darts", "standard")
CONTENT_KINDS = ("relu", "linear")
# Version of the shape description in config.json. 1: written by mergekit-darts 0.1.x (no
# "format_version" key; ReLU content only). 2: adds "format_version" and "content". 3: adds
# "depth" and "depth_rank" (adapters inside the last decoder blocks, blocks.py).
FORMAT_VERSION = 3
_SHAPE_KEYS = ("method", "rank", "head_rank", "max_positions", "content", "depth", "depth_rank")


@dataclass(frozen=True)
class SurgeryShape:
    """What every domain module of one output shares: enough to rebuild it before loading weights."""

    method: str
    rank: int
    head_rank: int
    max_positions: int
    content: str
    depth: int = 0  # decoder blocks (the last ones) whose linears carry an adapter
    depth_rank: int = 0  # rank of those adapters (0 when depth is 0)
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: unknown surgery method {self.method!r}; choose one of {METHODS}")
        if self.content not in CONTENT_KINDS:
            raise ValueError(f"content: unknown content correction {self.content!r}; choose one of {CONTENT_KINDS}")
        for name in ("rank", "max_positions"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("head_rank", "depth", "depth_rank"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if (self.depth > 0) != (self.depth_rank > 0):
            raise ValueError(f"depth_rank: must be > 0 exactly when depth > 0 (depth {self.depth}, "
                             f"depth_rank {self.depth_rank})")

    @classmethod
    def from_config(cls, surgery) -> "SurgeryShape":
        """The shape a ``surgery:`` block describes (read by attribute: this file imports no package
        code). ``depth_rank`` only counts with ``depth > 0``."""
        depth = surgery.depth
        return cls(method=surgery.method, rank=surgery.rank, head_rank=surgery.head_rank,
                   max_positions=surgery.max_positions, content=surgery.content, depth=depth,
                   depth_rank=surgery.depth_rank if depth else 0)

    def to_meta(self) -> dict:
        return {"format_version": FORMAT_VERSION, **{key: getattr(self, key) for key in _SHAPE_KEYS}}

    @classmethod
    def from_meta(cls, meta: dict) -> "SurgeryShape":
        """Strict: every key must be present (no silent defaults); unknown versions are errors."""
        if not isinstance(meta, dict):
            raise ValueError(f"config.darts: expected a mapping, got {type(meta).__name__}")
        version = meta.get("format_version", 1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(
                f"config.darts.format_version: must be an integer, got {version!r} ({type(version).__name__}); "
                "config.json was edited or written by another tool: restore the number mergekit-darts wrote")
        if version == 1:  # mergekit-darts 0.1.x: ReLU content was the only kind
            meta = {**meta, "content": "relu"}
        if version in (1, 2):  # before depth existed: the final state only
            meta = {**meta, "depth": 0, "depth_rank": 0}
        elif version != FORMAT_VERSION:
            raise ValueError(
                f"config.darts.format_version {version!r} is not supported by this mergekit-darts "
                f"(it reads versions 1 to {FORMAT_VERSION}); upgrade mergekit-darts"
            )
        missing = [key for key in _SHAPE_KEYS if key not in meta]
        if missing:
            raise ValueError(f"config.darts: missing {', '.join(missing)}; the directory was not written by mergekit-darts")
        return cls(**{key: meta[key] for key in _SHAPE_KEYS}, format_version=version)


class DomainSurgery(nn.Module):
    """One domain's correction: ``h_hat = h - up(relu(down(h))) - position_bias[pos]``.

    ``content="linear"`` drops the ReLU (``h - up(down(h))``): the correction is then a matrix that
    can be folded into the LM head (``mergekit-darts bake``).

    ``method="standard"`` is Yang et al. (2024): content correction only. ``method="darts"`` adds a
    free per-position bias table of ``max_positions`` rows; positions at or beyond ``max_positions``
    get no position correction. With ``head_rank > 0`` the module also carries a logit-space
    correction ``head_up(head_down(h_hat))`` that the caller adds to the LM head's logits.

    ``up``, ``position_bias`` and ``head_up`` start at zero, so an untrained module is the identity.
    The math runs in float32 whatever the input dtype; the output has the input's dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        rank: int = 16,
        max_positions: int = 512,
        method: str = "darts",
        head_rank: int = 0,
        vocab_size: Optional[int] = None,
        content: str = "relu",
    ):
        super().__init__()
        if content not in CONTENT_KINDS:
            raise ValueError(f"content: unknown content correction {content!r}; choose one of {CONTENT_KINDS}")
        if method not in METHODS:
            raise ValueError(f"method: unknown surgery method {method!r}; choose one of {METHODS}")
        for name, value in (("hidden_size", hidden_size), ("rank", rank), ("max_positions", max_positions)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(head_rank, int) or head_rank < 0:
            raise ValueError(f"head_rank: must be an integer >= 0, got {head_rank!r}")
        if head_rank > 0 and (not isinstance(vocab_size, int) or vocab_size <= 0):
            raise ValueError("vocab_size: a positive vocabulary size is required when head_rank > 0")
        self.hidden_size = hidden_size
        self.rank = rank
        self.max_positions = max_positions
        self.method = method
        self.head_rank = head_rank
        self.vocab_size = vocab_size
        self.content_kind = content
        self.blocks: Optional[nn.ModuleDict] = None  # adapters inside decoder blocks (attach_blocks)
        self.depth_rank = 0

        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        if method == "darts":
            self.position_bias = nn.Parameter(torch.zeros(max_positions, hidden_size))
        else:
            self.register_parameter("position_bias", None)
        if head_rank > 0:
            self.head_down = nn.Linear(hidden_size, head_rank, bias=False)
            self.head_up = nn.Linear(head_rank, vocab_size, bias=False)
        else:
            self.head_down = None
            self.head_up = None
        self.reset_parameters()

    @classmethod
    def from_shape(cls, shape: SurgeryShape, hidden_size: int, vocab_size: Optional[int],
                   block_targets: Optional[BlockTargets] = None) -> "DomainSurgery":
        """``block_targets`` (blocks.block_linear_targets of the model): required when ``shape.depth > 0``."""
        module = cls(hidden_size=hidden_size, rank=shape.rank, max_positions=shape.max_positions,
                     method=shape.method, head_rank=shape.head_rank, vocab_size=vocab_size, content=shape.content)
        if shape.depth:
            if block_targets is None or len(block_targets) != shape.depth:
                raise ValueError(f"depth: the shape adapts {shape.depth} decoder block(s); pass the linears of "
                                 "that many blocks (block_linear_targets)")
            module.attach_blocks(block_targets, shape.depth_rank)
        return module

    def attach_blocks(self, targets: BlockTargets, rank: int) -> None:
        """Add an identity-initialised adapter of rank ``rank`` to every linear in ``targets``."""
        self.blocks = build_block_adapters(targets, rank)
        self.depth_rank = rank

    @property
    def depth(self) -> int:
        return 0 if self.blocks is None else len(self.blocks)

    def block_adapters(self):
        """(layer index, path in the block, BlockAdapter) of every adapter; nothing when depth is 0."""
        return () if self.blocks is None else tuple(block_adapters(self.blocks))

    @property
    def shape(self) -> SurgeryShape:
        return SurgeryShape(method=self.method, rank=self.rank, head_rank=self.head_rank,
                            max_positions=self.max_positions, content=self.content_kind, depth=self.depth,
                            depth_rank=self.depth_rank)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # down keeps nn.Linear's default (kaiming_uniform, a=sqrt(5)); everything that is added
        # to the merged model's computation starts at zero so the untrained module is the identity.
        self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        if self.position_bias is not None:
            self.position_bias.zero_()
        if self.head_down is not None:
            self.head_down.reset_parameters()
            nn.init.zeros_(self.head_up.weight)

    @staticmethod
    def _float32_math(tensor: torch.Tensor):
        """Autocast off on the tensor's device: the correction computes in float32 even inside
        ``torch.autocast`` (which would otherwise run its linears in bfloat16/float16)."""
        return torch.autocast(device_type=tensor.device.type, enabled=False)

    _linear32 = staticmethod(float32_linear)

    def content(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """c(h) = up(ReLU(down(h))) (or up(down(h)) for linear content) in float32: the part subtracted."""
        with self._float32_math(hidden_states):
            inner = self._linear32(self.down, hidden_states.float())
            if self.content_kind == "relu":
                inner = torch.relu(inner)
            return self._linear32(self.up, inner)

    def position_correction(self, position_ids: torch.Tensor) -> torch.Tensor:
        """b[pos] in float32, zero for positions outside [0, max_positions).

        Reads ``position_bias`` directly: call it from ``forward`` only, where offloading hooks
        (accelerate) have loaded the module's own parameters."""
        bias = self.position_bias.float()
        valid = (position_ids >= 0) & (position_ids < self.max_positions)
        rows = bias[position_ids.clamp(0, self.max_positions - 1).long()]
        return rows * valid.unsqueeze(-1).to(rows.dtype)

    def forward(self, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected [..., {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        with self._float32_math(hidden_states):
            h = hidden_states.float()
            corrected = h - self.content(h)
            if self.position_bias is not None:
                if position_ids is None:
                    raise ValueError("position_ids: required for method 'darts'")
                if tuple(position_ids.shape) != tuple(hidden_states.shape[:-1]):
                    raise ValueError(
                        f"position_ids: shape {tuple(position_ids.shape)} does not match hidden_states "
                        f"{tuple(hidden_states.shape[:-1])}"
                    )
                corrected = corrected - self.position_correction(position_ids.to(h.device))
        return corrected.to(hidden_states.dtype)

    def head_correction(self, corrected_hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logit-space correction U(V h_hat) in float32, or None when head_rank == 0.

        The result is the only logits-sized tensor made here (the rank-r intermediate is small)."""
        if self.head_down is None:
            return None
        with self._float32_math(corrected_hidden):
            return self._linear32(self.head_up, self._linear32(self.head_down, corrected_hidden.float()))

    def extra_repr(self) -> str:
        return (
            f"method={self.method}, hidden_size={self.hidden_size}, rank={self.rank}, "
            f"max_positions={self.max_positions}, head_rank={self.head_rank}, content={self.content_kind}"
            + (f", depth={self.depth}, depth_rank={self.depth_rank}" if self.blocks is not None else "")
        )


def check_darts_tensors(darts: nn.Module, source: str, mismatched_keys=()) -> None:
    """A clear error naming the tensor and ``source`` when a loaded darts tensor is not what the config
    describes: another shape (transformers' ``mismatched_keys``: (name, checkpoint shape, model shape))
    or values that are NaN or infinite (which would make every corrected logit NaN). Tensors still on
    ``meta`` (offloaded) are read through accelerate's offload map when it has one."""
    for key, *shapes in mismatched_keys:
        if key.startswith("darts."):
            found, expected = (tuple(shape) for shape in shapes) if len(shapes) == 2 else ("?", "?")
            raise ValueError(f"{key} in {source}: shape {found} in the file, but config.darts describes {expected}; "
                             "the tensors and config.json come from different exports: export the surgery again")
    for name, tensor in darts.state_dict(keep_vars=True).items():
        if tensor.device.type == "meta":
            tensor = _offloaded(darts, name)
            if tensor is None:
                continue
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"darts.{name} in {source}: {bad} of {tensor.numel()} values are NaN or infinite, so "
                             "every corrected logit would be NaN; the file is damaged: export the surgery again")


def damaged_file_error(error: BaseException, directory: str) -> Optional[ValueError]:
    """safetensors' ``SafetensorError`` (a truncated or otherwise damaged weight file) names no file: the
    one-line error that does, or None for any other error. The file is the one transformers was opening
    (its ``file`` variable in the traceback; this module reads no file), else the directory's."""
    if type(error).__name__ != "SafetensorError":
        return None
    name = None
    trace = error.__traceback__
    while trace is not None:
        candidate = trace.tb_frame.f_locals.get("file")
        if isinstance(candidate, str) and candidate.endswith(".safetensors"):
            name = candidate
        trace = trace.tb_next
    where = name if name is not None else f"a weight file (*.safetensors) in {directory}"
    return ValueError(f"{where}: damaged or truncated safetensors file ({error}); copy it again, or export the "
                      "surgery again with mergekit-darts")


def _offloaded(root: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The value of an accelerate-offloaded tensor ``name`` of ``root`` (None if it cannot be found)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = root.get_submodule(".".join(parts[:cut])) if cut else root
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is not None:
            try:
                return weights[".".join(parts[cut:])]
            except KeyError:
                return None
    return None


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
