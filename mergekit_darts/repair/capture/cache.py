"""On-disk cache of captured tensors: one safetensors file per (model, domain) entry.

Entries are keyed by a content hash of the model's identity, the token ids, the dtype and
CAPTURE_VERSION, written atomically, and verified (key, tensor names, shapes, dtypes) before use:
a corrupt entry is logged and recomputed, never trusted.
"""

import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Callable, Dict, List, Optional

import torch

LOG = logging.getLogger(__name__)

# Bump when what is captured (or how it is stored) changes: old cache entries then stop matching.
CAPTURE_VERSION = 2
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mergekit_darts")


def model_identity(model_dir: str) -> dict:
    """What makes a model's outputs: its path, config.json content, and its weight files' sizes and
    mtimes (cheap; rewriting the weights changes the mtime, so a re-merge is never served stale).

    The parts a surgery export adds or renames (darts entries of config.json, darts.safetensors,
    the index, model.safetensors renamed to a shard: os.replace keeps size and mtime) are left out,
    so repairing a directory again reuses its capture.
    """
    with open(os.path.join(model_dir, "config.json"), "rb") as handle:
        config = json.loads(handle.read())
    for key in ("darts", "darts_domain", "auto_map", "architectures"):
        config.pop(key, None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    weights = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors") and name != "darts.safetensors":
            stat = os.stat(os.path.join(model_dir, name))
            weights.append([stat.st_size, stat.st_mtime_ns])
    return {"path": os.path.realpath(model_dir), "config": config_hash, "weights": sorted(weights)}


def cache_key(role: str, identity: dict, dtype: torch.dtype, ids: Optional[List[List[int]]] = None, **extra) -> str:
    parts = {"version": CAPTURE_VERSION, "role": role, "model": identity, "dtype": str(dtype), **extra}
    if ids is not None:
        parts["ids"] = hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class CaptureCache:
    """safetensors files named ``<label>.<key>.safetensors``; entries are verified before use."""

    def __init__(self, cache_dir: Optional[str]):
        self.dir = os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)

    def _path(self, label: str, key: str) -> str:
        return os.path.join(self.dir, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.{key}.safetensors")

    def load(self, label: str, key: str, expected: dict,
             extra_check: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
        """The entry's tensors, or None when absent or corrupt (logged: it will be recomputed).

        ``expected``: {name: (shape with None for "any", dtype)}."""
        path = self._path(label, key)
        if not os.path.exists(path):
            return None
        try:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                if (handle.metadata() or {}).get("key") != key:
                    raise ValueError("key in metadata does not match")
                missing = set(expected) - set(handle.keys())
                if missing:
                    raise ValueError(f"missing tensors {sorted(missing)}")
                entry = {name: handle.get_tensor(name) for name in expected}
            for name, (shape, dtype) in expected.items():
                tensor = entry[name]
                if tensor.dtype != dtype or tensor.dim() != len(shape) or any(
                    want is not None and want != got for want, got in zip(shape, tensor.shape)
                ):
                    raise ValueError(f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
            for name, tensor in entry.items():
                # a NaN/inf entry (bit rot, a diverged earlier capture) would poison training silently
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise ValueError(f"tensor {name!r} holds non-finite values")
            if extra_check is not None:
                extra_check(entry)
        except Exception as error:
            LOG.warning("capture cache: ignoring corrupt entry %s (%s); recomputing it", path, error)
            return None
        LOG.info("capture cache: hit %s", path)
        return entry

    def save(self, label: str, key: str, tensors: Dict[str, torch.Tensor]) -> None:
        """Write atomically (temp file + os.replace); a failed write only costs a recompute later."""
        from safetensors.torch import save_file

        path, tmp = self._path(label, key), None
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                      metadata={"key": key, "capture_version": str(CAPTURE_VERSION)})
            os.replace(tmp, path)
        except Exception as error:  # noqa: BLE001 - OSError, safetensors' SafetensorError (disk full), ...
            LOG.warning("capture cache: could not write %s (%s: %s); continuing from memory without caching it",
                        path, type(error).__name__, error)
            if tmp and os.path.exists(tmp):
                try:
                    os.remove(tmp)
                except OSError:
                    pass
