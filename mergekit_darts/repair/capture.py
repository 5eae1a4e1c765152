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

from mergekit_darts.repair.capture_cache import CaptureCache as _Cache
from mergekit_darts.repair.capture_cache import cache_key as _key
from mergekit_darts.repair.capture_cache import model_identity as _model_identity
from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.repair.models import (  # noqa: F401  (resolve_* re-exported for the pipeline)
    _Ctx, _continue, _eos_ids, _forward_hidden, _ModelSlot, _pad, _sizes, resolve_device, resolve_dtype,
    resolve_model_dir,
)

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


@dataclass
class CaptureResult:
    domains: Dict[str, CapturedDomain]
    merged_head: torch.Tensor  # [V, H]
    tail: Optional[torch.nn.Module] = None  # depth > 0: the frozen last blocks (repair/depth.FrozenTail)


@dataclass
class _Prompts:
    ids: List[List[int]]  # merged-tokenizer ids of the kept texts, truncated to max_positions
    truncated: int = 0
    skipped: int = 0


def capture_domains(
    merged_path: str,
    specs: Sequence[DomainCaptureSpec],
    max_positions: int,
    *,
    dtype="auto",
    device="auto",
    batch_size: int = 8,
    cache_dir: Optional[str] = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    device_map=None,
    max_memory: Optional[dict] = None,
) -> CaptureResult:
    """Capture merged and expert final hidden states (+ expert entropies) for every domain.

    Order: if any domain continues its prompts (``continue_tokens > 0``) the experts go first, since
    the merged model must be captured on the continued ids; otherwise the merged model goes first.
    ``device_map`` / ``max_memory`` (accelerate's) spread each model over devices, cpu and disk
    (repair/placement.py); ``device`` then only picks the default dtype and where results are computed.
    """
    from transformers import AutoTokenizer

    names = [spec.name for spec in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"specs: need at least one domain and unique names, got {names}")
    if max_positions <= 0 or batch_size <= 0:
        raise ValueError(f"max_positions ({max_positions}) and batch_size ({batch_size}) must be positive")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    cache = _Cache(cache_dir)
    ctx = _Ctx(device, dtype, batch_size, max_positions, trust_remote_code, progress, cache,
               device_map=device_map, max_memory=max_memory)

    merged_dir = resolve_model_dir(merged_path)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir, trust_remote_code=trust_remote_code)
    ctx.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    merged_sizes = _sizes(merged_dir, trust_remote_code)
    ctx.hidden_size, ctx.vocab_size = merged_sizes
    prompts = {spec.name: _tokenize(tokenizer, spec, max_positions) for spec in specs}

    # Everything that can be checked without loading a model is checked before loading any.
    expert_dirs = {spec.expert: resolve_model_dir(spec.expert) for spec in specs}
    for spec in specs:
        _check_expert(spec, expert_dirs[spec.expert], merged_sizes, tokenizer, trust_remote_code)

    merged = _ModelSlot(merged_dir, ctx)
    experts_first = any(spec.continue_tokens > 0 or spec.continue_samples > 0 for spec in specs)
    if experts_first:
        expert_out = _capture_experts(specs, expert_dirs, prompts, ctx)
        merged_out = _capture_merged(merged, specs, {n: out[0] for n, out in expert_out.items()}, ctx)
    else:
        merged_out = _capture_merged(merged, specs, {n: p.ids for n, p in prompts.items()}, ctx)
        expert_out = _capture_experts(specs, expert_dirs, prompts, ctx)

    domains = {}
    for spec in specs:
        ids, expert_hidden, entropy, expert_head = expert_out[spec.name]
        input_ids, mask = _pad(ids, ctx.pad_id)
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
        )
    return CaptureResult(domains=domains, merged_head=merged_out["head"])


