"""Final-layer hidden states of the merged model and the experts, plus expert entropies (docs/design.md §3, §4).

The hidden state is the output of the model's final norm (the LM head's input), taken with a forward
hook, so it is exactly what the surgery module will see at inference. All models see the same token
ids, produced by the merged model's tokenizer. Only one model is in memory at a time: load, capture
every domain that needs it, free. Results are cached on disk (safetensors, one file per entry, keyed
by a content hash of the model files, the token ids and the dtype), so a rerun loads no model.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from mergekit_darts.repair.capture.cache import cache_key, model_identity
from mergekit_darts.repair.capture.context import CaptureContext
from mergekit_darts.repair.capture.forward import continue_prompts, eos_ids, forward_hidden, pad_rows
from mergekit_darts.repair.capture.models import ModelSlot, resolve_model_dir
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
    # [N, T, H] float32 input of the first adapted decoder block (``depth > 0`` only, repair/depth.py)
    block_inputs: Optional[torch.Tensor] = None
    # calibration.synthesize: prompts [0, real_prompts) are the user's, the rest the expert's (they
    # only ever train); None: all the user's. ``synthesis``: what was sampled, kept and rejected
    real_prompts: Optional[int] = None
    synthesis: Optional[Dict[str, int]] = None


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


def capture_domains(ctx: CaptureContext, specs: Sequence[DomainCaptureSpec]) -> CaptureResult:
    """Capture merged and expert final hidden states (+ expert entropies) for every domain, every
    model loaded through the run's context ``ctx`` (placement, dtype, cache).

    Order: if any domain continues its prompts (``continue_tokens > 0``) the experts go first, since
    the merged model must be captured on the continued ids; otherwise the merged model goes first.
    """
    names = [spec.name for spec in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"specs: need at least one domain and unique names, got {names}")
    prompts = {spec.name: tokenize_prompts(ctx.tokenizer, spec, ctx.max_positions) for spec in specs}

    # Everything that can be checked without loading a model is checked before loading any.
    expert_dirs = {spec.expert: resolve_model_dir(spec.expert) for spec in specs}
    for spec in specs:
        check_expert(spec, expert_dirs[spec.expert], (ctx.hidden_size, ctx.vocab_size), ctx.tokenizer,
                     ctx.trust_remote_code)

    for spec in specs:  # prompts written by another model than the expert: before any expert loads
        if spec.synthesize and spec.synthesize_writer is not None:
            add_synthesized(writer_slot(ctx, spec), None, prompts[spec.name], spec, ctx)
    merged = ctx.slot(ctx.merged_dir)
    experts_first = any(spec.continue_tokens > 0 or spec.continue_samples > 0 or spec.synthesize > 0 for spec in specs)
    if experts_first:
        expert_out = _capture_experts(specs, expert_dirs, prompts, ctx)
        merged_out = _capture_merged(merged, specs, {n: out[0] for n, out in expert_out.items()}, ctx)
    else:
        merged_out = _capture_merged(merged, specs, {n: p.ids for n, p in prompts.items()}, ctx)
        expert_out = _capture_experts(specs, expert_dirs, prompts, ctx)

    domains = {}
    for spec in specs:
        ids, expert_hidden, entropy, expert_head = expert_out[spec.name]
        input_ids, mask = pad_rows(ids, ctx.pad_id)
        domains[spec.name] = CapturedDomain(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
            merged_hidden=merged_out["hidden"][spec.name],
            expert_hidden=expert_hidden,
            expert_entropy=entropy,
            expert_head=expert_head,
            truncated=prompts[spec.name].truncated,
            skipped=prompts[spec.name].skipped,
            groups=torch.arange(len(ids)) % len(prompts[spec.name].ids) if spec.continue_samples else None,
            # one entry per row: a sampled row repeats its prompt's length
            prompt_lengths=torch.tensor([len(row) for row in prompts[spec.name].ids], dtype=torch.long)
            .repeat(len(ids) // len(prompts[spec.name].ids)),
            real_prompts=prompts[spec.name].real, synthesis=prompts[spec.name].synthesis,
        )
    return CaptureResult(domains=domains, merged_head=merged_out["head"])


def capture_merged_prompts(ctx: CaptureContext, spec: DomainCaptureSpec) -> CapturedDomain:
    """The merged model's final states of ``spec.texts`` alone (no expert, no continuation): what the
    router's out-of-domain measurement (``router_eval``) needs. Expert fields are left empty."""
    prompts = tokenize_prompts(ctx.tokenizer, spec, ctx.max_positions)
    out = _capture_merged(ctx.slot(ctx.merged_dir), [spec], {spec.name: prompts.ids}, ctx)
    input_ids, mask = pad_rows(prompts.ids, ctx.pad_id)
    empty = torch.zeros(0)
    return CapturedDomain(
        input_ids=input_ids, attention_mask=mask,
        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        merged_hidden=out["hidden"][spec.name], expert_hidden=empty, expert_entropy=empty, expert_head=empty,
        truncated=prompts.truncated, skipped=prompts.skipped,
        prompt_lengths=torch.tensor([len(row) for row in prompts.ids], dtype=torch.long),
    )


