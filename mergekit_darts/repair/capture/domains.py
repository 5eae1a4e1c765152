"""Final-layer hidden states of the merged model and the experts, plus expert entropies (docs/design.md §3, §4).

The hidden state is the output of the model's final norm (the LM head's input), taken with a forward
hook, so it is exactly what the surgery module will see at inference. All models see the same token
ids, produced by the merged model's tokenizer. Only one model is in memory at a time: load, capture
every domain that needs it, free. With ``depth > 0`` the merged pass also keeps the first adapted
block's input, and the frozen tail is kept too (capture/block_inputs.py). Everything is cached on disk
by content (capture/cache.py), so a rerun with the same inputs loads no model.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mergekit_darts.repair.capture.block_inputs import cached_tail, check_depth, check_replay
from mergekit_darts.repair.capture.context import CaptureContext
from mergekit_darts.repair.capture.forward import (continue_prompts, forward_hidden, generation_settings, pad_rows,
                                                   stop_ids)
from mergekit_darts.repair.capture.models import ModelSlot, resolve_model_dir
from mergekit_darts.repair.capture.prefixes import prefix_specs
from mergekit_darts.repair.capture.prompts import Prompts, check_expert, tokenize_prompts
from mergekit_darts.repair.capture.synthesize import add_synthesized, writer_slot

LOG = logging.getLogger(__name__)


@dataclass
class CapturedDomain:
    input_ids: torch.LongTensor  # [N, T] (T = longest kept sample, <= max_positions), right padded
    attention_mask: torch.BoolTensor  # [N, T] true at real tokens
    position_ids: torch.LongTensor  # [N, T] arange per row
    merged_hidden: torch.Tensor  # [N, T, H] capture dtype, zero at padding
    expert_hidden: torch.Tensor  # [N, T, H]
    expert_entropy: torch.Tensor  # [N, T] float32, zero at padding
    expert_head: torch.Tensor  # [V, H] expert LM head weight (capture dtype)
    truncated: int  # samples cut to max_positions
    skipped: int  # records that tokenized to nothing
    # prompt index of each row: rows [0, prompts) are the prompts (greedy-continued), then each
    # sampled continuation round (continue_samples); None = one row per prompt
    groups: Optional[torch.LongTensor] = None
    # [N] tokens of each row that are its prompt; the rest (up to the mask's end) is the expert's
    # continuation. From the tokenization, not the cache, so the cache format is unchanged.
    prompt_lengths: Optional[torch.LongTensor] = None
    # [N, T, H] float32 input of the first adapted decoder block (``depth > 0`` only)
    block_inputs: Optional[torch.Tensor] = None
    # calibration.synthesize: prompts [0, real_prompts) are the user's, the rest the expert's (they
    # only ever train); None: all the user's. ``synthesis``: what was sampled, kept and rejected
    real_prompts: Optional[int] = None
    synthesis: Optional[Dict[str, int]] = None
    # continue_tokens > 0: prefixes of the held-out records that leave no room for a whole continuation,
    # each + the expert's greedy continuation (capture/prefixes.py); ``prefix_records``: each one's
    # record (row). Only the behaviour figures read them; they are never training rows.
    prefixes: Optional["CapturedDomain"] = None
    prefix_records: Optional[torch.LongTensor] = None
    # every stop id (``forward.stop_ids``: config's and generation_config.json's eos ids) of the expert, which
    # ended its continuations on them, and of the merge: the behaviour figures count a stop on any as a stop
    stop_ids: Optional[Tuple[int, ...]] = None


@dataclass
class DomainCaptureSpec:
    name: str
    expert: str
    texts: List[str]
    continue_tokens: int = 0
    # None = auto: no special tokens are added to a text that already starts with the tokenizer's
    # BOS (a chat-templated text), else they are. Give False for chat-templated texts to be explicit.
    add_special_tokens: Optional[bool] = None
    continue_samples: int = 0  # sampled continuations per prompt, besides the greedy one
    continue_temperature: float = 1.0
    sample_seed: int = 0
    synthesize: int = 0  # prompts the expert writes from the training prompts (capture/synthesize.py)
    synthesize_temperature: float = 1.0
    synthesize_writer: Optional[str] = None  # the model that writes them (None: the expert)
    held_out: float = 0.2  # the training's held-out share: held-out prompts never seed a synthesized one


@dataclass
class CaptureResult:
    domains: Dict[str, CapturedDomain]
    merged_head: torch.Tensor  # [V, H]
    tail: Optional[torch.nn.Module] = None  # depth > 0: the frozen last blocks (capture/block_inputs.FrozenTail)


def capture_domains(ctx: CaptureContext, specs: Sequence[DomainCaptureSpec], depth: int = 0) -> CaptureResult:
    """Capture merged and expert final hidden states (+ expert entropies) for every domain, every
    model loaded through the run's context ``ctx`` (placement, dtype, cache). ``depth > 0``: also each
    domain's ``block_inputs`` and the result's ``tail``, checked to replay the merged states.

    Order: if any domain continues its prompts (``continue_tokens > 0``) the experts go first, since
    the merged model must be captured on the continued ids; otherwise the merged model goes first.
    """
    names = [spec.name for spec in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"specs: need at least one domain and unique names, got {names}")
    prompts = {spec.name: tokenize_prompts(ctx.tokenizer, spec, ctx.max_positions) for spec in specs}

    # Everything that can be checked without loading a model is checked before loading any.
    if depth:
        check_depth(depth, ctx.num_layers)
    expert_dirs = {spec.expert: resolve_model_dir(spec.expert) for spec in specs}
    for spec in specs:
        check_expert(spec, expert_dirs[spec.expert], (ctx.hidden_size, ctx.vocab_size), ctx.tokenizer,
                     ctx.trust_remote_code)

    for spec in specs:  # prompts written by another model than the expert: before any expert loads
        if spec.synthesize and spec.synthesize_writer is not None:
            add_synthesized(writer_slot(ctx, spec), prompts[spec.name], spec, ctx)
    # held-out prefixes are cut from the user's prompts (never from synthesized ones, which only train)
    prefixes = prefix_specs(specs, prompts, ctx.max_positions)
    prompts.update({prefix.name: cut for prefix, cut, _ in prefixes.values()})
    passes = list(specs) + [prefix for prefix, _, _ in prefixes.values()]  # the same model loads capture them
    merged = ctx.slot(ctx.merged_dir)
    experts_first = any(spec.continue_tokens > 0 or spec.continue_samples > 0 or spec.synthesize > 0 for spec in specs)
    if experts_first:
        expert_out = _capture_experts(passes, expert_dirs, prompts, ctx)
        merged_out = _capture_merged(merged, passes, {n: out[0] for n, out in expert_out.items()}, ctx, depth)
    else:
        merged_out = _capture_merged(merged, passes, {n: p.ids for n, p in prompts.items()}, ctx, depth)
        expert_out = _capture_experts(passes, expert_dirs, prompts, ctx)

    domains = {}
    merged_stops = set(stop_ids(ctx.merged_dir, ctx.trust_remote_code))
    for spec in specs:
        domains[spec.name] = _captured(spec, prompts[spec.name], expert_out[spec.name], merged_out, ctx.pad_id)
        domains[spec.name].stop_ids = tuple(sorted(merged_stops | set(stop_ids(expert_dirs[spec.expert],
                                                                              ctx.trust_remote_code))))
        if spec.name in prefixes:
            prefix, cut, records = prefixes[spec.name]
            domains[spec.name].prefixes = _captured(prefix, cut, expert_out[prefix.name], merged_out, ctx.pad_id)
            domains[spec.name].prefix_records = records
        if depth:
            check_replay(spec.name, merged_out["tail"], domains[spec.name], ctx.batch_size, ctx.dtype)
    if depth:
        coverage = merged_out["tail"].coverage()
        if coverage["not_adapted"]:
            LOG.warning("depth %d: %s of each adapted block are not nn.Linear layers (fused MoE experts, the MoE "
                        "router) and get no adapter, so expert routing is unchanged; adapters go on %s",
                        depth, ", ".join(coverage["not_adapted"]), ", ".join(coverage["adapted"]))
    return CaptureResult(domains=domains, merged_head=merged_out["head"], tail=merged_out["tail"])


def _captured(spec: DomainCaptureSpec, prompts: Prompts, expert_out, merged_out: dict, pad_id: int) -> CapturedDomain:
    ids, expert_hidden, entropy, expert_head = expert_out
    input_ids, mask = pad_rows(ids, pad_id)
    return CapturedDomain(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        merged_hidden=merged_out["hidden"][spec.name],
        expert_hidden=expert_hidden,
        expert_entropy=entropy,
        expert_head=expert_head,
        truncated=prompts.truncated,
        skipped=prompts.skipped,
        groups=torch.arange(len(ids)) % len(prompts.ids) if spec.continue_samples else None,
        # one entry per row: a sampled row repeats its prompt's length
        prompt_lengths=torch.tensor([len(row) for row in prompts.ids], dtype=torch.long)
        .repeat(len(ids) // len(prompts.ids)),
        real_prompts=prompts.real, synthesis=prompts.synthesis,
        block_inputs=merged_out["blocks"].get(spec.name),
    )


def capture_merged_prompts(ctx: CaptureContext, spec: DomainCaptureSpec, depth: int = 0) -> CapturedDomain:
    """The merged model's final states of ``spec.texts`` alone (no expert, no continuation): what the
    router's out-of-domain measurement (``router_eval``) needs; with ``depth`` also the first adapted
    block's input (where the router reads). Expert fields are left empty."""
    prompts = tokenize_prompts(ctx.tokenizer, spec, ctx.max_positions)
    out = _capture_merged(ctx.slot(ctx.merged_dir), [spec], {spec.name: prompts.ids}, ctx, depth, with_tail=False)
    input_ids, mask = pad_rows(prompts.ids, ctx.pad_id)
    empty = torch.zeros(0)
    return CapturedDomain(
        input_ids=input_ids, attention_mask=mask,
        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        merged_hidden=out["hidden"][spec.name], expert_hidden=empty, expert_entropy=empty, expert_head=empty,
        truncated=prompts.truncated, skipped=prompts.skipped,
        prompt_lengths=torch.tensor([len(row) for row in prompts.ids], dtype=torch.long),
        block_inputs=out["blocks"].get(spec.name),
    )