def capture_merged_prompts(
    merged_path: str, spec: DomainCaptureSpec, max_positions: int, *, dtype="auto", device="auto",
    batch_size: int = 8, cache_dir: Optional[str] = None, trust_remote_code: bool = False, progress: bool = True,
) -> CapturedDomain:
    """The merged model's final states of ``spec.texts`` alone (no expert, no continuation): what the
    router's out-of-domain measurement (``router_eval``) needs. Expert fields are left empty."""
    from transformers import AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    ctx = _Ctx(device, dtype, batch_size, max_positions, trust_remote_code, progress, _Cache(cache_dir))
    merged_dir = resolve_model_dir(merged_path)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir, trust_remote_code=trust_remote_code)
    ctx.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ctx.hidden_size, ctx.vocab_size = _sizes(merged_dir, trust_remote_code)
    prompts = _tokenize(tokenizer, spec, max_positions)
    out = _capture_merged(_ModelSlot(merged_dir, ctx), [spec], {spec.name: prompts.ids}, ctx)
    input_ids, mask = _pad(prompts.ids, ctx.pad_id)
    empty = torch.zeros(0)
    return CapturedDomain(
        input_ids=input_ids, attention_mask=mask,
        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        merged_hidden=out["hidden"][spec.name], expert_hidden=empty, expert_entropy=empty, expert_head=empty,
        truncated=prompts.truncated, skipped=prompts.skipped,
        prompt_lengths=torch.tensor([len(row) for row in prompts.ids], dtype=torch.long),
    )


# --- capture passes --------------------------------------------------------------------------


def _capture_merged(slot: _ModelSlot, specs, ids: Dict[str, List[List[int]]], ctx: _Ctx) -> dict:
    identity = _model_identity(slot.model_dir)
    hidden = {}
    try:
        for spec in specs:
            rows = ids[spec.name]
            key = _key("merged", identity, ctx.dtype, ids=rows)
            expected = {"hidden": ((len(rows), max(map(len, rows)), ctx.hidden_size), ctx.dtype)}
            entry = ctx.cache.load(f"merged.{spec.name}", key, expected)
            if entry is None:
                states, _ = _forward_hidden(slot.get(), rows, ctx, f"merged · {spec.name}", with_entropy=False)
                entry = {"hidden": states}
                ctx.cache.save(f"merged.{spec.name}", key, entry)
            hidden[spec.name] = entry["hidden"]
        head = _cached_head(slot, "merged", identity, ctx)
    finally:
        slot.free()
    return {"hidden": hidden, "head": head}


