"""On-disk cache of captured tensors: one safetensors file per (model, domain) entry.

Entries are keyed by content: a hash of the model's weight files (``FileHashes``: computed once per
file and memoized per (device, inode, size, mtime, ctime), so hard links of one merge share it),
its config, the merged tokenizer, the calibration token ids, the generation settings actually
used, the dtype and CAPTURE_VERSION. They are written atomically with a checksum of their tensors,
and verified (key, checksum, tensor names, shapes, dtypes, finite values) before use: a corrupt entry
is one warning line and a recompute, never trusted.
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
# 3: content-keyed models and tokenizer, generation settings in the key, a checksum per entry.
CAPTURE_VERSION = 3
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mergekit_darts")
HASH_MEMO = "file_hashes.json"
# what a surgery export adds or changes in config.json: left out, so a repaired directory keeps its identity
_EXPORT_CONFIG_KEYS = ("darts", "darts_domain", "auto_map", "architectures")
_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                    "chat_template.jinja", "chat_template.json")


class FileHashes:
    """sha256 of files' contents, memoized in ``<cache dir>/file_hashes.json`` per (device, inode,
    size, mtime_ns, ctime_ns): a file is read once and its hard links are not read again; rewriting
    it makes it be read again. The ctime is in the key because the mtime can be set back
    (``os.utime``, ``touch -d``, ``rsync -t --inplace``) after an in-place edit of the same size;
    the ctime cannot be set from user space, and a new link or a rename changes it too (one more read)."""

    def __init__(self, cache_dir: str):
        self.path = os.path.join(cache_dir, HASH_MEMO)
        self.memo: Optional[Dict[str, str]] = None

    def _load(self) -> Dict[str, str]:
        if self.memo is None:
            try:
                with open(self.path, encoding="utf-8") as handle:
                    self.memo = dict(json.load(handle))
            except (OSError, ValueError, TypeError):
                self.memo = {}
        return self.memo

    def digest(self, path: str) -> str:
        stat = os.stat(path)
        stamp = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
        memo = self._load()
        if stamp not in memo:
            sha = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    sha.update(block)
            memo[stamp] = sha.hexdigest()
            self._save()
            LOG.info("capture cache: hashed %s", path)
        return memo[stamp]

    def _save(self) -> None:
        # a lost update (two runs at once) only costs a re-hash later
        tmp = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.memo, handle)
            os.replace(tmp, self.path)
        except OSError as error:
            LOG.warning("capture cache: could not write %s (%s); file hashes will be computed again", self.path, error)
            if tmp and os.path.exists(tmp):
                os.remove(tmp)


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_identity(model_dir: str, hashes: FileHashes) -> dict:
    """What makes a model's outputs, by content: config.json (without what a surgery export adds) and
    the contents of its weight files (not their names: the export renames ``model.safetensors`` to a
    shard; not ``darts.safetensors``, which the plain model never reads)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as handle:
        config = json.loads(handle.read())
    for key in _EXPORT_CONFIG_KEYS:
        config.pop(key, None)
    weights = sorted(hashes.digest(os.path.join(model_dir, name)) for name in os.listdir(model_dir)
                     if name.endswith(".safetensors") and name != "darts.safetensors")
    return {"config": _sha(config), "weights": weights}


def tokenizer_identity(model_dir: str) -> str:
    """A hash of the tokenizer files' contents (names included: they say what each file is)."""
    parts = []
    for name in sorted(os.listdir(model_dir)):
        if name.startswith("tokenizer") or name in _TOKENIZER_FILES or name.endswith((".tiktoken", ".model")):
            with open(os.path.join(model_dir, name), "rb") as handle:
                parts.append([name, hashlib.sha256(handle.read()).hexdigest()])
    return _sha(parts)


def cache_key(role: str, identity: dict, dtype: torch.dtype, ids: Optional[List[List[int]]] = None, **extra) -> str:
    parts = {"version": CAPTURE_VERSION, "role": role, "model": identity, "dtype": str(dtype), **extra}
    if ids is not None:
        parts["ids"] = hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
    return _sha(parts)


def tensors_checksum(tensors: Dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (in name order)."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        sha.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        if tensor.numel():
            sha.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return sha.hexdigest()


class CaptureCache:
    """safetensors files named ``<label>.<key>.safetensors``; entries are verified before use."""

    def __init__(self, cache_dir: Optional[str]):
        self.dir = os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)
        self.hashes = FileHashes(self.dir)

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
                metadata = handle.metadata() or {}
                if metadata.get("key") != key:
                    raise ValueError("key in metadata does not match")
                missing = set(expected) - set(handle.keys())
                if missing:
                    raise ValueError(f"missing tensors {sorted(missing)}")
                stored = {name: handle.get_tensor(name) for name in handle.keys()}
            entry = {name: stored[name] for name in expected}
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
            # last: the specific findings above say more than a mismatch does
            if metadata.get("checksum") != tensors_checksum(stored):
                raise ValueError("checksum mismatch: the stored tensors changed after they were written")
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
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            save_file(tensors, tmp, metadata={"key": key, "capture_version": str(CAPTURE_VERSION),
                                              "checksum": tensors_checksum(tensors)})
            os.replace(tmp, path)
        except Exception as error:  # noqa: BLE001 - OSError, safetensors' SafetensorError (disk full), ...
            LOG.warning("capture cache: could not write %s (%s: %s); continuing from memory without caching it",
                        path, type(error).__name__, error)
            if tmp and os.path.exists(tmp):
                try:
                    os.remove(tmp)
                except OSError:
                    pass
