"""Darts*ForCausalLM: a merged model plus per-domain representation surgery (docs/design.md §3, §5).

This file is copied with ``surgery.py`` into every output directory and loaded there by transformers'
remote-code loader, so it imports torch, transformers, stdlib ``contextvars``/``dataclasses``/``typing``
and ``.surgery`` only, and touches no files.

The corrected model is the plain ``<Arch>ForCausalLM`` with two forward hooks:

* on the final norm: ``h -> s(h, position_ids)`` for each row's domain's ``DomainSurgery`` ``s``;
* on the LM head (only when ``head_rank > 0``): ``logits += s.head_correction(h_hat)``.

Hooks keep the parent's ``forward`` (labels/loss, ``logits_to_keep``, KV cache, generate) untouched;
``forward`` is only wrapped to tell the hooks what the current call needs (``_DartsCall``). That state
lives in a ``ContextVar``, never on the instance: concurrent threads each see their own call, and a
replica (``nn.DataParallel``) passes its own modules. The hooks are plain functions, so copies of the
hook tables (replicate, deepcopy) stay correct.
"""

import contextvars
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn
from transformers import initialization as init
from transformers import (
    GemmaForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.utils import logging

from .surgery import DomainSurgery, SurgeryShape

logger = logging.get_logger(__name__)

NONE_DOMAIN = "none"
NONE_INDEX = -1  # the per-row domain index of "none" (plain merged model); domains are 0..n-1


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


@dataclass(frozen=True)
class _DartsCall:
    """What the hooks need during one forward of one model object (original or replica)."""

    norm: nn.Module  # the final norm / LM head of the model whose forward runs: the hooks act only on these
    head: nn.Module
    groups: Tuple[Tuple[DomainSurgery, Optional[torch.Tensor]], ...]  # (surgery, its batch rows or None = all)
    position_ids: torch.Tensor


# Per thread (and per asyncio task): the forward in progress, if any.
_ACTIVE_CALL: "contextvars.ContextVar[Optional[_DartsCall]]" = contextvars.ContextVar("darts_call", default=None)


def _device_for(layer: nn.Linear, fallback: torch.device) -> torch.device:
    """Where to send a surgery's inputs: its weights' device, or (weights offloaded to ``meta`` by
    accelerate, whose hook moves inputs itself) where they already are."""
    device = layer.weight.device
    return fallback if device.type == "meta" else device


def _darts_norm_hook(module, args, output):
    call = _ACTIVE_CALL.get()
    if call is None or module is not call.norm:  # e.g. model.model(...) called directly: no correction
        return output
    positions = call.position_ids.to(output.device).expand(output.shape[:-1])

    def corrected(surgery, hidden, pos):
        device = _device_for(surgery.down, hidden.device)
        return surgery(hidden.to(device), pos.to(device)).to(hidden.device)

    if call.groups[0][1] is None:  # one domain for the whole batch
        return corrected(call.groups[0][0], output, positions)
    result = output.clone()  # hidden-sized; rows of "none" keep the merged model's state
    for surgery, rows in call.groups:
        rows = rows.to(output.device)
        result.index_copy_(0, rows, corrected(surgery, output.index_select(0, rows), positions.index_select(0, rows)))
    return result


# Tokens per head-correction chunk: the float32 correction is made and added chunk by chunk, so its
# memory is ~HEAD_CHUNK_TOKENS x vocab floats (32 MB at a 32k vocabulary) whatever the batch and length.
HEAD_CHUNK_TOKENS = 256


def _darts_head_hook(module, args, output):
    call = _ACTIVE_CALL.get()
    if call is None or module is not call.head or call.groups[0][0].head_rank == 0:
        return output
    if not output.is_contiguous():  # the in-place sums below work on a flat view
        output = output.contiguous()
    vocab = output.shape[-1]
    hidden = args[0].reshape(-1, args[0].shape[-1])  # [tokens, H]: the corrected h_hat fed to the head
    logits = output.view(-1, vocab)
    per_row = logits.shape[0] // output.shape[0]
    if output.dtype == torch.float32:  # one float32 chunk, never more than the logits themselves
        chunk = min(HEAD_CHUNK_TOKENS, logits.shape[0])
    else:  # the float32 chunk and the float32 copy the mixed-dtype add makes: together <= the logits
        chunk = max(1, min(HEAD_CHUNK_TOKENS // 2, logits.shape[0] * output.element_size() // 8))
    for surgery, rows in call.groups:
        if surgery.head_up.weight.shape[0] != vocab:
            raise ValueError(
                f"darts: a head correction was trained for a vocabulary of {surgery.head_up.weight.shape[0]} "
                f"tokens but the LM head now has {vocab} (resized embeddings?); use darts_domain='none' or "
                "retrain the surgery"
            )
        device = _device_for(surgery.head_down, hidden.device)
        spans = [(0, logits.shape[0])] if rows is None else [(r * per_row, (r + 1) * per_row) for r in rows.tolist()]
        for start, stop in spans:
            for begin in range(start, stop, chunk):
                end = min(begin + chunk, stop)
                correction = surgery.head_correction(hidden[begin:end].to(device)).to(output.device)
                _add_in_place(logits[begin:end], correction)
                del correction  # before the next chunk is made: one chunk alive at a time
    return output


def _add_in_place(logits: torch.Tensor, correction: torch.Tensor) -> None:
    """logits += correction with the sum in float32 and no new logits-sized tensor: float32 logits
    take it directly; lower-precision logits get (correction + logits) rounded once into place."""
    if logits.dtype == torch.float32:
        logits.add_(correction)
    else:
        logits.copy_(correction.add_(logits))


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
        self.darts = nn.ModuleDict(
            {name: DomainSurgery.from_shape(shape, self.config.hidden_size, self.config.vocab_size) for name in domains}
        )
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
        elif not any(module is child for surgery in self.darts.values() for child in surgery.children()):
            super()._init_weights(module)

    @property
    def darts_domains(self):
        return list(self.darts.keys())

    @property
    def darts_domain(self) -> str:
        return self._darts_domain

    def _domain_index(self, name) -> int:
        name = NONE_DOMAIN if name is None else name
        if not isinstance(name, str) or (name != NONE_DOMAIN and name not in self.darts):
            raise ValueError(
                f"darts_domain: unknown domain {name!r}; choose one of {[*self.darts.keys(), NONE_DOMAIN]}"
            )
        return NONE_INDEX if name == NONE_DOMAIN else self.darts_domains.index(name)

    def set_darts_domain(self, name: "str | None") -> None:
        """Set the default domain: ``name``'s correction; "none" (or None) runs the plain merged model."""
        name = NONE_DOMAIN if name is None else str(name)
        self._domain_index(name)
        self._darts_domain = name
        self.config.darts_domain = name  # so save_pretrained keeps the choice

    def _darts_domain_rows(self, darts_domain, batch_size: int) -> torch.Tensor:
        """The one mapping from a call's ``darts_domain`` argument to per-row domain indices: a CPU
        LongTensor [batch_size], ``i`` = ``darts_domains[i]``, ``NONE_INDEX`` (-1) = "none".

        Accepts None (the model's default domain), one name (every row), a sequence of names (one
        per row) or such an index tensor (what ``generate`` carries between steps, expanded for
        beams). A future domain choice per row (e.g. a router at prefill) returns its indices here."""
        if darts_domain is None or isinstance(darts_domain, str):
            return torch.full((batch_size,), self._domain_index(self._darts_domain if darts_domain is None else darts_domain), dtype=torch.long)
        if isinstance(darts_domain, torch.Tensor):
            rows = darts_domain.detach().to("cpu")
            if rows.dtype not in (torch.int64, torch.int32) or rows.dim() != 1:
                raise ValueError(f"darts_domain: an index tensor must be 1-D integer, got {rows.dtype} {tuple(rows.shape)}")
            if rows.numel() and (rows.min() < NONE_INDEX or rows.max() >= len(self.darts)):
                raise ValueError(f"darts_domain: domain indices must be in [-1, {len(self.darts) - 1}]")
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
        groups = self._darts_groups(self._darts_domain_rows(darts_domain, embeds.shape[0]))
        if not groups:
            return super().forward(**call)
        if position_ids is None:
            # the position the surgery was trained on: the token's index within its sequence
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            position_ids = default_position_ids(embeds.shape[1], attention_mask, cache, embeds.device)
        token = _ACTIVE_CALL.set(_DartsCall(self.model.norm, self.lm_head, groups, position_ids))
        try:
            return super().forward(**call)
        finally:
            _ACTIVE_CALL.reset(token)

    def generate(self, *args, darts_domain=None, **kwargs):
        # names become a per-row index tensor so generate expands it with the batch (beams,
        # num_return_sequences) and hands it to every step's forward
        if darts_domain is not None and not isinstance(darts_domain, (str, torch.Tensor)):
            darts_domain = self._darts_domain_rows(darts_domain, len(darts_domain))
        if darts_domain is not None:
            kwargs["darts_domain"] = darts_domain
        return super().generate(*args, **kwargs)

    def set_output_embeddings(self, new_embeddings):
        # resize_token_embeddings swaps the LM head: the head correction must follow it
        super().set_output_embeddings(new_embeddings)
        if _darts_head_hook not in new_embeddings._forward_hooks.values():
            new_embeddings.register_forward_hook(_darts_head_hook)


# Every architecture below keeps its final norm at ``self.model.norm`` and its LM head at ``self.lm_head``
# and calls them as ``lm_head(slice(norm(h)))``, which is all the mixin relies on.
class DartsLlamaForCausalLM(DartsMixin, LlamaForCausalLM):
    pass


class DartsMistralForCausalLM(DartsMixin, MistralForCausalLM):
    pass


class DartsMixtralForCausalLM(DartsMixin, MixtralForCausalLM):
    pass


class DartsQwen2ForCausalLM(DartsMixin, Qwen2ForCausalLM):
    pass


class DartsQwen3ForCausalLM(DartsMixin, Qwen3ForCausalLM):
    pass


class DartsGemmaForCausalLM(DartsMixin, GemmaForCausalLM):
    pass


class DartsPhi3ForCausalLM(DartsMixin, Phi3ForCausalLM):
    pass


# plain architecture name (config.architectures[0] written by mergekit) -> Darts class
DARTS_CLASSES = {
    cls.__name__[len("Darts"):]: cls
    for cls in (
        DartsLlamaForCausalLM,
        DartsMistralForCausalLM,
        DartsMixtralForCausalLM,
        DartsQwen2ForCausalLM,
        DartsQwen3ForCausalLM,
        DartsGemmaForCausalLM,
        DartsPhi3ForCausalLM,
    )
}
