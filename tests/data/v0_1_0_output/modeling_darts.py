"""Darts*ForCausalLM: a merged model plus per-domain representation surgery (DESIGN §3, §5).

This file is copied with ``surgery.py`` into every output directory and loaded there by transformers'
remote-code loader, so it imports torch, transformers and ``.surgery`` only, and touches no files.

The corrected model is the plain ``<Arch>ForCausalLM`` with two forward hooks:

* on the final norm: ``h -> s(h, position_ids)`` for the active domain's ``DomainSurgery`` ``s``;
* on the LM head (only when ``head_rank > 0``): ``logits += s.head_correction(h_hat)``.

Hooks keep the parent's ``forward`` (labels/loss, ``logits_to_keep``, KV cache, generate) untouched;
``forward`` is only wrapped to tell the hooks the position ids of the current call.
"""

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

from .surgery import DomainSurgery

NONE_DOMAIN = "none"


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

    ``config.darts`` = {"method", "loss", "rank", "head_rank", "max_positions", "domains": {name:
    expert}, "version"}; ``config.darts_domain`` names the active domain ("none" = plain merged model).
    """

    # the correction's math is float32 (surgery.py); keep its parameters there when loading in bf16
    _keep_in_fp32_modules_strict = ["darts"]
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
        self.darts = nn.ModuleDict(
            {
                name: DomainSurgery(
                    hidden_size=self.config.hidden_size,
                    rank=int(meta.get("rank", 16)),
                    max_positions=int(meta.get("max_positions", 512)),
                    method=meta.get("method", "darts"),
                    head_rank=int(meta.get("head_rank", 0) or 0),
                    vocab_size=self.config.vocab_size,
                )
                for name in domains
            }
        )
        self._darts_call = None  # (surgery, position_ids) while a forward with an active domain runs
        self.model.norm.register_forward_hook(self._darts_norm_hook)
        self.lm_head.register_forward_hook(self._darts_head_hook)
        self._darts_hooked_head_id = id(self.lm_head)
        self.set_darts_domain(getattr(self.config, "darts_domain", None) or NONE_DOMAIN)

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

    def set_darts_domain(self, name: "str | None") -> None:
        """Activate domain ``name``'s correction; "none" (or None) runs the plain merged model."""
        name = NONE_DOMAIN if name is None else str(name)
        if name != NONE_DOMAIN and name not in self.darts:
            raise ValueError(
                f"darts_domain: unknown domain {name!r}; choose one of {[*self.darts.keys(), NONE_DOMAIN]}"
            )
        self._darts_domain = name
        self.config.darts_domain = name  # so save_pretrained keeps the choice

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        # Explicit position_ids / logits_to_keep: generate() inspects the signature for both.
        call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=logits_to_keep, **kwargs)
        if self._darts_domain == NONE_DOMAIN:
            return super().forward(**call)
        if position_ids is None:
            # the position the surgery was trained on: the token's index within its sequence
            embeds = input_ids if input_ids is not None else kwargs["inputs_embeds"]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            position_ids = default_position_ids(embeds.shape[1], attention_mask, cache, embeds.device)
        self._darts_call = (self.darts[self._darts_domain], position_ids)
        try:
            return super().forward(**call)
        finally:
            self._darts_call = None

    def _darts_norm_hook(self, module, args, output):
        if self._darts_call is None:  # e.g. model.model(...) called directly: no correction
            return output
        surgery, position_ids = self._darts_call
        device = output.device
        position_ids = position_ids.to(device).expand(output.shape[:-1])
        weight_device = surgery.down.weight.device
        corrected = surgery(output.to(weight_device), position_ids.to(weight_device))
        return corrected.to(device)

    def set_output_embeddings(self, new_embeddings):
        # resize_token_embeddings swaps the LM head: the head correction must follow it
        super().set_output_embeddings(new_embeddings)
        if id(new_embeddings) != getattr(self, "_darts_hooked_head_id", None):  # same module: hooked already
            new_embeddings.register_forward_hook(self._darts_head_hook)
            self._darts_hooked_head_id = id(new_embeddings)  # an id, not the module: no extra submodule

    def _darts_head_hook(self, module, args, output):
        if self._darts_call is None or self._darts_call[0].head_rank == 0:
            return output
        surgery = self._darts_call[0]
        if surgery.head_up.weight.shape[0] != output.shape[-1]:
            raise ValueError(
                f"darts: the head correction of domain {self._darts_domain!r} was trained for a vocabulary "
                f"of {surgery.head_up.weight.shape[0]} tokens but the LM head now has {output.shape[-1]} "
                "(resized embeddings?); use darts_domain='none' or retrain the surgery"
            )
        correction = surgery.head_correction(args[0].to(surgery.head_down.weight.device))
        return (output.float() + correction.to(output.device)).to(output.dtype)


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