# --- capture passes --------------------------------------------------------------------------


def _capture_merged(slot: ModelSlot, specs, ids: Dict[str, List[List[int]]], ctx: CaptureContext) -> dict:
    identity = model_identity(slot.model_dir)
    hidden = {}
    try:
        for spec in specs:
            rows = ids[spec.name]
            key = cache_key("merged", identity, ctx.dtype, ids=rows)
            expected = {"hidden": ((len(rows), max(map(len, rows)), ctx.hidden_size), ctx.dtype)}
            entry = ctx.cache.load(f"merged.{spec.name}", key, expected)
            if entry is None:
                states, _ = forward_hidden(slot.get(), rows, ctx, f"merged · {spec.name}", with_entropy=False)
                entry = {"hidden": states}
                ctx.cache.save(f"merged.{spec.name}", key, entry)
            hidden[spec.name] = entry["hidden"]
        head = _cached_head(slot, "merged", identity, ctx)
    finally:
        slot.free()
    return {"hidden": hidden, "head": head}


def _capture_experts(specs, expert_dirs, prompts: Dict[str, Prompts], ctx: CaptureContext) -> dict:
    """{domain: (final ids, hidden [N,T,H], entropy [N,T], head [V,H])}; one expert loaded at a time,
    shared by all the domains that name it."""
    out = {}
    for expert in dict.fromkeys(spec.expert for spec in specs):
        slot = ctx.slot(expert_dirs[expert])
        identity = model_identity(slot.model_dir)
        try:
            head = _cached_head(slot, "expert", identity, ctx)
            for spec in (s for s in specs if s.expert == expert):
                if spec.synthesize and spec.synthesize_writer is None:
                    add_synthesized(slot, identity, prompts[spec.name], spec, ctx)
                prompt = prompts[spec.name].ids
                # Keyed by the prompt ids: the continuation is the expert's own output, stored in the entry.
                key = cache_key("expert", identity, ctx.dtype, ids=prompt, continue_tokens=spec.continue_tokens,
                                max_positions=ctx.max_positions if spec.continue_tokens else None,
                                **_sampling_key(spec))
                entry = ctx.cache.load(f"expert.{spec.name}", key, _expert_shapes(prompt, ctx, spec),
                                       extra_check=lambda e, p=prompt, s=spec: _check_continued(e, p, s, ctx))
                if entry is None:
                    entry = _expert_entry(slot.get(), prompt, spec, ctx)
                    ctx.cache.save(f"expert.{spec.name}", key, entry)
                ids = [row[:n].tolist() for row, n in zip(entry["input_ids"], entry["lengths"].tolist())]
                out[spec.name] = (ids, entry["hidden"], entry["entropy"], head)
        finally:
            slot.free()
    return out


def _expert_entry(model, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: CaptureContext) -> dict:
    # A function of its own so no local name keeps the model alive once the slot frees it.
    ids = prompt
    if spec.continue_tokens > 0:
        ids = continue_prompts(model, prompt, spec.continue_tokens, ctx, eos_ids(model), f"continue · {spec.name}")
        for round_ in range(spec.continue_samples):
            # seeded per round: the same config gives the same samples, each round different ones
            ids = ids + continue_prompts(model, prompt, spec.continue_tokens, ctx, eos_ids(model),
                                  f"sample {round_ + 1} · {spec.name}", temperature=spec.continue_temperature,
                                  seed=spec.sample_seed + round_)
    states, entropy = forward_hidden(model, ids, ctx, f"expert · {spec.name}", with_entropy=True)
    input_ids, _ = pad_rows(ids, ctx.pad_id)
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    return {"input_ids": input_ids, "lengths": lengths, "hidden": states, "entropy": entropy}


def _cached_head(slot: ModelSlot, role: str, identity: dict, ctx: CaptureContext) -> torch.Tensor:
    key = cache_key(f"{role}-head", identity, ctx.dtype)
    label = f"{role}.head"
    entry = ctx.cache.load(label, key, {"head": ((ctx.vocab_size, ctx.hidden_size), ctx.dtype)})
    if entry is None:
        entry = {"head": slot.head()}
        ctx.cache.save(label, key, entry)
    return entry["head"]


def _sampling_key(spec: DomainCaptureSpec) -> dict:
    if not spec.continue_samples:
        return {}  # keys of entries captured before sampling existed stay valid
    return {"continue_samples": spec.continue_samples, "continue_temperature": spec.continue_temperature,
            "sample_seed": spec.sample_seed}


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
