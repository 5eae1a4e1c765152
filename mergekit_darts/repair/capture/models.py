"""Loading one model at a time (``ModelSlot``) and finding its final norm and LM head without knowing
the architecture."""

import contextlib
import gc
import logging
import os
from typing import List, Optional, Tuple

import torch

from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.repair.capture.placement import Placement, read_weight

LOG = logging.getLogger(__name__)

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]


@contextlib.contextmanager
def quiet_transformers_loading(progress_bars: bool = True):
    """transformers at ERROR level around one of our own loads.

    Our loads of a repaired directory without its remote code (the capture wants the plain merge)
    make transformers print a LOAD REPORT listing every ``darts.*`` tensor as UNEXPECTED: expected
    and harmless here, but alarming to read. Real errors still raise. ``progress_bars=False`` also
    hides transformers' "Loading weights" bar (for local directories: the capture shows its own
    bars; a download from the Hub keeps its progress).
    """
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress_bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        if bars and not progress_bars:
            hf_logging.enable_progress_bar()


def release_freed_memory() -> None:
    """Hand the heap memory freed by a capture pass back to the OS (glibc ``malloc_trim``).

    A forward pass frees its activations, but glibc keeps most of that heap mapped (0.3 W on the
    benchmark's model, benchmarks/speed_memory/bench_capture_memory.py), and the next model's pass then runs on
    top of it. Elsewhere (no glibc) this does nothing."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


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


def model_sizes(model_dir: str, trust_remote_code: bool) -> Tuple[int, int]:
    """(hidden size, vocabulary size) from the config alone (no weights)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(config.hidden_size), int(config.vocab_size)


def decoders(model) -> List[torch.nn.Module]:
    found = []
    if hasattr(model, "get_decoder"):
        try:
            found.append(model.get_decoder())
        except Exception:  # some models raise for a missing decoder rule
            pass
    found.append(getattr(model, "model", None))
    return [d for d in found if isinstance(d, torch.nn.Module) and d is not model]


def final_norm(model) -> torch.nn.Module:
    """The module whose output feeds the LM head, found without knowing the architecture."""
    for decoder in decoders(model):
        for name in ("norm", "final_layernorm", "ln_f"):
            module = getattr(decoder, name, None)
            if isinstance(module, torch.nn.Module):
                return module
    raise SurgeryConfigError(
        f"{type(model).__name__}: cannot find the final norm (looked for get_decoder().norm, "
        ".final_layernorm, .ln_f and model.norm); DARTS needs a causal LM whose final norm feeds its LM head"
    )


def lm_head(model) -> torch.nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        raise SurgeryConfigError(f"{type(model).__name__}: has no LM head (get_output_embeddings() is None)")
    return head


class ModelSlot:
    """Loads a model on first use and frees it on ``free()``: the one model in memory. Placement
    (``device`` or ``device_map``/``max_memory`` with offload) and dtype come from the run's
    ``CaptureContext.slot``."""

    def __init__(self, model_dir: str, *, device: torch.device, dtype: torch.dtype, device_map=None,
                 max_memory: Optional[dict] = None, trust_remote_code: bool = False):
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.device_map, self.max_memory, self.trust_remote_code = device_map, max_memory, trust_remote_code
        self.model = None
        self.placement: Optional[Placement] = None

    def get(self):
        if self.model is None:
            from transformers import AutoModelForCausalLM

            placement = Placement(self.device, self.device_map, self.max_memory)
            LOG.info("capture: loading %s (%s on %s)", self.model_dir, self.dtype,
                     self.device_map if placement.sharded else self.device)
            self.placement = placement
            with quiet_transformers_loading(progress_bars=not os.path.isdir(self.model_dir)):
                model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=self.dtype, use_safetensors=True,
                    trust_remote_code=self.trust_remote_code,
                    **placement.load_kwargs(self.model_dir, self.trust_remote_code),
                )
            if not placement.sharded and next(model.parameters()).device != self.device:
                model = model.to(self.device)
            if placement.sharded:
                LOG.info("capture: %s placed as %s", self.model_dir, getattr(model, "hf_device_map", None))
            if hasattr(model, "set_darts_domain"):
                # a directory repaired before, loaded with remote code: capture the plain merge
                model.set_darts_domain("none")
            self.model = model.eval().requires_grad_(False)
        return self.model

    def head(self) -> torch.Tensor:
        """The LM head weight, on the cpu in the capture dtype."""
        return head_weight(lm_head(self.get())).to("cpu", self.dtype).clone()

    def free(self) -> None:
        if self.model is not None:
            self.model = None
            gc.collect()  # transformers models hold reference cycles; collect before the next load
            if self.device.type == "cuda" or (self.device_map is not None and torch.cuda.is_available()):
                torch.cuda.empty_cache()
            release_freed_memory()
        if self.placement is not None:
            self.placement.release()
            self.placement = None


def head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The LM head weight as a real tensor, also when accelerate offloaded it (then it is on meta)."""
    return read_weight(head, "weight")
