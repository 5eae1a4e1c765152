"""Where the emitted model's corrections attach, and the per-call state they read (docs/design.md §5).

Imports torch and the shipped ``surgery``/``routing`` files only; copied into every output directory.

One forward of a ``Darts*ForCausalLM`` is described by a ``DartsCall``: the modules of the model whose
forward runs (a replica made by ``nn.DataParallel`` passes its own), each row's domain as an index
tensor, each token's position and the routing still to do. Every correction is a tensor function of
it (gathers and masked selections, no host syncs, no branching on tensor values), so the forward
compiles to one graph. The call reaches the modules through two paths:

* the decoder layers of ``depth: k`` receive it as the keyword argument ``darts_call``: transformers
  hands extra keywords to every decoder layer, and its gradient checkpointing keeps a layer's keywords
  for the recompute, so the block adapters act in the backward's replay too;
* the final norm, the LM head and the linears inside an adapted layer are called without keywords:
  they read the call from a ``threading.local`` that the forward owning it (the model's, or the adapted
  layer's own) sets on entry and restores on exit. Per thread, so threads never see each other's call;
  read and written inside a compiled region, it costs no graph break.

The attachment points are forward hooks, not module replacements: quantizers (bitsandbytes) swap the
linears after the model is built, accelerate wraps ``forward`` for offloading, ``resize_token_embeddings``
makes a new LM head, and the checkpoint's tensor names must not change; a hook survives all of those
(``attach`` re-installs what a swap removed). The one replacement is the class of each adapted decoder
layer (``adapted_layer_class``): its ``forward`` is what gradient checkpointing replays.
"""

import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .routing import pooled_from_sums, prompt_state_sums
from .surgery import DomainSurgery

NONE_INDEX = -1  # the per-row domain index of "none" (plain merged model); domains are 0..n-1
AUTO_INDEX = -2  # a row the router decides ("auto"), until it is routed

_STATE = threading.local()  # .call: the DartsCall of the forward in progress on this thread, if any


def active_call() -> "Optional[DartsCall]":
    return getattr(_STATE, "call", None)


def set_active_call(call: "Optional[DartsCall]") -> "Optional[DartsCall]":
    """Make ``call`` this thread's active call; returns the previous one (to restore on exit)."""
    previous = getattr(_STATE, "call", None)
    _STATE.call = call
    return previous


@dataclass
class PendingRoute:
    """Routing of the call's "auto" rows. The router reads a masked sum of the prompt's uncorrected
    states (``routing.prompt_state_sums``: [B, H + 1], the states' sum and the real tokens' count):
    from this call's states (``pool``), from the sums carried from earlier calls of the same sequence
    (``state``), or both."""

    router: nn.Module
    to_domain: Tuple[int, ...]  # router index -> index in darts_domains
    mask: Optional[torch.Tensor] = None  # [B, T]: this call's real prompt tokens (None: every token)
    state: Optional[torch.Tensor] = None  # [B, H + 1] sums of earlier calls of these sequences
    pool: bool = True  # add this call's states (a prefill call); False: route from ``state`` alone
    accumulate: bool = False  # add them into ``state`` in place (generate's prefill, chunk by chunk)
    fresh: Optional[torch.Tensor] = None  # bool []: the cache was empty, so ``state`` is stale (static caches)
    routed: Optional[torch.Tensor] = None  # [B] long, written in place with the routed rows (generate's decoding)
    sums: Optional[torch.Tensor] = None  # the sums routed on, once routed
    done: bool = False


@dataclass
class DartsCall:
    """What the corrections need during one forward of one model object (original or replica)."""

    darts: nn.Module  # the model's DomainModules
    norm: nn.Module  # the modules of the model whose forward runs: the hooks act only on these
    head: nn.Module
    layers: Optional[nn.ModuleList]  # the decoder layers, when blocks are adapted
    shape: Tuple[int, int]  # (B, T) of the current tokens
    positions: torch.Tensor  # [B or 1, T]: each token's index within its own sequence
    keep: Any  # the forward's logits_to_keep: which tokens reach the head
    domain: Optional[int] = None  # one domain for every row (no per-row selection at all)
    rows: Optional[torch.Tensor] = None  # [B] long: each row's domain index (NONE_INDEX, AUTO_INDEX)
    route: Optional[PendingRoute] = None


