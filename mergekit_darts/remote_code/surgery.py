"""Representation-surgery correction modules (docs/design.md §3).

This file imports torch only: it is copied next to ``modeling_darts.py`` into every output
directory, so the package and the published model share exactly one implementation of the math,
and one description of a module's shape (``SurgeryShape``) that the pipeline builds, the export
writes into ``config.json`` and the emitted model reads back.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

METHODS = ("darts", "standard")
CONTENT_KINDS = ("relu", "linear")
# Version of the shape description in config.json. 1: written by mergekit-darts 0.1.x (no
# "format_version" key; ReLU content only). 2: adds "format_version" and "content".
FORMAT_VERSION = 2
_SHAPE_KEYS = ("method", "rank", "head_rank", "max_positions", "content")


@dataclass(frozen=True)
class SurgeryShape:
    """What every domain module of one output shares: enough to rebuild it before loading weights."""

    method: str
    rank: int
    head_rank: int
    max_positions: int
    content: str
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
        if type(self.head_rank) is not int or self.head_rank < 0:
            raise ValueError(f"head_rank: must be an integer >= 0, got {self.head_rank!r}")

    def to_meta(self) -> dict:
        return {"format_version": FORMAT_VERSION, **{key: getattr(self, key) for key in _SHAPE_KEYS}}

    @classmethod
    def from_meta(cls, meta: dict) -> "SurgeryShape":
        """Strict: every key must be present (no silent defaults); unknown versions are errors."""
        if not isinstance(meta, dict):
            raise ValueError(f"config.darts: expected a mapping, got {type(meta).__name__}")
        version = meta.get("format_version", 1)
        if version == 1:  # mergekit-darts 0.1.x: ReLU content was the only kind
            meta = {**meta, "content": "relu"}
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
    def from_shape(cls, shape: SurgeryShape, hidden_size: int, vocab_size: Optional[int]) -> "DomainSurgery":
        return cls(hidden_size=hidden_size, rank=shape.rank, max_positions=shape.max_positions,
                   method=shape.method, head_rank=shape.head_rank, vocab_size=vocab_size, content=shape.content)

    @property
    def shape(self) -> SurgeryShape:
        return SurgeryShape(method=self.method, rank=self.rank, head_rank=self.head_rank,
                            max_positions=self.max_positions, content=self.content_kind)

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

    @staticmethod
    def _linear32(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
        """``layer(inputs)`` in float32. The layer is *called* (not its ``.weight`` read) so hooks that
        load offloaded weights (accelerate cpu/disk offload) run; a layer cast away from float32 (e.g.
        ``model.half()``) is upcast on the fly."""
        if layer.weight.dtype == torch.float32:
            return layer(inputs)
        return nn.functional.linear(inputs, layer.weight.float())

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
        )


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- automatic domain routing (docs/routing.md) ------------------------------------------------

# Version of the router description in config.json's darts entry ("router" key).
ROUTER_VERSION = 1
ROUTER_POOLING = "mean_l2"  # masked mean over the prompt tokens, then L2 normalisation
ROUTER_KINDS = ("centroid", "logistic")  # how weight/bias were trained (the math at inference is the same)
NO_ROUTE = -1  # route() value of a row that falls back to the plain merge ("none")
_ROUTER_KEYS = ("version", "domains", "threshold", "pooling", "kind")


def pool_prompt_states(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``normalize(sum_t m_t h_t / sum_t m_t)``: [B, T, H] states, [B, T] mask -> [B, H] float32 unit
    vectors. Padding (left or right) is excluded by the mask; an all-padding row pools to zeros."""
    h = hidden_states.float()
    if attention_mask is None:
        mask = torch.ones(h.shape[:2], dtype=torch.float32, device=h.device)
    else:
        if tuple(attention_mask.shape) != tuple(h.shape[:2]):
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} does not match "
                             f"hidden_states {tuple(h.shape[:2])}")
        mask = attention_mask.to(device=h.device, dtype=torch.float32)
    mean = (h * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    return nn.functional.normalize(mean, dim=-1)


class DomainRouter(nn.Module):
    """Picks a domain for each prompt from the merged model's own final hidden states.

    With ``h`` the final-norm output [B, T, H] and ``m`` the attention mask [B, T] (1 at real tokens):

    1. pool:   ``p = normalize(sum_t m_t h_t / sum_t m_t)`` (float32; L2 norm; padding, left or
       right, is excluded by the mask, so where it sits does not matter);
    2. class:  ``k = argmax_d (p @ weight.T + bias)_d``  (weight [D, H], bias [D]);
    3. gate:   ``s = p . centroids[k]`` (cosine similarity to the domain's unit centroid),
       ``z = (s - similarity_mean[k]) / similarity_std[k]`` (mean and std of that similarity over the
       domain's own training prompts) and ``confidence = 1 / (1 + min(z, 0)^2)``: Cantelli's
       one-sided bound on the share of the domain's prompts that are at least this far below the
       domain's mean similarity, whatever their distribution (1 for a typical or closer prompt);
    4. route:  ``k`` if ``confidence >= threshold`` else ``-1`` ("none": the plain merged model).

    ``kind`` records how weight/bias were trained: ``"centroid"`` (weight = centroids, bias = 0:
    nearest centroid by cosine) or ``"logistic"`` (multinomial logistic regression on standardised
    pooled states, the standardisation folded into weight/bias). Under accelerate offloading the
    parameters are only materialised inside ``forward``: call the module (``router(h, mask)``),
    not ``route``/``scores`` directly.
    """

    def __init__(self, hidden_size: int, domains, threshold: float = 0.02, kind: str = "centroid",
                 pooling: str = ROUTER_POOLING):
        super().__init__()
        domains = list(domains)
        if not domains or len(set(domains)) != len(domains):
            raise ValueError(f"domains: need at least one domain and unique names, got {domains}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size: must be a positive integer, got {hidden_size!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"router.threshold: must be a number in [0, 1], got {threshold!r}")
        if kind not in ROUTER_KINDS:
            raise ValueError(f"router.kind: unknown router kind {kind!r}; choose one of {ROUTER_KINDS}")
        if pooling != ROUTER_POOLING:
            raise ValueError(f"router.pooling: unknown pooling {pooling!r}; this version reads {ROUTER_POOLING!r}")
        self.hidden_size = hidden_size
        self.domains = domains
        self.threshold = float(threshold)
        self.kind = kind
        self.pooling = pooling
        count = len(domains)
        # Parameters (not buffers) so they load, save and are offloaded like every other darts tensor.
        self.weight = nn.Parameter(torch.zeros(count, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(count), requires_grad=False)
        self.centroids = nn.Parameter(torch.zeros(count, hidden_size), requires_grad=False)
        self.similarity_mean = nn.Parameter(torch.zeros(count), requires_grad=False)
        self.similarity_std = nn.Parameter(torch.ones(count), requires_grad=False)

    # -- description in config.json ---------------------------------------------------------------

    def to_meta(self) -> dict:
        return {"version": ROUTER_VERSION, "domains": list(self.domains), "threshold": self.threshold,
                "pooling": self.pooling, "kind": self.kind}

    @classmethod
    def from_meta(cls, meta: dict, hidden_size: int) -> "DomainRouter":
        """Strict: every key present, known version; an unknown future version is an error."""
        if not isinstance(meta, dict):
            raise ValueError(f"config.darts.router: expected a mapping, got {type(meta).__name__}")
        version = meta.get("version")
        if version != ROUTER_VERSION:
            raise ValueError(
                f"config.darts.router.version {version!r} is not supported by this mergekit-darts "
                f"(it reads version {ROUTER_VERSION}); upgrade mergekit-darts"
            )
        missing = [key for key in _ROUTER_KEYS if key not in meta]
        if missing:
            raise ValueError(f"config.darts.router: missing {', '.join(missing)}")
        return cls(hidden_size, meta["domains"], threshold=meta["threshold"], kind=meta["kind"],
                   pooling=meta["pooling"])

    # -- the math ---------------------------------------------------------------------------------

    def pool(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B, T, H] states, [B, T] mask (None: every token) -> [B, H] unit vectors, float32."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got {tuple(hidden_states.shape)}")
        return pool_prompt_states(hidden_states, attention_mask)

    def scores(self, pooled: torch.Tensor):
        """(domain index [B] long, confidence [B] float32 in [0, 1]) before the threshold."""
        p = pooled.float().to(self.weight.device)
        logits = p @ self.weight.float().t() + self.bias.float()
        chosen = logits.argmax(dim=-1)
        similarity = (p * self.centroids.float()[chosen]).sum(dim=-1)
        spread = self.similarity_std.float()[chosen].clamp_min(1e-6)
        standard = (similarity - self.similarity_mean.float()[chosen]) / spread
        # Cantelli's one-sided bound P(Z <= -k) <= 1 / (1 + k^2): holds for any distribution of the
        # domain's similarities, so heavy tails of real prompts do not make in-domain rows look foreign
        below = standard.clamp(max=0.0)
        confidence = 1.0 / (1.0 + below * below)
        return chosen, confidence

    def route(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] pooled states -> [B] domain indices, -1 (NO_ROUTE) below the threshold."""
        chosen, confidence = self.scores(pooled)
        return torch.where(confidence >= self.threshold, chosen, torch.full_like(chosen, NO_ROUTE))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight_device = self.weight.device
        mask = attention_mask.to(weight_device) if attention_mask is not None else None
        return self.route(self.pool(hidden_states.to(weight_device), mask))

    def extra_repr(self) -> str:
        return (f"domains={self.domains}, hidden_size={self.hidden_size}, kind={self.kind}, "
                f"threshold={self.threshold}, pooling={self.pooling}")


def route_rows(router: DomainRouter, final_hidden: torch.Tensor,
               attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's domain index (-1 = "none") from the prompt's final hidden states at prefill.

    ``final_hidden`` [B, T, H] is the final norm's output over the prompt; ``attention_mask`` [B, T]
    marks its real tokens (left padding allowed); None means every token is real. Goes through the
    module's ``__call__`` so accelerate's offload hooks bring the parameters in. Returns a LongTensor
    [B] on ``final_hidden``'s device."""
    with torch.no_grad():
        return router(final_hidden, attention_mask).to(final_hidden.device)
