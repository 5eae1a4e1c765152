"""Loading one model at a time and running it forward: the final-norm states, greedy continuations.

Used by the capture; the model's final norm and LM head are found without knowing the architecture.
"""

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from mergekit_darts.errors import DeviceError, SurgeryConfigError
from mergekit_darts.repair.losses import token_entropy
from mergekit_darts.repair.placement import Placement, input_device, read_weight

LOG = logging.getLogger(__name__)

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]


def resolve_device(device) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else as torch.device."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device: {device!r} was requested but CUDA is not available; use 'auto' or 'cpu'")
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


@contextlib.contextmanager
def quiet_transformers_loading():
    """transformers at ERROR level around one of our own loads.

    Our loads of a repaired directory without its remote code (the capture wants the plain merge)
    make transformers print a LOAD REPORT listing every ``darts.*`` tensor as UNEXPECTED: expected
    and harmless here, but alarming to read. Real errors still raise.
    """
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    max_positions: int
    trust_remote_code: bool
    progress: bool
    cache: object  # capture_cache.CaptureCache
    pad_id: int = 0
    hidden_size: Optional[int] = None  # the merged model's, which every expert must share
    vocab_size: Optional[int] = None
    device_map: object = None  # None (whole model on ``device``), "auto"/"balanced"/"sequential" or a dict
    max_memory: Optional[dict] = None  # accelerate's per-device limits, with ``device_map``


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
        self.placement: Optional[Placement] = None

    def get(self):
        if self.model is None:
            from transformers import AutoModelForCausalLM

            placement = Placement(self.ctx.device, self.ctx.device_map, self.ctx.max_memory)
            LOG.info("capture: loading %s (%s on %s)", self.model_dir, self.ctx.dtype,
                     self.ctx.device_map if placement.sharded else self.ctx.device)
            self.placement = placement
            with quiet_transformers_loading():
                model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=self.ctx.dtype, use_safetensors=True,
                    trust_remote_code=self.ctx.trust_remote_code,
                    **placement.load_kwargs(self.model_dir, self.ctx.trust_remote_code),
                )
            if not placement.sharded and next(model.parameters()).device != self.ctx.device:
                model = model.to(self.ctx.device)
            if placement.sharded:
                LOG.info("capture: %s placed as %s", self.model_dir, getattr(model, "hf_device_map", None))
            if hasattr(model, "set_darts_domain"):
                # a directory repaired before, loaded with remote code: capture the plain merge
                model.set_darts_domain("none")
            self.model = model.eval().requires_grad_(False)
        return self.model

    def head(self) -> torch.Tensor:
        return _head_weight(_lm_head(self.get())).to("cpu", self.ctx.dtype).clone()

    def free(self) -> None:
        if self.model is not None:
            self.model = None
            gc.collect()  # transformers models hold reference cycles; collect before the next load
            if self.ctx.device.type == "cuda" or (self.ctx.device_map is not None and torch.cuda.is_available()):
                torch.cuda.empty_cache()
        placement = getattr(self, "placement", None)
        if placement is not None:
            placement.release()
            self.placement = None


def _head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The LM head weight as a real tensor, also when accelerate offloaded it (then it is on meta)."""
    return read_weight(head, "weight")


@torch.no_grad()
def _forward_hidden(model, ids: List[List[int]], ctx: _Ctx, desc: str, with_entropy: bool):
    """Final-norm outputs for ``ids`` in batches: ([N, T, H] capture dtype, [N, T] float32 or None) on cpu."""
    norm, head = _final_norm(model), _lm_head(model)
    # read once per pass: an offloaded head would otherwise be loaded from disk for every batch
    head_weight = _head_weight(head) if with_entropy else None
    head_bias = read_weight(head, "bias") if with_entropy else None
    device = input_device(model, ctx.device)
    # Run only the decoder when it owns the norm: the LM head's [B, T, V] logits are not needed.
    runner = next((d for d in _decoders(model) if any(m is norm for m in d.modules())), model)
    captured: List[torch.Tensor] = []
    handle = norm.register_forward_hook(lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    longest = max(len(row) for row in ids)
    hidden = torch.zeros(len(ids), longest, ctx.hidden_size or head.weight.shape[1], dtype=ctx.dtype)
    entropy = torch.zeros(len(ids), longest, dtype=torch.float32) if with_entropy else None
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together: less padding
    try:
        for start in tqdm(range(0, len(order), ctx.batch_size), desc=desc, disable=not ctx.progress, leave=False):
            rows = order[start:start + ctx.batch_size]
            input_ids, mask = _pad([ids[i] for i in rows], ctx.pad_id)
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            captured.clear()
            runner(input_ids=input_ids.to(device), attention_mask=mask.long().to(device),
                   position_ids=position_ids.to(device), use_cache=False)
            states = captured[-1]
            batch_entropy = token_entropy(states, head_weight, head_bias) if with_entropy else None
            for j, i in enumerate(rows):
                n = len(ids[i])
                hidden[i, :n] = states[j, :n].to("cpu", ctx.dtype)
                if with_entropy:
                    entropy[i, :n] = batch_entropy[j, :n].cpu()
    finally:
        handle.remove()
    return hidden, entropy


@torch.no_grad()
def _continue(model, prompts: List[List[int]], n: int, ctx: _Ctx, eos_ids: set, desc: str,
              temperature: Optional[float] = None, seed: int = 0) -> List[List[int]]:
    """Each prompt + the model's greedy continuation: up to ``n`` tokens, stopping before EOS and
    at ``max_positions`` (so a continued sample is never truncated). With ``temperature`` the
    continuation is sampled (full distribution, no top-k/top-p) from torch's RNG seeded with
    ``seed``; the caller's RNG state is left as it was."""
    if temperature is None:
        return _continue_batches(model, prompts, n, ctx, eos_ids, desc, None)
    # every GPU: a model placed across devices (device_map) samples on the last one
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return _continue_batches(model, prompts, n, ctx, eos_ids, desc, temperature)


def _continue_batches(model, prompts, n, ctx, eos_ids, desc, temperature: Optional[float]) -> List[List[int]]:
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
        device = input_device(model, ctx.device)
        generated = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device),
            max_new_tokens=max(budgets), min_new_tokens=0, do_sample=temperature is not None, num_beams=1,
            # sampling is from the full distribution: no top-k/top-p from the model's generation_config
            temperature=temperature, top_p=None if temperature is None else 1.0,
            top_k=None if temperature is None else 0, pad_token_id=ctx.pad_id,
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



def _pad(rows: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, T] ids and bool mask."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return input_ids, mask
