"""Darts*ForCausalLM: a merged model plus per-domain representation surgery (docs/design.md §3, §5).

Copied with ``surgery.py``, ``blocks.py``, ``routing.py``, ``hooks.py`` and ``generation.py`` into every output
directory and loaded there by transformers' remote-code loader: these import torch, transformers, the standard
library's ``dataclasses``/``functools``/``threading``/``typing`` and each other only, and touch no files.

The corrected model is the plain ``<Arch>ForCausalLM`` whose LM head applies each row's domain's
``DomainSurgery`` ``s`` to its input (``h -> s(h, position_ids)``, then ``logits += s.head_correction``
when ``head_rank > 0``) and, with ``depth: k``, whose last ``k`` decoder blocks add ``up(down(x))`` to
each linear (plus the adapter's bias on a linear with a bias; blocks.py). The parent's ``forward``
(labels/loss, ``logits_to_keep``, KV cache, generate) is untouched; ``forward`` here only turns the
call's ``darts_domain`` into tensors (``hooks.DartsCall``) that the attachments in hooks.py read.
"""

from typing import Sequence

import torch
from torch import nn
from transformers import initialization as init
from transformers import (GemmaForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM,
                          Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
from transformers.utils import logging

from .blocks import BlockAdapter, block_linear_targets
from .generation import (default_position_ids, generation_attention_mask, pending_route, plain_final_states,
                         prefill_route_state, route_prompt, route_step_inputs, routes_on_plain_pass, store_route_sums)
from .hooks import AUTO_INDEX, NONE_INDEX, DartsCall, attach, resolve_route, set_active_call
from .routing import DomainModules, DomainRouter
from .surgery import DomainSurgery, SurgeryShape, check_darts_tensors, damaged_file_error

logger = logging.get_logger(__name__)

NONE_DOMAIN = "none"
AUTO_DOMAIN = "auto"  # each row's domain is picked by the router from its prompt (docs/routing.md)


class DartsMixin:
    """Adds ``self.darts`` (one ``DomainSurgery`` per domain) and the attachments that apply them.

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
    # Directories written before block adapters had biases have no ``up.bias`` tensors: those load as
    # zero (_init_weights), the very output those directories always computed, without a warning.
    _keys_to_ignore_on_load_missing = [r"^darts\.[^.]+\.blocks\..+\.up\.bias$"]
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
        meta = getattr(self.config, "darts", None)
        if not isinstance(meta, dict):
            raise ValueError(
                "config.darts: config.json has no darts entry (got "
                f"{type(meta).__name__ if meta is not None else 'none'}), so this directory was not written by "
                "mergekit-darts or its config.json was replaced; load it without trust_remote_code for the plain "
                "model, or export the surgery again with mergekit-darts")
        if "domains" not in meta or not isinstance(meta["domains"], dict):
            raise ValueError("config.darts.domains: missing or not a mapping of domain name -> expert; the "
                             "config.json was not written by mergekit-darts (or was edited)")
        domains = meta["domains"]
        shape = SurgeryShape.from_meta(meta) if domains else None
        # darts.router.* (when exported): picks each prompt's domain for "auto"
        depth = shape.depth if shape is not None else 0
        router = (DomainRouter.from_meta(meta["router"], self.config.hidden_size, blocks_adapted=depth > 0)
                  if meta.get("router") else None)
        targets = block_linear_targets(self.model.layers, depth) if depth else None
        self.darts = DomainModules({name: DomainSurgery.from_shape(shape, self.config.hidden_size,
                                                                   self.config.vocab_size, targets)
                                    for name in domains}, router,
                                   first_adapted_layer=len(self.model.layers) - depth if depth else None,
                                   adapted_linears=[(index, path) for index, paths in (targets or {}).items()
                                                    for path in paths])
        attach(self)
        # None is "none": lm-eval turns darts_domain=none into None, and from_pretrained's keyword reaches the
        # config the way config.json's value does (output/check.py refuses a null written in config.json)
        default = getattr(self.config, "darts_domain", None)
        self.set_darts_domain(NONE_DOMAIN if default is None else default)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # transformers reports missing keys only as a generic list; a Darts directory without its
        # darts.* tensors silently becomes the plain merged model, so say so in its own words.
        wants_info = kwargs.pop("output_loading_info", False)
        source = f"{args[0] if args else kwargs.get('pretrained_model_name_or_path')}/darts.safetensors"
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except RuntimeError as error:  # transformers' own report of shapes is only logged: name the darts tensor
            if "ignore_mismatched_sizes" not in str(error) or kwargs.get("ignore_mismatched_sizes"):
                raise
            _, info = super().from_pretrained(*args, output_loading_info=True,
                                              **{**kwargs, "ignore_mismatched_sizes": True})
            check_darts_tensors(nn.Module(), source, info.get("mismatched_keys") or ())
            raise
        except Exception as error:  # safetensors' own error names no file (a truncated darts.safetensors, ...)
            damaged = damaged_file_error(error, source.rpartition("/")[0])
            if damaged is None:
                raise
            raise damaged from error
        check_darts_tensors(model.darts, source, info.get("mismatched_keys") or ())
        model._warn_missing_darts(info.get("missing_keys") or ())
        attach(model)  # a quantizer may have swapped the adapted linears while loading
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
        # Called for parameters missing from the checkpoint: the surgery starts as the identity, not the generic
        # N(0, 0.02) (transformers.initialization's functions skip tensors that were loaded).
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
            if module.up.bias is not None:
                init.zeros_(module.up.bias)
        elif isinstance(module, nn.Linear) and module.bias is not None and any(
                module is child for child in self.darts.modules()):
            # a block adapter's up (the only linear with a bias in darts), reached on its own when only its
            # bias is missing (a directory written before adapters had biases): zero
            init.zeros_(module.bias)
        elif not any(module is child for child in self.darts.modules()):
            super()._init_weights(module)

    @property
    def darts_domains(self):
        return list(self.darts.keys())

    @property
    def darts_domain(self) -> str:
        return self._darts_domain

    def _domain_index(self, name) -> int:
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
        name = NONE_DOMAIN if name is None else name
        self._domain_index(name)
        self._darts_domain = name
        self.config.darts_domain = name  # so save_pretrained keeps the choice

    def _call_plan(self, darts_domain, batch_size: int, device):
        """The one mapping from a call's ``darts_domain`` to what the attachments apply: None (the plain
        model), ``(index, None, False)`` (one domain for every row) or ``(None, rows, may_route)`` with
        rows a LongTensor [batch_size] on ``device``: ``i`` = ``darts_domains[i]``, ``NONE_INDEX`` (-1) =
        "none", ``AUTO_INDEX`` (-2) = routed from the row's prompt (``may_route``: such rows can occur).

        Accepts None (the model's default domain), one name (every row), a sequence of names (one per
        row) or such an index tensor. Decided from the argument alone, never from tensor values."""
        wanted = self._darts_domain if darts_domain is None else darts_domain
        if isinstance(wanted, str):
            index = self._domain_index(wanted)
            if index == NONE_INDEX:
                return None
            if index == AUTO_INDEX:
                return None, torch.full((batch_size,), AUTO_INDEX, dtype=torch.long, device=device), True
            return index, None, False
        if isinstance(wanted, torch.Tensor):
            return None, self._checked_rows(wanted, batch_size, device), self.darts.router is not None
        if isinstance(wanted, Sequence):
            indices = [self._domain_index(name) for name in wanted]
            if len(indices) != batch_size:
                raise ValueError(f"darts_domain: {len(indices)} domains given for a batch of {batch_size} rows")
            if set(indices) == {NONE_INDEX}:
                return None
            if len(set(indices)) == 1 and indices[0] != AUTO_INDEX:
                return indices[0], None, False
            return None, torch.tensor(indices, dtype=torch.long, device=device), AUTO_INDEX in indices
        raise ValueError(f"darts_domain: expected a domain name, a list of names (one per batch row) or None, "
                         f"got {type(wanted).__name__}")

    def _checked_rows(self, rows: torch.Tensor, batch_size: int, device) -> torch.Tensor:
        if rows.dtype not in (torch.int64, torch.int32) or rows.dim() != 1:
            raise ValueError(f"darts_domain: an index tensor must be 1-D integer, got {rows.dtype} {tuple(rows.shape)}")
        if rows.shape[0] != batch_size:
            raise ValueError(f"darts_domain: {rows.shape[0]} domains given for a batch of {batch_size} rows")
        lowest = NONE_INDEX if self.darts.router is None else AUTO_INDEX
        message = f"darts_domain: domain indices must be in [{lowest}, {len(self.darts) - 1}]"
        valid = (rows >= lowest) & (rows < len(self.darts))
        if rows.device.type == "cpu" and not torch.compiler.is_compiling():
            if not bool(valid.all()):
                raise ValueError(message)
        else:  # checked on the device, without waiting for it
            torch._assert_async(valid.all(), message)
        return rows.to(device=device, dtype=torch.long, copy=True)  # never written into: the caller's stays

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, darts_domain=None, darts_rows=None, darts_route=None,
                darts_route_state=None, darts_routed_rows=None, darts_prompt_mask=None, **kwargs):
        """``darts_domain``: see ``_call_plan``. ``darts_prompt_mask`` [B, T]: the current tokens that
        are real prompt tokens, for "auto" rows with a 4-D ``attention_mask``. ``darts_rows`` (validated
        per-row indices) is what ``generate`` hands every step; with "auto" rows its prefill calls also
        get ``darts_route="prefill"``, the routing sums ``darts_route_state`` they add to and
        ``darts_routed_rows``, written with the routed rows that the later steps get as ``darts_rows``."""
        # The parent's parameters by name: generate() inspects the signature for position_ids, cache, use_cache
        # and logits_to_keep (a user's cache= / past_key_values= is refused unless named here), the Trainer for
        # labels (a column it would otherwise drop from the batches).
        if cache is None:  # transformers' deprecated name of cache
            cache = kwargs.pop("past_key_values", None)
        call_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                           inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                           logits_to_keep=logits_to_keep, **kwargs)
        embeds = input_ids if input_ids is not None else inputs_embeds
        if embeds is None:  # let the parent raise its own error
            return self._forward_without_correction(call_kwargs)
        batch, length = embeds.shape[:2]
        plan = ((None, darts_rows, darts_route == "prefill") if darts_rows is not None
                else self._call_plan(darts_domain, batch, embeds.device))
        if plan is None:
            return self._forward_without_correction(call_kwargs)
        if not torch.compiler.is_compiling():
            attach(self)
        domain, rows, may_route = plan
        if position_ids is None:
            # the position the surgery was trained on: the token's index within its sequence
            position_ids = default_position_ids(length, attention_mask, cache, embeds.device)
        route = None
        if may_route:
            route = pending_route(self, attention_mask, darts_prompt_mask, darts_route, darts_route_state,
                                  darts_routed_rows, cache, batch, length)
        adapted = self.darts.first_adapted_layer is not None
        call = DartsCall(self.darts, self.model.norm, self.get_output_embeddings(),
                         self.model.layers if adapted else None, (batch, length), position_ids, logits_to_keep,
                         domain, rows, route)
        if route is not None and not route.pool:  # a later step of a routed sequence: nothing to read
            resolve_route(call)
        elif route is not None and routes_on_plain_pass(self):
            resolve_route(call, plain_final_states(self, input_ids, inputs_embeds, attention_mask, position_ids, length))
        if adapted:
            call_kwargs["darts_call"] = call  # reaches every decoder layer, and their checkpointed replay
        previous = set_active_call(call)
        try:
            outputs = super().forward(**call_kwargs)
        finally:
            set_active_call(previous)
        if route is not None and darts_route is None and route.sums is not None:
            out_cache = getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)
            if out_cache is not None:  # a manual loop passes this cache back: later calls keep the routing
                store_route_sums(out_cache, route.sums)
        return outputs

    def _forward_without_correction(self, call_kwargs):
        # no call is active while it runs: a forward started inside another one (from a hook) neither
        # applies nor routes the outer call, which is active again afterwards
        previous = set_active_call(None)
        try:
            return super().forward(**call_kwargs)
        finally:
            set_active_call(previous)

    def generate(self, *args, darts_domain=None, **kwargs):
        # A per-row index tensor (on the model's device) goes to every step as ``darts_rows``; generate
        # expands it with the batch (beams, num_return_sequences). "auto" rows add the routing sums
        # ``darts_route_state`` [B, H + 1], which the prefill (every chunk of it) adds the prompt's states
        # to, and ``darts_routed_rows``, which it fills with the routed rows: the decoding steps get those
        # as their rows, so each row keeps its prompt's domain and no decoding step routes or writes.
        inputs = args[0] if args else next((kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds")
                                            if kwargs.get(k) is not None), None)
        batch = inputs.shape[0] if inputs is not None else 1
        device = inputs.device if inputs is not None else self.device  # (self.device is meta when offloaded)
        plan = self._call_plan(darts_domain, batch, "cpu")  # checked here once, not at every step
        if plan is None or plan[0] is not None:  # one name for every step, even if the default changes meanwhile
            kwargs["darts_domain"] = NONE_DOMAIN if plan is None else self.darts_domains[plan[0]]
        else:
            kwargs["darts_rows"] = plan[1].to(device)
            routed = plan[2] and bool((plan[1] == AUTO_INDEX).any())
            if routed and routes_on_plain_pass(self):
                # the whole prompt (earlier turns in a passed cache included) routed up front: every step
                # then gets fixed rows, whatever the prefill's chunking or drafts
                embeds = kwargs.get("inputs_embeds")
                # without the caller's mask, the one generate derives from pad_token_id: padding never routes
                picked = route_prompt(self, input_ids=None if embeds is not None else inputs, inputs_embeds=embeds,
                                      attention_mask=generation_attention_mask(self, inputs, kwargs))
                kwargs["darts_rows"] = torch.where(kwargs["darts_rows"] == AUTO_INDEX, picked.to(device),
                                                   kwargs["darts_rows"])
            elif routed:
                kwargs["darts_route_state"] = prefill_route_state(kwargs.get("cache", kwargs.get("past_key_values")),
                                                                  batch, self.config.hidden_size, device)
                kwargs["darts_routed_rows"] = kwargs["darts_rows"].clone()
                kwargs["darts_prompt_length"] = inputs.shape[1] if inputs is not None else None
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, darts_prompt_length=None,
                                      **kwargs):
        # the parent's parameters by name: generate inspects this signature (inputs_embeds forwarding)
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        if kwargs.get("darts_route_state") is not None:
            route_step_inputs(inputs, input_ids, attention_mask, is_first_iteration, darts_prompt_length)
        return inputs

    def _get_candidate_generator(self, *args, **kwargs):
        # assisted / speculative decoding: the assistant drafts with its own settings (a plain model takes no
        # darts_* keyword, a Darts one its own default domain); only this model's forwards get this call's
        if isinstance(kwargs.get("model_kwargs"), dict):
            kwargs["model_kwargs"] = {key: value for key, value in kwargs["model_kwargs"].items()
                                      if not key.startswith("darts_")}
        return super()._get_candidate_generator(*args, **kwargs)

    @torch.no_grad()
    def route_domains(self, input_ids, attention_mask=None) -> "list[str]":
        """The domain the router picks for each row of ``input_ids`` [B, T] ("none" below its
        threshold), exactly as ``darts_domain="auto"`` would at prefill. Changes nothing."""
        self._domain_index(AUTO_DOMAIN)  # a clear error when there is no router
        picked = route_prompt(self, input_ids=input_ids, attention_mask=attention_mask)
        return [self.darts_domains[i] if i >= 0 else NONE_DOMAIN for i in picked.tolist()]

    def set_output_embeddings(self, new_embeddings):
        # resize_token_embeddings swaps the LM head: the correction must follow it
        super().set_output_embeddings(new_embeddings)
        attach(self)


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