def _capture_experts(specs, expert_dirs, prompts: Dict[str, _Prompts], ctx: _Ctx) -> dict:
    """{domain: (final ids, hidden [N,T,H], entropy [N,T], head [V,H])}; one expert loaded at a time,
    shared by all the domains that name it."""
    out = {}
    for expert in dict.fromkeys(spec.expert for spec in specs):
        slot = _ModelSlot(expert_dirs[expert], ctx)
        identity = _model_identity(slot.model_dir)
        try:
            head = _cached_head(slot, "expert", identity, ctx)
            for spec in (s for s in specs if s.expert == expert):
                prompt = prompts[spec.name].ids
                # Keyed by the prompt ids: the continuation is the expert's own output, stored in the entry.
                key = _key("expert", identity, ctx.dtype, ids=prompt, continue_tokens=spec.continue_tokens,
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


def _expert_entry(model, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: _Ctx) -> dict:
    # A function of its own so no local name keeps the model alive once the slot frees it.
    ids = prompt
    if spec.continue_tokens > 0:
        ids = _continue(model, prompt, spec.continue_tokens, ctx, _eos_ids(model), f"continue · {spec.name}")
        for round_ in range(spec.continue_samples):
            # seeded per round: the same config gives the same samples, each round different ones
            ids = ids + _continue(model, prompt, spec.continue_tokens, ctx, _eos_ids(model),
                                  f"sample {round_ + 1} · {spec.name}", temperature=spec.continue_temperature,
                                  seed=spec.sample_seed + round_)
    states, entropy = _forward_hidden(model, ids, ctx, f"expert · {spec.name}", with_entropy=True)
    input_ids, _ = _pad(ids, ctx.pad_id)
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    return {"input_ids": input_ids, "lengths": lengths, "hidden": states, "entropy": entropy}


def _cached_head(slot: _ModelSlot, role: str, identity: dict, ctx: _Ctx) -> torch.Tensor:
    key = _key(f"{role}-head", identity, ctx.dtype)
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


def _expert_shapes(prompt: List[List[int]], ctx: _Ctx, spec: DomainCaptureSpec) -> dict:
    n = len(prompt) * (1 + (spec.continue_samples if spec.continue_tokens > 0 else 0))
    return {"input_ids": ((n, None), torch.long), "lengths": ((n,), torch.long),
            "hidden": ((n, None, ctx.hidden_size), ctx.dtype), "entropy": ((n, None), torch.float32)}


def _check_continued(entry: dict, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: _Ctx) -> None:
    """A stored expert entry must extend exactly the prompts, by at most continue_tokens each."""
    t = entry["input_ids"].shape[1]
    if entry["hidden"].shape[1] != t or entry["entropy"].shape[1] != t:
        raise ValueError("hidden/entropy length differs from input_ids")
    rounds = 1 + (spec.continue_samples if spec.continue_tokens > 0 else 0)
    for row, n, p in zip(entry["input_ids"], entry["lengths"].tolist(), prompt * rounds):
        if not len(p) <= n <= min(len(p) + spec.continue_tokens, t, ctx.max_positions) or row[:len(p)].tolist() != p:
            raise ValueError("stored ids do not extend the prompts")


# --- tokenization and checks -----------------------------------------------------------------


def _encode(tokenizer, text: str, add_special_tokens: Optional[bool]) -> List[int]:
    if add_special_tokens is None:
        bos = getattr(tokenizer, "bos_token", None)
        add_special_tokens = not (bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _tokenize(tokenizer, spec: DomainCaptureSpec, max_positions: int) -> _Prompts:
    special = set(tokenizer.all_special_ids)
    prompts = _Prompts(ids=[])
    for text in spec.texts:
        ids = _encode(tokenizer, text, spec.add_special_tokens)
        if not text.strip() or all(token in special for token in ids):  # nothing to learn from
            prompts.skipped += 1
            continue
        if len(ids) > max_positions:
            prompts.truncated += 1
            ids = ids[:max_positions]
        prompts.ids.append(ids)
    if prompts.skipped:
        LOG.warning("domain %s: %d calibration record(s) tokenized to nothing and were skipped", spec.name, prompts.skipped)
    if prompts.truncated:
        LOG.warning("domain %s: %d calibration sample(s) truncated to max_positions=%d",
                    spec.name, prompts.truncated, max_positions)
    if not prompts.ids:
        raise SurgeryConfigError(
            f"surgery.domains.{spec.name}.calibration: none of its {len(spec.texts)} texts tokenizes to "
            "anything; check the calibration field and template"
        )
    return prompts


def _check_expert(spec, expert_dir, merged_sizes, merged_tokenizer, trust_remote_code) -> None:
    from transformers import AutoTokenizer

    hidden, vocab = _sizes(expert_dir, trust_remote_code)
    for what, mine, theirs in (("hidden size", hidden, merged_sizes[0]), ("vocabulary size", vocab, merged_sizes[1])):
        if mine != theirs:
            raise SurgeryConfigError(
                f"surgery.domains.{spec.name}.model: expert {spec.expert!r} has {what} {mine} but the merged "
                f"model has {theirs}; the expert must be one of the merged models (same base architecture)"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(expert_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # e.g. a checkpoint without tokenizer files: nothing to compare against
        LOG.warning("expert %s: no tokenizer to compare with the merged one (%s); assuming they match", spec.expert, error)
        return
    for text in spec.texts:
        mine, theirs = _encode(tokenizer, text, spec.add_special_tokens), _encode(merged_tokenizer, text, spec.add_special_tokens)
        if mine != theirs:
            raise SurgeryConfigError(
                f"surgery.domains.{spec.name}.model: the tokenizer of expert {spec.expert!r} encodes the "
                f"calibration text {text[:60]!r} differently from the merged model's tokenizer; DARTS needs "
                "experts that share the merged model's tokenizer"
            )
