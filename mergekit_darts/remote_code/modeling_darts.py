"""Darts*ForCausalLM: a merged model plus per-domain representation surgery (docs/design.md §3, §5).

Copied with ``surgery.py``, ``blocks.py``, ``routing.py`` and ``hooks.py`` into every output directory
and loaded there by transformers' remote-code loader: these import torch, transformers, the standard
library's ``contextvars``/``dataclasses``/``functools``/``threading``/``typing`` and each other only, and
touch no files.

The corrected model is the plain ``<Arch>ForCausalLM`` with forward hooks (hooks.py): on the final norm
``h -> s(h, position_ids)`` for each row's domain's ``DomainSurgery`` ``s``; on the LM head (only when
``head_rank > 0``) ``logits += s.head_correction(h_hat)``; with ``depth: k``, on every linear of the
last ``k`` decoder blocks ``y += up(down(x))`` (blocks.py). The parent's ``forward`` (labels/loss,
``logits_to_keep``, KV cache, generate) is untouched; it is only wrapped to tell the hooks what the
current call needs (``_DartsCall``), in a ``ContextVar`` rather than on the instance.
"""

from typing import Sequence

import torch
from transformers import initialization as init
from transformers import (GemmaForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM,
                          Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
from transformers.utils import logging

from .blocks import BlockAdapter, block_linear_targets
from .hooks import (_ACTIVE_CALL, AUTO_INDEX, NONE_INDEX, _DartsCall, _darts_head_hook, _darts_norm_hook,
                    _darts_route_hook, _PendingRoute, install_block_hooks)
from .routing import DomainModules, DomainRouter, route_rows
from .surgery import DomainSurgery, SurgeryShape

logger = logging.get_logger(__name__)

NONE_DOMAIN = "none"
AUTO_DOMAIN = "auto"  # each row's domain is picked by the router from its prompt (docs/routing.md)
_ROUTED_ATTR = "_darts_routed_rows"  # on a KV cache object: its rows' routed domain indices (CPU [B])


def default_position_ids(seq_len, attention_mask=None, cache=None, device=None) -> torch.Tensor:
    """Position ids of the current tokens when the caller gave none, as ``generate`` derives them:
    from a 2-D attention mask (cumsum - 1, so left padding is skipped; padding gets 0), else
    ``arange`` after the cached length. The last ``seq_len`` columns are the current tokens."""
    if attention_mask is not None and attention_mask.dim() == 2:
        positions = attention_mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(attention_mask == 0, 0)
        return positions[:, -seq_len:]
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + seq_len, device=device).unsqueeze(0)