def _device_for(layer: nn.Linear, fallback: torch.device) -> torch.device:
    """Where to compute a correction: its weights' device, or (weights offloaded to ``meta`` by
    accelerate, whose hook moves inputs itself) where the input already is."""
    device = layer.weight.device
    return fallback if device.type == "meta" else device


# --- routing -------------------------------------------------------------------------------------

def resolve_route(call: DartsCall, hidden: Optional[torch.Tensor] = None) -> None:
    """Replace the call's AUTO_INDEX rows by the router's pick, from ``hidden`` [B, T, H] (the states the
    router was trained on: the plain final norm's output, or for a ``block_input`` router the first
    adapted block's input) and/or the sums carried from earlier calls. Tensor ops only: the pick never leaves the device."""
    route = call.route
    if route is None or route.done:
        return
    with torch.no_grad():  # a discrete choice: no gradient, and nothing saved that a checkpoint replay would miss
        _resolve(call, route, hidden)


def _resolve(call: DartsCall, route: PendingRoute, hidden: Optional[torch.Tensor]) -> None:
    sums = route.state
    if route.pool:
        this_call = prompt_state_sums(hidden, route.mask)
        if route.state is None:
            sums = this_call
        elif route.accumulate:
            route.state.add_(this_call.to(route.state.device))
        elif route.fresh is not None:
            sums = torch.where(route.fresh.to(this_call.device), this_call, route.state.to(this_call.device))
        else:
            sums = this_call
    picked = route.router(pooled=pooled_from_sums(sums))  # router index per row, -1 below its threshold
    domain = torch.full_like(picked, NONE_INDEX)
    for router_index, domain_index in enumerate(route.to_domain):
        domain = torch.where(picked == router_index, domain_index, domain)
    rows = call.rows
    call.rows = torch.where(rows == AUTO_INDEX, domain.to(rows.device), rows)
    if route.routed is not None:
        route.routed.copy_(call.rows.to(route.routed.device))
    route.sums = sums
    route.done = True


def _norm_route_hook(module, args, output):
    """Final norm: route pending rows from its output over all current tokens (``depth`` 0)."""
    call = active_call()
    if call is not None and module is call.norm and call.route is not None and not call.route.done:
        resolve_route(call, output)
    return output


# --- the final-state and head corrections --------------------------------------------------------

try:  # the very slicing the parent's forward applies to the final states before the LM head
    from transformers.modeling_utils import slice_logits_to_keep as _slice_to_keep
except ImportError:  # pragma: no cover - older transformers: integer logits_to_keep only
    def _slice_to_keep(hidden_states, logits_to_keep):
        return hidden_states[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]


def head_tokens(call: DartsCall, values: torch.Tensor) -> torch.Tensor:
    """``values`` [B or 1, T] (or [B, 1]) -> the entries of the tokens the LM head sees."""
    full = values.expand(call.shape)
    return _slice_to_keep(full.unsqueeze(-1), call.keep).squeeze(-1)


def _surgeries(call: DartsCall):
    return call.darts.values()


def corrected_states(call: DartsCall, hidden: torch.Tensor) -> torch.Tensor:
    """h -> h_hat of each token's row domain; rows of "none" keep ``hidden`` exactly."""
    positions = head_tokens(call, call.positions.to(hidden.device))
    if tuple(positions.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"darts: the LM head got states of shape {tuple(hidden.shape)} but the forward has "
                         f"{tuple(positions.shape)} tokens to correct; call the model, not its parts")

    def corrected(surgery: DomainSurgery) -> torch.Tensor:
        device = _device_for(surgery.down, hidden.device)
        return surgery(hidden.to(device), positions.to(device)).to(hidden.device)

    surgeries = _surgeries(call)
    if call.domain is not None:
        return corrected(surgeries[call.domain])
    rows = head_tokens(call, call.rows.to(hidden.device).unsqueeze(-1)).unsqueeze(-1)
    result = hidden
    for index, surgery in enumerate(surgeries):
        result = torch.where(rows == index, corrected(surgery), result)
    return result


def _head_pre_hook(module, args):
    call = active_call()
    if call is None or module is not call.head:  # e.g. model.lm_head(...) called directly: no correction
        return None
    return (corrected_states(call, args[0]), *args[1:])