# --- capture passes --------------------------------------------------------------------------


def _capture_merged(slot: ModelSlot, specs, ids: Dict[str, List[List[int]]], ctx: CaptureContext, depth: int = 0,
                    with_tail: bool = True) -> dict:
    """{hidden: {domain: [N,T,H]}, blocks: {domain: [N,T,H] float32} (depth only), head, tail}."""
    first = ctx.num_layers - depth if depth else None
    hidden, blocks = {}, {}
    try:
        for spec in specs:
            rows = ids[spec.name]
            shape = (len(rows), max(map(len, rows)), ctx.hidden_size)
            key = ctx.key("merged", slot.model_dir, ids=rows)
            entry = ctx.cache.load(f"merged.{spec.name}", key, {"hidden": (shape, ctx.dtype)})
            block_key = ctx.key("block-inputs", slot.model_dir, ids=rows, layer=first) if depth else None
            block_entry = None
            if depth:
                block_entry = ctx.cache.load(f"blocks.{spec.name}", block_key, {"block_inputs": (shape, torch.float32)})
            if entry is None or (depth and block_entry is None):
                states, _, inputs = forward_hidden(slot.get(), rows, ctx, f"merged · {spec.name}", with_entropy=False,
                                                   block_index=first)
                entry = {"hidden": states}
                ctx.cache.save(f"merged.{spec.name}", key, entry)
                if depth:
                    block_entry = {"block_inputs": inputs}
                    ctx.cache.save(f"blocks.{spec.name}", block_key, block_entry)
            hidden[spec.name] = entry["hidden"]
            if depth:
                blocks[spec.name] = block_entry["block_inputs"]
        head = _cached_head(slot, "merged", ctx)
        tail = cached_tail(slot, ctx, depth) if depth and with_tail else None
    finally:
        slot.free()
    return {"hidden": hidden, "blocks": blocks, "head": head, "tail": tail}