class DartsMixin:
    """Adds ``self.darts`` (one ``DomainSurgery`` per domain) and the hooks that apply the active one.

    ``config.darts`` holds the modules' shape (``SurgeryShape.to_meta``), the loss, ``domains``
    ({name: expert}) and the writing version; ``config.darts_domain`` names the default domain
    ("none" = plain merged model). A call may override it: ``model(..., darts_domain="code")`` or one
    name per batch row, ``generate(..., darts_domain=["math", "code", "none"])``.
    """

    # The correction's math is float32 (surgery.py): keep its parameters there when loading in bf16
    # (strict) or fp16, and out of quantization: transformers' quantizers (bitsandbytes 8/4-bit, ...)
    # add _keep_in_fp32_modules to the modules they do not convert, whatever llm_int8_skip_modules says.
    _keep_in_fp32_modules_strict = ["darts"]
    _keep_in_fp32_modules = ["darts"]
    # save_pretrained/push_to_hub copy this file and surgery.py and write auto_map, also when the class
    # was imported from the package rather than loaded as remote code
    _auto_class = "AutoModelForCausalLM"

    def post_init(self):
        # <Arch>ForCausalLM.__init__ ends with post_init(); building the modules here (model and
        # lm_head exist by now) lets transformers' own weight init and loading see them.
        if not hasattr(self, "darts"):
            self._build_darts()
        super().post_init()

    def _build_darts(self):
        meta = getattr(self.config, "darts", None) or {}
        domains = meta.get("domains") or {}
        shape = SurgeryShape.from_meta(meta) if domains else None
        # darts.router.* (when exported): picks each prompt's domain for "auto"
        router = DomainRouter.from_meta(meta["router"], self.config.hidden_size) if meta.get("router") else None
        targets = block_linear_targets(self.model.layers, shape.depth) if shape is not None and shape.depth else None
        self.darts = DomainModules({name: DomainSurgery.from_shape(shape, self.config.hidden_size,
                                                                   self.config.vocab_size, targets)
                                    for name in domains}, router)
        self._darts_depth = shape.depth if shape is not None else 0
        if self._darts_depth:  # "auto" rows are routed from the input of the first adapted block
            self.model.layers[len(self.model.layers) - self._darts_depth].register_forward_pre_hook(
                _darts_route_hook, with_kwargs=True)
        self.model.norm.register_forward_hook(_darts_norm_hook)
        self.lm_head.register_forward_hook(_darts_head_hook)
        self.set_darts_domain(getattr(self.config, "darts_domain", None) or NONE_DOMAIN)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # transformers reports missing keys only as a generic list; a Darts directory without its
        # darts.* tensors silently becomes the plain merged model, so say so in its own words.
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        model._warn_missing_darts(info.get("missing_keys") or ())
        return (model, info) if wants_info else model

    def _warn_missing_darts(self, missing_keys) -> None:
        if self.darts.router is not None and any(key.startswith("darts.router.") for key in missing_keys):
            logger.warning("darts: the checkpoint has no darts.router.* tensors: the router is dropped and "
                           "darts_domain='auto' is unavailable%s.", " (the default domain is now 'none')"
                           if self._darts_domain == AUTO_DOMAIN else "")
            del self.darts._modules["router"]
            if self._darts_domain == AUTO_DOMAIN:
                self.set_darts_domain(NONE_DOMAIN)
        missing = sorted({key.split(".")[1] for key in missing_keys if key.startswith("darts.")} & set(self.darts))
        if missing:
            logger.warning(
                "darts: the checkpoint has no darts.* tensors for domain(s) %s; their correction is the "
                "identity (these domains run the plain merged model). Re-export the directory with "
                "mergekit-darts, or check that darts.safetensors and its index entries were uploaded.",
                ", ".join(missing),
            )

    def _init_weights(self, module):
        # Called for parameters missing from the checkpoint. The generic init would draw up/position
        # bias from N(0, 0.02) (or leave garbage); the surgery must start as the identity instead.
        # transformers.initialization's functions skip tensors that were loaded.
        if isinstance(module, DomainSurgery):
            init.kaiming_uniform_(module.down.weight, a=5**0.5)
            init.zeros_(module.up.weight)
            if module.position_bias is not None:
                init.zeros_(module.position_bias)
            if module.head_down is not None:
                init.kaiming_uniform_(module.head_down.weight, a=5**0.5)
                init.zeros_(module.head_up.weight)
        elif isinstance(module, DomainRouter):  # routes nothing (similarity can never reach 2); dropped on load
            for param in (module.weight, module.bias, module.centroids):
                init.zeros_(param)
            init.constant_(module.similarity_mean, 2.0)
            init.ones_(module.similarity_std)
        elif isinstance(module, BlockAdapter):
            init.kaiming_uniform_(module.down.weight, a=5**0.5)
            init.zeros_(module.up.weight)
        elif not any(module is child for child in self.darts.modules()):
            super()._init_weights(module)

    @property
    def darts_domains(self):
        return list(self.darts.keys())

    @property
    def darts_domain(self) -> str:
        return self._darts_domain

    def _domain_index(self, name) -> int:
        name = NONE_DOMAIN if name is None else name
        if name == AUTO_DOMAIN:
            if self.darts.router is None:
                raise ValueError("darts_domain: 'auto' needs the domain router, but this model has none (no "
                                 "config.darts.router / darts.router.* tensors); re-export with `router: true` "
                                 f"or name a domain: {[*self.darts.keys(), NONE_DOMAIN]}")
            return AUTO_INDEX
        choices = [*self.darts.keys(), NONE_DOMAIN] + ([AUTO_DOMAIN] if self.darts.router is not None else [])
        if not isinstance(name, str) or (name != NONE_DOMAIN and name not in self.darts):
            raise ValueError(f"darts_domain: unknown domain {name!r}; choose one of {choices}")
        return NONE_INDEX if name == NONE_DOMAIN else self.darts_domains.index(name)

    def set_darts_domain(self, name: "str | None") -> None:
        """Set the default domain: ``name``'s correction; "none" (or None) runs the plain merged model;
        "auto" lets the router pick each row's domain from its prompt."""
        name = NONE_DOMAIN if name is None else str(name)
        self._domain_index(name)
        self._darts_domain = name
        self.config.darts_domain = name  # so save_pretrained keeps the choice

    def _darts_domain_rows(self, darts_domain, batch_size: int) -> torch.Tensor:
        """The one mapping from a call's ``darts_domain`` argument to per-row domain indices: a CPU
        LongTensor [batch_size], ``i`` = ``darts_domains[i]``, ``NONE_INDEX`` (-1) = "none".

        Accepts None (the model's default domain), one name (every row), a sequence of names (one
        per row) or such an index tensor (what ``generate`` carries between steps, expanded for
        beams). ``AUTO_INDEX`` (-2) marks a row for the router ("auto"): ``forward`` fills such rows of
        a tensor in place with the routed indices at the prefill, so later steps keep that domain."""
        if darts_domain is None or isinstance(darts_domain, str):
            return torch.full((batch_size,), self._domain_index(self._darts_domain if darts_domain is None else darts_domain), dtype=torch.long)
        if isinstance(darts_domain, torch.Tensor):
            rows = darts_domain.detach().to("cpu")
            if rows.dtype not in (torch.int64, torch.int32) or rows.dim() != 1:
                raise ValueError(f"darts_domain: an index tensor must be 1-D integer, got {rows.dtype} {tuple(rows.shape)}")
            lowest = NONE_INDEX if self.darts.router is None else AUTO_INDEX
            if rows.numel() and (rows.min() < lowest or rows.max() >= len(self.darts)):
                raise ValueError(f"darts_domain: domain indices must be in [{lowest}, {len(self.darts) - 1}]")
            rows = rows.long()
        elif isinstance(darts_domain, Sequence):
            rows = torch.tensor([self._domain_index(name) for name in darts_domain], dtype=torch.long)
        else:
            raise ValueError(
                f"darts_domain: expected a domain name, a list of names (one per batch row) or None, "
                f"got {type(darts_domain).__name__}"
            )
        if rows.shape[0] != batch_size:
            raise ValueError(f"darts_domain: {rows.shape[0]} domains given for a batch of {batch_size} rows")
        return rows

    def _darts_groups(self, rows: torch.Tensor):
        """((surgery, row indices or None for the whole batch), ...) for the domains present."""
        surgeries = list(self.darts.values())
        present = sorted(set(rows.tolist()) - {NONE_INDEX})
        if len(present) == 1 and bool((rows == present[0]).all()):
            return ((surgeries[present[0]], None),)
        return tuple((surgeries[i], torch.nonzero(rows == i).flatten()) for i in present)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, darts_domain=None,
                **kwargs):
        # Explicit position_ids / logits_to_keep: generate() inspects the signature for both.
        call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=logits_to_keep, **kwargs)
        embeds = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if embeds is None:  # let the parent raise its own error
            return super().forward(**call)
        rows = self._darts_domain_rows(darts_domain, embeds.shape[0])
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        rows, route = self._auto_rows(rows, cache, attention_mask, embeds.shape[1])
        groups = () if route is not None else self._darts_groups(rows)
        if route is None and not groups:
            return super().forward(**call)
        if position_ids is None:
            # the position the surgery was trained on: the token's index within its sequence
            position_ids = default_position_ids(embeds.shape[1], attention_mask, cache, embeds.device)
        layers = None
        if self._darts_depth:
            install_block_hooks(self.model.layers, next(iter(self.darts.values())))
            layers = self.model.layers
        token = _ACTIVE_CALL.set(_DartsCall(self.model.norm, self.lm_head, groups, position_ids, route, layers))
        try:
            outputs = super().forward(**call)
        finally:
            _ACTIVE_CALL.reset(token)
        if route is not None and route.routed is not None:
            if isinstance(darts_domain, torch.Tensor):  # generate's per-row tensor: later steps reuse the routing
                pending = darts_domain == AUTO_INDEX
                darts_domain[pending] = route.routed.to(darts_domain.device, darts_domain.dtype)[pending]
            if getattr(outputs, "cache", None) is not None:  # a manual loop passes this cache back
                setattr(outputs.cache, _ROUTED_ATTR, route.routed)
        return outputs

    def _auto_rows(self, rows, cache, attention_mask, seq_len):
        """(rows, route): "auto" rows are routed once per sequence, at its first call (the prefill);
        a continuation (non-empty cache) takes the rows routed then. An empty cache is a new
        sequence even if it carries an earlier routing (generate may reuse a static cache)."""
        if not bool((rows == AUTO_INDEX).any()):
            return rows, None
        earlier = getattr(cache, _ROUTED_ATTR, None)
        if earlier is not None and earlier.shape == rows.shape and cache.get_seq_length() > 0:
            return torch.where(rows == AUTO_INDEX, earlier, rows), None
        mask = attention_mask[:, -seq_len:] if attention_mask is not None and attention_mask.dim() == 2 else None
        to_domain = torch.tensor([self.darts_domains.index(name) for name in self.darts.router.domains])
        return rows, _PendingRoute(self.darts.router, rows, mask, to_domain, self._darts_groups)

    def generate(self, *args, darts_domain=None, **kwargs):
        # names become a per-row index tensor so generate expands it with the batch (beams,
        # num_return_sequences) and hands it to every step's forward; "auto" rows (-2) are filled in
        # place with the routed domain at the prefill step, so the whole generation keeps that domain
        wanted = self._darts_domain if darts_domain is None else darts_domain
        if isinstance(wanted, torch.Tensor):
            darts_domain = wanted.detach().to("cpu", torch.long, copy=True)  # never write into the caller's tensor
        elif not isinstance(wanted, str):
            darts_domain = self._darts_domain_rows(wanted, len(wanted))
        elif wanted == AUTO_DOMAIN:
            inputs = args[0] if args else next((kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds")
                                                if kwargs.get(k) is not None), None)
            darts_domain = self._darts_domain_rows(wanted, inputs.shape[0] if inputs is not None else 1)
        if darts_domain is not None:
            kwargs["darts_domain"] = darts_domain
        return super().generate(*args, **kwargs)

    @torch.no_grad()
    def route_domains(self, input_ids, attention_mask=None) -> "list[str]":
        """The domain the router picks for each row of ``input_ids`` [B, T] ("none" below its
        threshold), exactly as ``darts_domain="auto"`` would at prefill. Changes nothing."""
        self._domain_index(AUTO_DOMAIN)  # a clear error when there is no router
        positions = default_position_ids(input_ids.shape[1], attention_mask, None, input_ids.device)
        seen = {}
        handle = None
        if self._darts_depth:  # what the router reads: the first adapted block's input
            first = self.model.layers[len(self.model.layers) - self._darts_depth]
            handle = first.register_forward_pre_hook(
                lambda module, args, kwargs: seen.update(hidden=args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True)
        try:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                use_cache=False).last_hidden_state  # final-norm output; no call active: uncorrected
        finally:
            if handle is not None:
                handle.remove()
        hidden = seen.get("hidden", hidden)
        router = self.darts.router
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        return [router.domains[i] if i >= 0 else NONE_DOMAIN for i in route_rows(router, hidden, mask).tolist()]

    def set_output_embeddings(self, new_embeddings):
        # resize_token_embeddings swaps the LM head: the head correction must follow it
        super().set_output_embeddings(new_embeddings)
        if _darts_head_hook not in new_embeddings._forward_hooks.values():
            new_embeddings.register_forward_hook(_darts_head_hook)


# Every architecture below keeps its final norm at ``self.model.norm`` and its LM head at ``self.lm_head``
# and calls them as ``lm_head(slice(norm(h)))``, which is all the mixin relies on.
class DartsLlamaForCausalLM(DartsMixin, LlamaForCausalLM): pass
class DartsMistralForCausalLM(DartsMixin, MistralForCausalLM): pass
class DartsMixtralForCausalLM(DartsMixin, MixtralForCausalLM): pass
class DartsQwen2ForCausalLM(DartsMixin, Qwen2ForCausalLM): pass
class DartsQwen3ForCausalLM(DartsMixin, Qwen3ForCausalLM): pass
class DartsGemmaForCausalLM(DartsMixin, GemmaForCausalLM): pass
class DartsPhi3ForCausalLM(DartsMixin, Phi3ForCausalLM): pass


# plain architecture name (config.architectures[0] written by mergekit) -> Darts class: every class above
DARTS_CLASSES = {cls.__name__[len("Darts"):]: cls for cls in DartsMixin.__subclasses__()}
