"""Automatic domain routing for the emitted model (docs/routing.md).

Imports torch only; copied with ``surgery.py`` into every output directory.
"""

from typing import Optional

import torch
from torch import nn

# --- automatic domain routing (docs/routing.md) ------------------------------------------------

# Version of the router description in config.json's darts entry ("router" key). Version 2 adds
# ``states``; a version-1 entry routes on the first adapted block's input when blocks are adapted.
ROUTER_VERSION = 2
READ_VERSIONS = (1, 2)
ROUTER_POOLING = "mean_l2"  # masked mean over the prompt tokens, then L2 normalisation
ROUTER_KINDS = ("centroid", "logistic")  # how weight/bias were trained (the math at inference is the same)
# which prompt states it reads: "final" = the final norm's output of the plain merged model (with
# ``depth`` a separate uncorrected pass over the prompt), "block_input" = the first adapted block's input
# in the corrected forward itself (no extra pass; with ``depth: all`` the token embeddings)
ROUTER_STATES = ("final", "block_input")
NO_ROUTE = -1  # route() value of a row that falls back to the plain merge ("none")
_ROUTER_KEYS = ("version", "domains", "threshold", "pooling", "kind")


def prompt_state_sums(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[sum_t m_t h_t, sum_t m_t]``: [B, T, H] states, [B, T] mask -> [B, H + 1] float32. Sums of
    several calls over parts of one prompt add up to the sums over the whole prompt (chunked prefill)."""
    h = hidden_states.float()
    if attention_mask is None:
        mask = torch.ones(h.shape[:2], dtype=torch.float32, device=h.device)
    else:
        if tuple(attention_mask.shape) != tuple(h.shape[:2]):
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} does not match "
                             f"hidden_states {tuple(h.shape[:2])}")
        mask = attention_mask.to(device=h.device, dtype=torch.float32)
    weighted = h * mask.unsqueeze(-1)  # where(): a NaN state at a padded position (fully masked query) stays out
    weighted = torch.where(mask.unsqueeze(-1) != 0, weighted, torch.zeros((), dtype=weighted.dtype, device=h.device))
    return torch.cat([weighted.sum(dim=1), mask.sum(dim=1, keepdim=True)], dim=-1)


def pooled_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """[B, H + 1] sums (``prompt_state_sums``) -> [B, H] unit vectors: the masked mean, L2-normalised.
    A row without a real token pools to zeros."""
    mean = sums[:, :-1] / sums[:, -1:].clamp_min(1.0)
    return nn.functional.normalize(mean, dim=-1)


def pool_prompt_states(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``normalize(sum_t m_t h_t / sum_t m_t)``: [B, T, H] states, [B, T] mask -> [B, H] float32 unit
    vectors. Padding (left or right) is excluded by the mask; an all-padding row pools to zeros."""
    return pooled_from_sums(prompt_state_sums(hidden_states, attention_mask))


class DomainRouter(nn.Module):
    """Picks a domain for each prompt from the merged model's own uncorrected hidden states.

    With ``h`` the states it reads [B, T, H] (``states``: "final", the plain merged model's final-norm
    output; "block_input", the first adapted block's input) and ``m`` the attention mask [B, T] (1 at
    real tokens):

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
                 pooling: str = ROUTER_POOLING, states: str = "final"):
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
        if states not in ROUTER_STATES:
            raise ValueError(f"router.states: unknown states {states!r}; choose one of {ROUTER_STATES}")
        self.hidden_size = hidden_size
        self.domains = domains
        self.threshold = float(threshold)
        self.kind = kind
        self.pooling = pooling
        self.states = states
        count = len(domains)
        # Parameters (not buffers) so they load, save and are offloaded like every other darts tensor.
        self.weight = nn.Parameter(torch.zeros(count, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(count), requires_grad=False)
        self.centroids = nn.Parameter(torch.zeros(count, hidden_size), requires_grad=False)
        self.similarity_mean = nn.Parameter(torch.zeros(count), requires_grad=False)
        self.similarity_std = nn.Parameter(torch.ones(count), requires_grad=False)

    def to_meta(self) -> dict:
        return {"version": ROUTER_VERSION, "domains": list(self.domains), "threshold": self.threshold,
                "pooling": self.pooling, "kind": self.kind, "states": self.states}

    @classmethod
    def from_meta(cls, meta: dict, hidden_size: int, blocks_adapted: bool = False) -> "DomainRouter":
        """Strict: every key present, known version; an unknown future version is an error.
        ``blocks_adapted``: the model has block adapters (``depth``), which a version-1 router read the
        first of."""
        if not isinstance(meta, dict):
            raise ValueError(f"config.darts.router: expected a mapping, got {type(meta).__name__}")
        version = meta.get("version")
        if isinstance(version, bool) or version not in READ_VERSIONS:
            raise ValueError(
                f"config.darts.router.version {version!r} is not supported by this mergekit-darts "
                f"(it reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade mergekit-darts"
            )
        missing = [key for key in _ROUTER_KEYS + (("states",) if version >= 2 else ()) if key not in meta]
        if missing:
            raise ValueError(f"config.darts.router: missing {', '.join(missing)}")
        states = meta["states"] if version >= 2 else ("block_input" if blocks_adapted else "final")
        return cls(hidden_size, meta["domains"], threshold=meta["threshold"], kind=meta["kind"],
                   pooling=meta["pooling"], states=states)

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

    def forward(self, hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                pooled: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Route [B, T, H] states (and their [B, T] mask), or already ``pooled`` [B, H] ones."""
        weight_device = self.weight.device
        if pooled is None:
            mask = attention_mask.to(weight_device) if attention_mask is not None else None
            pooled = self.pool(hidden_states.to(weight_device), mask)
        return self.route(pooled.to(weight_device))

    def extra_repr(self) -> str:
        return (f"domains={self.domains}, hidden_size={self.hidden_size}, kind={self.kind}, "
                f"threshold={self.threshold}, pooling={self.pooling}, states={self.states}")


def route_rows(router: DomainRouter, final_hidden: torch.Tensor,
               attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's domain index (-1 = "none") from the prompt's final hidden states at prefill.

    ``final_hidden`` [B, T, H] is the final norm's output over the prompt; ``attention_mask`` [B, T]
    marks its real tokens (left padding allowed); None means every token is real. Goes through the
    module's ``__call__`` so accelerate's offload hooks bring the parameters in. Returns a LongTensor
    [B] on ``final_hidden``'s device."""
    with torch.no_grad():
        return router(final_hidden, attention_mask).to(final_hidden.device)


ROUTER_KEY = "router"  # reserved entry of the model's ``darts`` dict: its tensors are darts.router.*


class DomainModules(nn.ModuleDict):
    """The emitted model's ``darts`` child: one ``DomainSurgery`` per domain and, under the reserved key
    ``"router"``, the ``DomainRouter`` (its tensors load, save and offload as ``darts.router.*``, float32
    like the domains). Iteration, ``len``, ``in`` and keys/values/items see the domains only; ``.router``
    is the router or None. Module traversal (state_dict, ``.to``, accelerate) sees both.
    ``first_adapted_layer``: the index of the first decoder layer with block adapters (``depth``), or None;
    ``adapted_linears``: (layer index, path in the layer) of every linear that carries an adapter."""

    def __init__(self, domains, router: Optional[DomainRouter] = None, first_adapted_layer: Optional[int] = None,
                 adapted_linears=()):
        super().__init__(domains)
        self.first_adapted_layer = first_adapted_layer
        self.adapted_linears = tuple(adapted_linears)
        if router is not None:  # not add_module: it refuses a name that is an attribute (the property)
            self._modules[ROUTER_KEY] = router

    def _domain_keys(self):
        return [key for key in self._modules if key != ROUTER_KEY]

    def __iter__(self):
        return iter(self._domain_keys())

    def __len__(self):
        return len(self._domain_keys())

    def __contains__(self, key):
        return key != ROUTER_KEY and key in self._modules

    def keys(self):
        return self._domain_keys()

    def values(self):
        return [self._modules[key] for key in self._domain_keys()]

    def items(self):
        return [(key, self._modules[key]) for key in self._domain_keys()]

    @property
    def router(self) -> Optional[DomainRouter]:
        return self._modules.get(ROUTER_KEY)