def _capture_experts(specs, expert_dirs, prompts: Dict[str, Prompts], ctx: CaptureContext) -> dict:
    """{domain: (final ids, hidden [N,T,H], entropy [N,T], head [V,H])}; one expert loaded at a time,
    shared by all the domains that name it."""
    out = {}
    for expert in dict.fromkeys(spec.expert for spec in specs):
        slot = ctx.slot(expert_dirs[expert])
        stop = stop_ids(slot.model_dir, ctx.trust_remote_code)
        try:
            head = _cached_head(slot, "expert", ctx)
            for spec in (s for s in specs if s.expert == expert):
                if spec.synthesize and spec.synthesize_writer is None:
                    add_synthesized(slot, prompts[spec.name], spec, ctx)
                prompt = prompts[spec.name].ids
                # Keyed by the prompt ids and the generation settings: the continuation is the
                # expert's own output, stored in the entry.
                generation = None
                if spec.continue_tokens > 0:
                    generation = generation_settings(spec.continue_tokens, ctx, stop, spec.continue_samples,
                                                     spec.continue_temperature, spec.sample_seed)
                key = ctx.key("expert", slot.model_dir, ids=prompt, generation=generation)
                entry = ctx.cache.load(f"expert.{spec.name}", key, _expert_shapes(prompt, ctx, spec),
                                       extra_check=lambda e, p=prompt, s=spec: _check_continued(e, p, s, ctx))
                if entry is None:
                    entry = _expert_entry(slot.get(), prompt, spec, ctx, stop)
                    ctx.cache.save(f"expert.{spec.name}", key, entry)
                ids = [row[:n].tolist() for row, n in zip(entry["input_ids"], entry["lengths"].tolist())]
                out[spec.name] = (ids, entry["hidden"], entry["entropy"], head)
        finally:
            slot.free()
    return out


