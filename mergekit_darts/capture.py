"""Final-layer hidden states of the merged model and the experts, plus expert entropies (DESIGN §3, §4).

The hidden state is the output of the model's final norm (the LM head's input), taken with a forward
hook, so it is exactly what the surgery module will see at inference. All models see the same token
ids, produced by the merged model's tokenizer. Only one model is in memory at a time: load, capture
every domain that needs it, free. Results are cached on disk (safetensors, one file per entry, keyed
by a content hash of the model files, the token ids and the dtype), so a rerun loads no model.
"""

import gc
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from .capture_cache import CaptureCache as _Cache
from .capture_cache import cache_key as _key
from .capture_cache import model_identity as _model_identity
from .config import SurgeryConfigError
from .losses import token_entropy

LOG = logging.getLogger(__name__)

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]


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


@dataclass
class DomainCaptureSpec:
    name: str
    expert: str
    texts: List[str]
    continue_tokens: int = 0
    # None = auto: no special tokens are added to a text that already starts with the tokenizer's
    # BOS (a chat-templated text), else they are. Give False for chat-templated texts to be explicit.
    add_special_tokens: Optional[bool] = None


@dataclass
class CaptureResult:
    domains: Dict[str, CapturedDomain]
    merged_head: torch.Tensor  # [V, H]


@dataclass
class _Prompts:
    ids: List[List[int]]  # merged-tokenizer ids of the kept texts, truncated to max_positions
    truncated: int = 0
    skipped: int = 0


def resolve_device(device) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else as torch.device."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SurgeryConfigError(f"device: {device!r} was requested but CUDA is not available; use 'auto' or 'cpu'")
    return resolved


def resolve_dtype(dtype, device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on cuda, float32 elsewhere; else the named torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in names:
        raise SurgeryConfigError(f"dtype: unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return names[dtype]


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
) -> CaptureResult:
    """Capture merged and expert final hidden states (+ expert entropies) for every domain.

    Order: if any domain continues its prompts (``continue_tokens > 0``) the experts go first, since
    the merged model must be captured on the continued ids; otherwise the merged model goes first.
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
    ctx = _Ctx(device, dtype, batch_size, max_positions, trust_remote_code, progress, cache)

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
    experts_first = any(spec.continue_tokens > 0 for spec in specs)
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
        )
    return CaptureResult(domains=domains, merged_head=merged_out["head"])


# --- models ----------------------------------------------------------------------------------


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    max_positions: int
    trust_remote_code: bool
    progress: bool
    cache: "_Cache"
    pad_id: int = 0
    hidden_size: Optional[int] = None  # the merged model's, which every expert must share
    vocab_size: Optional[int] = None


def resolve_model_dir(path: str) -> str:
    """A local directory for ``path``: itself, or its Hugging Face hub snapshot (cached, else fetched)."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return os.path.realpath(expanded)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, local_files_only=True)
    except Exception:
        pass
    try:  # the same files from_pretrained would fetch (safetensors only)
        return snapshot_download(path, allow_patterns=_HUB_FILES)
    except Exception as error:
        raise SurgeryConfigError(
            f"model {path!r} is neither a local directory nor available from the Hugging Face hub "
            f"(cache or network): {type(error).__name__}: {error}"
        ) from None


def _sizes(model_dir: str, trust_remote_code: bool) -> Tuple[int, int]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.hidden_size), int(config.vocab_size)


def _decoders(model) -> List[torch.nn.Module]:
    found = []
    if hasattr(model, "get_decoder"):
        try:
            found.append(model.get_decoder())
        except Exception:  # some models raise for a missing decoder rule
            pass
    found.append(getattr(model, "model", None))
    return [d for d in found if isinstance(d, torch.nn.Module) and d is not model]


def _final_norm(model) -> torch.nn.Module:
    """The module whose output feeds the LM head, found without knowing the architecture."""
    for decoder in _decoders(model):
        for name in ("norm", "final_layernorm", "ln_f"):
            module = getattr(decoder, name, None)
            if isinstance(module, torch.nn.Module):
                return module
    raise SurgeryConfigError(
        f"{type(model).__name__}: cannot find the final norm (looked for get_decoder().norm, "
        ".final_layernorm, .ln_f and model.norm); DARTS needs a causal LM whose final norm feeds its LM head"
    )


def _lm_head(model) -> torch.nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        raise SurgeryConfigError(f"{type(model).__name__}: has no LM head (get_output_embeddings() is None)")
    return head


class _ModelSlot:
    """Loads a model on first use and frees it on ``free()``: the one model in memory."""

    def __init__(self, model_dir: str, ctx: _Ctx):
        self.model_dir, self.ctx, self.model = model_dir, ctx, None

    def get(self):
        if self.model is None:
            from transformers import AutoModelForCausalLM

            LOG.info("capture: loading %s (%s on %s)", self.model_dir, self.ctx.dtype, self.ctx.device)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self.ctx.dtype, use_safetensors=True,
                trust_remote_code=self.ctx.trust_remote_code,
                device_map={"": self.ctx.device} if self.ctx.device.type != "cpu" else None,
            )
            if next(model.parameters()).device != self.ctx.device:
                model = model.to(self.ctx.device)
            if hasattr(model, "set_darts_domain"):
                # a directory repaired before, loaded with remote code: capture the plain merge
                model.set_darts_domain("none")
            self.model = model.eval().requires_grad_(False)
        return self.model

    def head(self) -> torch.Tensor:
        return _lm_head(self.get()).weight.detach().to("cpu", self.ctx.dtype).clone()

    def free(self) -> None:
        if self.model is not None:
            self.model = None
            gc.collect()  # transformers models hold reference cycles; collect before the next load
            if self.ctx.device.type == "cuda":
                torch.cuda.empty_cache()