# Tokens per head-correction chunk: the float32 correction is made and added chunk by chunk, so its
# memory is ~HEAD_CHUNK_TOKENS x vocab floats (32 MB at a 32k vocabulary) whatever the batch and length.
HEAD_CHUNK_TOKENS = 256


def _head_hook(module, args, output):
    """``logits += H_u (H_d h_hat)`` of each token's row domain (``head_rank > 0``), in place, in chunks."""
    call = active_call()
    if call is None or module is not call.head:
        return output
    surgeries = _surgeries(call)
    if not surgeries or surgeries[0].head_rank == 0:
        return output
    vocab = output.shape[-1]
    if surgeries[0].head_up.weight.shape[0] != vocab:
        raise ValueError(
            f"darts: a head correction was trained for a vocabulary of {surgeries[0].head_up.weight.shape[0]} "
            f"tokens but the LM head now has {vocab} (resized embeddings?); use darts_domain='none' or "
            "retrain the surgery")
    if not output.is_contiguous():  # the in-place sums below work on a flat view
        output = output.contiguous()
    hidden = args[0].reshape(-1, args[0].shape[-1])  # [tokens, H]: the corrected h_hat fed to the head
    logits = output.view(-1, vocab)
    if call.domain is not None:
        chosen = ((surgeries[call.domain], None),)
    else:
        rows = head_tokens(call, call.rows.to(hidden.device).unsqueeze(-1)).reshape(-1, 1)
        chosen = tuple((surgery, rows == index) for index, surgery in enumerate(surgeries))
    tokens = logits.shape[0]
    if output.dtype == torch.float32:  # one float32 chunk, never more than the logits themselves
        chunk = min(HEAD_CHUNK_TOKENS, tokens)
    else:  # the float32 chunk and the float32 copy the mixed-dtype add makes: together <= the logits
        chunk = max(1, min(HEAD_CHUNK_TOKENS // 2, tokens * output.element_size() // 8))
    for begin in range(0, tokens, chunk):
        end = min(begin + chunk, tokens)
        for surgery, selected in chosen:
            states = hidden[begin:end]
            if selected is not None:  # other rows' states become 0, and H_u H_d 0 = 0 exactly
                states = torch.where(selected[begin:end], states, 0)
            device = _device_for(surgery.head_down, states.device)
            correction = surgery.head_correction(states.to(device)).to(output.device)
            _add_in_place(logits[begin:end], correction)
            del correction  # before the next one is made: one chunk alive at a time
    return output


def _add_in_place(logits: torch.Tensor, correction: torch.Tensor) -> None:
    """logits += correction with the sum in float32 and no new logits-sized tensor: float32 logits
    take it directly; lower-precision logits get (correction + logits) rounded once into place."""
    if logits.dtype == torch.float32:
        logits.add_(correction)
    else:
        logits.copy_(correction.add_(logits))


# --- depth: adapters inside the last decoder blocks (blocks.py) -------------------------------------

def _row_selector(call: DartsCall, inputs: torch.Tensor) -> torch.Tensor:
    """The call's row indices broadcastable against a linear's input: [B, T, in] (one row per
    leading index) or [B*T, in] (tokens flattened, e.g. inside a mixture of experts)."""
    batch, length = call.shape
    rows = call.rows.to(inputs.device)
    if inputs.dim() >= 2 and inputs.shape[0] == batch:
        return rows.view(batch, *([1] * (inputs.dim() - 1)))
    if inputs.dim() == 2 and inputs.shape[0] == batch * length:
        return rows.repeat_interleave(length).unsqueeze(-1)
    raise ValueError(f"darts: an adapted linear got input {tuple(inputs.shape)}, which matches neither the "
                     f"batch ({batch}) nor its tokens ({batch}x{length}); mixed-domain batches cannot be split")


def _block_hook(module, args, output, *, layer_index: int, path: str):
    """``y + up(down(x))`` (``+ b`` where the adapter has a bias) of each row's domain on one linear of
    an adapted block."""
    call = active_call()
    if call is None or call.layers is None:
        return output
    if call.layers[layer_index].get_submodule(path) is not module:  # another model's copy of the linear
        return output
    inputs = args[0]
    surgeries = _surgeries(call)

    def adapter_of(surgery: DomainSurgery):
        return surgery.blocks[str(layer_index)].get_submodule(path)

    def delta(adapter, x: torch.Tensor) -> torch.Tensor:
        device = _device_for(adapter.down, x.device)
        return adapter(x.to(device)).to(output.device)

    if call.domain is not None:
        return output + delta(adapter_of(surgeries[call.domain]), inputs).to(output.dtype)
    rows = _row_selector(call, inputs)
    total = None
    for index, surgery in enumerate(surgeries):  # each domain's delta kept on its own rows only (bias too)
        part = delta(adapter_of(surgery), inputs)
        part = torch.where((rows == index).to(part.device), part, 0)
        total = part if total is None else total + part
    return output + total.to(output.dtype)


_ADAPTED_LAYER_CLASSES: dict = {}
_CLASS_LOCK = threading.Lock()


def adapted_layer_class(base: type) -> type:
    """A subclass of the decoder layer class ``base`` whose ``forward`` takes the keyword ``darts_call``:
    it routes pending rows from its input (the first adapted layer, for a ``block_input`` router; a
    ``final`` one was resolved before the forward) and makes the call active for its
    linears while it runs. Gradient checkpointing (``GradientCheckpointingLayer``) checkpoints this
    ``forward`` with its keywords, so the recompute, possibly on another thread, sees the same call.
    The subclass keeps ``base``'s ``__name__`` (accelerate's ``_no_split_modules`` match by name)."""
    with _CLASS_LOCK:
        if base in _ADAPTED_LAYER_CLASSES:
            return _ADAPTED_LAYER_CLASSES[base]

        def forward(self, *args, darts_call: Optional[DartsCall] = None, **kwargs):
            if darts_call is None:
                return base.forward(self, *args, **kwargs)
            if darts_call.route is not None and not darts_call.route.done and self is darts_call.layers[
                    darts_call.darts.first_adapted_layer]:
                resolve_route(darts_call, args[0] if args else kwargs["hidden_states"])
            previous = set_active_call(darts_call)
            try:
                return base.forward(self, *args, **kwargs)
            finally:
                set_active_call(previous)

        adapted = type(base.__name__, (base,), {"forward": forward, "_darts_adapted": True, "__module__": __name__,
                                                 "__qualname__": f"_DartsAdapted{base.__qualname__}"})
        _ADAPTED_LAYER_CLASSES[base] = adapted
        return adapted


_ATTACH_LOCK = threading.Lock()
_HOOKED_ATTR = "_darts_hooked"


def _attachments(model: nn.Module):
    """(module, kind, install) of every attachment ``model`` needs."""
    head = model.get_output_embeddings()
    yield model.model.norm, "norm", lambda module: module.register_forward_hook(_norm_route_hook)
    yield head, "head_pre", lambda module: module.register_forward_pre_hook(_head_pre_hook)
    yield head, "head", lambda module: module.register_forward_hook(_head_hook)
    layers = model.model.layers
    for layer_index, path in model.darts.adapted_linears:
        yield (layers[layer_index].get_submodule(path), "block",
               lambda module, i=layer_index, p=path: module.register_forward_hook(partial(_block_hook, layer_index=i,
                                                                                          path=p)))


def attach(model: nn.Module) -> None:
    """Install every attachment of ``model`` (a Darts*ForCausalLM) that is not there yet. Idempotent and
    cheap when nothing is missing; called when the model is built, after loading (a quantizer may have
    swapped the linears), when the LM head is replaced and before every eager forward."""
    missing = [item for item in _attachments(model) if item[1] not in getattr(item[0], _HOOKED_ATTR, ())]
    first = model.darts.first_adapted_layer
    layers = model.model.layers
    plain_layers = [] if first is None else [layer for layer in list(layers)[first:]
                                             if not getattr(type(layer), "_darts_adapted", False)]
    if not missing and not plain_layers:
        return
    with _ATTACH_LOCK:
        for module, kind, install in missing:
            if kind not in getattr(module, _HOOKED_ATTR, ()):
                install(module)
                setattr(module, _HOOKED_ATTR, getattr(module, _HOOKED_ATTR, frozenset()) | {kind})
        for layer in plain_layers:
            if not getattr(type(layer), "_darts_adapted", False):
                layer.__class__ = adapted_layer_class(type(layer))