def _expert_entry(model, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: CaptureContext,
                  stop: List[int]) -> dict:
    # A function of its own so no local name keeps the model alive once the slot frees it.
    ids = prompt
    if spec.continue_tokens > 0:
        ids = continue_prompts(model, prompt, spec.continue_tokens, ctx, stop, f"continue · {spec.name}")
        for round_ in range(spec.continue_samples):
            # seeded per round: the same config gives the same samples, each round different ones
            ids = ids + continue_prompts(model, prompt, spec.continue_tokens, ctx, stop,
                                         f"sample {round_ + 1} · {spec.name}", temperature=spec.continue_temperature,
                                         seed=spec.sample_seed + round_)
    states, entropy, _ = forward_hidden(model, ids, ctx, f"expert · {spec.name}", with_entropy=True)
    input_ids, _ = pad_rows(ids, ctx.pad_id)
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    return {"input_ids": input_ids, "lengths": lengths, "hidden": states, "entropy": entropy}


def _cached_head(slot: ModelSlot, role: str, ctx: CaptureContext) -> torch.Tensor:
    key = ctx.key(f"{role}-head", slot.model_dir)
    label = f"{role}.head"
    entry = ctx.cache.load(label, key, {"head": ((ctx.vocab_size, ctx.hidden_size), ctx.dtype)})
    if entry is None:
        entry = {"head": slot.head()}
        ctx.cache.save(label, key, entry)
    return entry["head"]


def _expert_shapes(prompt: List[List[int]], ctx: CaptureContext, spec: DomainCaptureSpec) -> dict:
    n = len(prompt) * (1 + (spec.continue_samples if spec.continue_tokens > 0 else 0))
    return {"input_ids": ((n, None), torch.long), "lengths": ((n,), torch.long),
            "hidden": ((n, None, ctx.hidden_size), ctx.dtype), "entropy": ((n, None), torch.float32)}


def _check_continued(entry: dict, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: CaptureContext) -> None:
    """A stored expert entry must extend exactly the prompts, by at most continue_tokens each."""
    t = entry["input_ids"].shape[1]
    if entry["hidden"].shape[1] != t or entry["entropy"].shape[1] != t:
        raise ValueError("hidden/entropy length differs from input_ids")
    rounds = 1 + (spec.continue_samples if spec.continue_tokens > 0 else 0)
    for row, n, p in zip(entry["input_ids"], entry["lengths"].tolist(), prompt * rounds):
        if not len(p) <= n <= min(len(p) + spec.continue_tokens, t, ctx.max_positions) or row[:len(p)].tolist() != p:
            raise ValueError("stored ids do not extend the prompts")
