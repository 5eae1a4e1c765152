"""The forward hooks of the emitted model and the per-call state they read (docs/design.md §5).

Imports torch and the shipped ``surgery``/``routing`` files only; copied into every output
directory. The state of the forward in progress lives in a ``ContextVar``, never on the model: each
thread (and asyncio task) sees its own call, and a replica (``nn.DataParallel``) passes its own
modules. The hooks are plain functions (a block hook is a ``functools.partial`` of one), so copies of
the hook tables (replicate, deepcopy) stay correct.
"""

import contextvars
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .routing import DomainRouter, route_rows
from .surgery import DomainSurgery

NONE_INDEX = -1  # the per-row domain index of "none" (plain merged model); domains are 0..n-1
AUTO_INDEX = -2  # a row still to be routed: the prefill's routing hook replaces it with the routed index


@dataclass
class _PendingRoute:
    """Rows of a call still to route (``AUTO_INDEX``): routed from the prompt's states where the router
    was trained, before any correction: the final norm's output, or with ``depth: k`` the input of the
    first adapted block (``_darts_route_hook``)."""

    router: DomainRouter
    rows: torch.Tensor  # CPU [B]: the call's domain indices, AUTO_INDEX where the router decides
    mask: Optional[torch.Tensor]  # [B, T] real tokens of the prompt (None: all)
    to_domain: torch.Tensor  # router index -> index in darts_domains
    grouping: Callable  # rows -> groups (the model's _darts_groups)
    routed: Optional[torch.Tensor] = None  # CPU [B] once routed: every row's router pick (-1 = none)

    def resolve(self, final_hidden: torch.Tensor):
        routed = route_rows(self.router, final_hidden, self.mask).cpu()
        self.routed = torch.where(routed >= 0, self.to_domain[routed.clamp_min(0)], routed)
        return self.grouping(torch.where(self.rows == AUTO_INDEX, self.routed, self.rows))


@dataclass
class _DartsCall:
    """What the hooks need during one forward of one model object (original or replica)."""

    norm: nn.Module  # the final norm / LM head of the model whose forward runs: the hooks act only on these
    head: nn.Module
    groups: Tuple[Tuple[DomainSurgery, Optional[torch.Tensor]], ...]  # (surgery, its batch rows or None = all)
    position_ids: torch.Tensor
    route: Optional[_PendingRoute] = None  # set while rows wait for the router (groups then filled in)
    layers: Optional[nn.ModuleList] = None  # the decoder layers whose forward runs, when blocks are adapted


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
    if call.route is not None and call.route.routed is None:
        call.groups = call.route.resolve(output)
    if not call.groups:  # every row routed to "none"
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
    if call is None or module is not call.head or not call.groups or call.groups[0][0].head_rank == 0:
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


# --- depth: adapters inside the last decoder blocks (blocks.py) -------------------------------------

_INSTALL_LOCK = threading.Lock()
_HOOKED_ATTR = "_darts_block_hooked"


def _darts_route_hook(module, args, kwargs):
    """Forward pre-hook on the first adapted block: route pending rows from its (uncorrected) input."""
    call = _ACTIVE_CALL.get()
    if call is None or call.route is None or call.route.routed is not None or call.layers is None:
        return None
    if not any(module is layer for layer in call.layers):
        return None
    call.groups = call.route.resolve(args[0] if args else kwargs["hidden_states"])
    return None


def _darts_block_hook(module, args, output, *, layer_index: int, path: str):
    """``y + up(down(x))`` of each row's domain on one linear of an adapted block."""
    call = _ACTIVE_CALL.get()
    if call is None or call.layers is None or not call.groups:
        return output
    if call.layers[layer_index].get_submodule(path) is not module:  # another model's copy of the linear
        return output
    inputs = args[0]

    def delta(surgery: DomainSurgery, x: torch.Tensor) -> torch.Tensor:
        adapter = surgery.blocks[str(layer_index)].get_submodule(path)
        device = _device_for(adapter.down, x.device)
        return adapter(x.to(device)).to(output.device, output.dtype)

    if call.groups[0][1] is None:
        return output + delta(call.groups[0][0], inputs)
    result = output.clone()
    for surgery, rows in call.groups:
        rows = rows.to(output.device)
        result.index_add_(0, rows, delta(surgery, inputs.index_select(0, rows.to(inputs.device))))
    return result


def install_block_hooks(layers: nn.ModuleList, surgery: DomainSurgery) -> None:
    """Hook every adapted linear of ``layers`` once. Called at each forward rather than at build time:
    quantizers (bitsandbytes) replace the linears after the model is built, and the new modules must
    be hooked too."""
    with _INSTALL_LOCK:
        for layer_index, path, _ in surgery.block_adapters():
            linear = layers[layer_index].get_submodule(path)
            if not getattr(linear, _HOOKED_ATTR, False):
                linear.register_forward_hook(partial(_darts_block_hook, layer_index=layer_index, path=path))
                setattr(linear, _HOOKED_ATTR, True)
