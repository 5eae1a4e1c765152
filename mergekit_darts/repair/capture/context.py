"""One run's capture context: where and how every model of the run is loaded, and the cache.

Every model load of a run (the domains' merged and expert captures, the ``router_eval`` capture,
``depth``'s block inputs, the experts' continuations) goes through one ``CaptureContext``, so they all
see the same placement (``device`` or accelerate's ``device_map`` / ``max_memory`` with offload), the
same capture dtype, the merged model's tokenizer (all models see its ids) and the same on-disk cache.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mergekit_darts.errors import DeviceError, SurgeryConfigError
from mergekit_darts.repair.capture.cache import CaptureCache, cache_key, model_identity, tokenizer_identity
from mergekit_darts.repair.capture.models import ModelSlot, model_sizes, resolve_model_dir


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


@dataclass
class CaptureContext:
    """What every capture of one run shares. Build it with ``open`` (loads the merged tokenizer and
    config, never a model)."""

    merged_dir: str  # the merged model's local directory
    tokenizer: Any  # the merged model's tokenizer: every model sees its ids
    max_positions: int
    device: torch.device  # where results are computed (and the whole model, without device_map)
    dtype: torch.dtype  # the capture dtype of every model
    batch_size: int
    cache: CaptureCache
    trust_remote_code: bool
    progress: bool  # tqdm bars (stderr is a terminal)
    hidden_size: int  # the merged model's, which every expert must share
    vocab_size: int
    num_layers: int  # the merged model's decoder layers (depth's first adapted one is counted from it)
    pad_id: int = 0
    device_map: Any = None  # None (whole model on ``device``), "auto"/"balanced"/"sequential" or a dict
    max_memory: Optional[dict] = None  # accelerate's per-device limits, with ``device_map``
    tokenizer_hash: str = ""  # the merged tokenizer's files, part of every cache key
    identities: dict = field(default_factory=dict, repr=False)  # model dir -> model_identity, this run's
    lines: bool = False  # stderr is a log file: a long loop prints a line every few seconds instead of a bar

    @classmethod
    def open(cls, merged_path: str, max_positions: int, *, dtype="auto", device="auto", batch_size: int = 8,
             cache_dir: Optional[str] = None, trust_remote_code: bool = False, progress: bool = True,
             device_map=None, max_memory: Optional[dict] = None, lines: bool = False) -> "CaptureContext":
        from transformers import AutoConfig, AutoTokenizer

        if max_positions <= 0 or batch_size <= 0:
            raise ValueError(f"max_positions ({max_positions}) and batch_size ({batch_size}) must be positive")
        device = resolve_device(device)
        merged_dir = resolve_model_dir(merged_path)
        tokenizer = AutoTokenizer.from_pretrained(merged_dir, trust_remote_code=trust_remote_code)
        hidden_size, vocab_size = model_sizes(merged_dir, trust_remote_code)
        config = AutoConfig.from_pretrained(merged_dir, trust_remote_code=trust_remote_code)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(merged_dir=merged_dir, tokenizer=tokenizer, max_positions=max_positions, device=device,
                   dtype=resolve_dtype(dtype, device), batch_size=batch_size, cache=CaptureCache(cache_dir),
                   trust_remote_code=trust_remote_code, progress=progress, hidden_size=hidden_size,
                   vocab_size=vocab_size, num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
                   pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                   device_map=device_map, max_memory=max_memory, tokenizer_hash=tokenizer_identity(merged_dir),
                   lines=lines)

    def key(self, role: str, model_dir: str, ids=None, **extra) -> str:
        """The cache key of an entry of ``model_dir``: its content, the merged tokenizer, ``ids``, the
        capture dtype and ``extra`` (e.g. the generation settings used)."""
        if model_dir not in self.identities:
            self.identities[model_dir] = model_identity(model_dir, self.cache.hashes)
        return cache_key(role, self.identities[model_dir], self.dtype, ids=ids, tokenizer=self.tokenizer_hash, **extra)

    def slot(self, model_dir: str) -> ModelSlot:
        """The one-model-in-memory slot of ``model_dir``, loaded with this run's placement and dtype."""
        return ModelSlot(model_dir, device=self.device, dtype=self.dtype, device_map=self.device_map,
                         max_memory=self.max_memory, trust_remote_code=self.trust_remote_code)


def open_run_context(out_path: str, surgery, settings) -> CaptureContext:
    """The one capture context of a run (``surgery``: its SurgeryConfig, ``settings``: its RunSettings):
    every model load (domains, router_eval, depth) goes through it."""
    return CaptureContext.open(
        out_path, surgery.max_positions, dtype=settings.dtype, device=settings.device,
        batch_size=surgery.capture_batch_size, cache_dir=surgery.cache_dir,
        trust_remote_code=settings.trust_remote_code, progress=settings.progress,
        device_map=surgery.device_map, max_memory=surgery.max_memory, lines=settings.stage_lines,
    )