@torch.no_grad()
def _forward_hidden(model, ids: List[List[int]], ctx: _Ctx, desc: str, with_entropy: bool):
    """Final-norm outputs for ``ids`` in batches: ([N, T, H] capture dtype, [N, T] float32 or None) on cpu."""
    norm, head = _final_norm(model), _lm_head(model)
    # Run only the decoder when it owns the norm: the LM head's [B, T, V] logits are not needed.
    runner = next((d for d in _decoders(model) if any(m is norm for m in d.modules())), model)
    captured: List[torch.Tensor] = []
    handle = norm.register_forward_hook(lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    longest = max(len(row) for row in ids)
    hidden = torch.zeros(len(ids), longest, head.weight.shape[1], dtype=ctx.dtype)
    entropy = torch.zeros(len(ids), longest, dtype=torch.float32) if with_entropy else None
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together: less padding
    try:
        for start in tqdm(range(0, len(order), ctx.batch_size), desc=desc, disable=not ctx.progress, leave=False):
            rows = order[start:start + ctx.batch_size]
            input_ids, mask = _pad([ids[i] for i in rows], ctx.pad_id)
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            captured.clear()
            runner(input_ids=input_ids.to(ctx.device), attention_mask=mask.long().to(ctx.device),
                   position_ids=position_ids.to(ctx.device), use_cache=False)
            states = captured[-1]
            batch_entropy = token_entropy(states, head.weight, getattr(head, "bias", None)) if with_entropy else None
            for j, i in enumerate(rows):
                n = len(ids[i])
                hidden[i, :n] = states[j, :n].to("cpu", ctx.dtype)
                if with_entropy:
                    entropy[i, :n] = batch_entropy[j, :n].cpu()
    finally:
        handle.remove()
    return hidden, entropy


@torch.no_grad()
def _continue(model, prompts: List[List[int]], n: int, ctx: _Ctx, eos_ids: set, desc: str) -> List[List[int]]:
    """Each prompt + the model's greedy continuation: up to ``n`` tokens, stopping before EOS and
    at ``max_positions`` (so a continued sample is never truncated)."""
    out: List[Optional[List[int]]] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in tqdm(range(0, len(order), ctx.batch_size), desc=desc, disable=not ctx.progress, leave=False):
        rows = order[start:start + ctx.batch_size]
        budgets = [min(n, ctx.max_positions - len(prompts[i])) for i in rows]
        if max(budgets) <= 0:
            for i in rows:
                out[i] = list(prompts[i])
            continue
        # Left padding for generation: every row's next token is then at the same column.
        longest = max(len(prompts[i]) for i in rows)
        input_ids = torch.full((len(rows), longest), ctx.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for j, i in enumerate(rows):
            input_ids[j, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[j, longest - len(prompts[i]):] = 1
        generated = model.generate(
            input_ids=input_ids.to(ctx.device), attention_mask=mask.to(ctx.device),
            max_new_tokens=max(budgets), min_new_tokens=0, do_sample=False, num_beams=1,
            temperature=None, top_p=None, top_k=None, pad_token_id=ctx.pad_id,
        )[:, longest:].cpu()
        for j, i in enumerate(rows):
            tokens = generated[j, :max(budgets[j], 0)].tolist()
            cut = next((k for k, token in enumerate(tokens) if token in eos_ids), len(tokens))
            out[i] = list(prompts[i]) + tokens[:cut]
    return out


def _eos_ids(model) -> set:
    ids = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(model.config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


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
                           max_positions=ctx.max_positions if spec.continue_tokens else None)
                entry = ctx.cache.load(f"expert.{spec.name}", key, _expert_shapes(prompt, ctx),
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


def _expert_shapes(prompt: List[List[int]], ctx: _Ctx) -> dict:
    n = len(prompt)
    return {"input_ids": ((n, None), torch.long), "lengths": ((n,), torch.long),
            "hidden": ((n, None, ctx.hidden_size), ctx.dtype), "entropy": ((n, None), torch.float32)}


def _check_continued(entry: dict, prompt: List[List[int]], spec: DomainCaptureSpec, ctx: _Ctx) -> None:
    """A stored expert entry must extend exactly the prompts, by at most continue_tokens each."""
    t = entry["input_ids"].shape[1]
    if entry["hidden"].shape[1] != t or entry["entropy"].shape[1] != t:
        raise ValueError("hidden/entropy length differs from input_ids")
    for row, n, p in zip(entry["input_ids"], entry["lengths"].tolist(), prompt):
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


def _pad(rows: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, T] ids and bool mask."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return input_ids, mask
