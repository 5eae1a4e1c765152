"""A model directory's safetensors weight files: headers (the one reader, guarded against damaged files),
the tensor -> file map, tensors read one at a time. Torch-free but for ``SafetensorsWeights.read``; below
``output/`` (the export, bake, info), ``repair/`` (``adapter_init: delta`` and the report's baseline read
expert and merge weights here) and ``preflight_weights`` (the experts' headers before the merge).

The darts entries of an earlier export (``darts.safetensors``, tensors named ``darts.*``) are never
part of the merged weights; ``output/layout.py`` re-exports these names as part of the output format.
"""

import json
import os
import struct
from typing import Dict, Iterable, List, Optional

from mergekit_darts.errors import FormatError

SINGLE_WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SINGLE_SHARD = "model-00001-of-00001.safetensors"  # what the export renames a single model.safetensors to
DARTS_SHARD = "darts.safetensors"
DARTS_TENSOR_PREFIX = "darts."


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


class DamagedWeights(FormatError):
    """A safetensors file that is not whole (a bad length field, a header that is not JSON, a file cut
    short): the message names the file, ``reason`` says what is wrong in words."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"weight file {path} is damaged: {reason}; download or copy it again")
        self.path, self.reason = path, reason


def safetensors_header(path: str) -> Dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors header (no tensor data read);
    ``DamagedWeights`` when the file is not whole. It trusts nothing in the file: a length field past the
    end is never read (it would read a whole shard into memory first)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise DamagedWeights(path, f"it has {size} bytes, fewer than the 8 of a safetensors header's length field")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:  # checked before reading: a bad length field must not read a whole shard
            raise DamagedWeights(path, f"its header length field says {length} bytes, past the end of the file "
                                       f"({size} bytes)")
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
            raise DamagedWeights(path, f"its header is not valid JSON ({type(error).__name__}: {error})") from None
    if not isinstance(header, dict):
        raise DamagedWeights(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            info["shape"] = [int(dim) for dim in info["shape"]]
            _, stop = info["data_offsets"]
            end = max(end, int(stop))
        except (TypeError, KeyError, ValueError):
            raise DamagedWeights(path, f"its header entry {name!r} has no valid shape and data_offsets") from None
    if 8 + length + end > size:
        raise DamagedWeights(path, f"it is truncated ({size} bytes, its header describes {8 + length + end})")
    return header


def tensor_bytes(header: dict) -> int:
    return sum(end - start for start, end in (info["data_offsets"] for info in header.values()))


def numel(header: dict) -> int:
    total = 0
    for info in header.values():
        count = 1
        for dim in info["shape"]:
            count *= dim
        total += count
    return total


def merged_weight_map(out_dir: str) -> Dict[str, str]:
    """Tensor name -> file of the merged weights only (darts entries of an earlier export dropped)."""
    if os.path.exists(os.path.join(out_dir, SINGLE_WEIGHTS)):
        return {name: SINGLE_SHARD for name in safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS))}
    if os.path.exists(os.path.join(out_dir, INDEX)):
        weight_map = read_json(os.path.join(out_dir, INDEX))["weight_map"]
        return {name: f for name, f in weight_map.items()
                if f != DARTS_SHARD and not name.startswith(DARTS_TENSOR_PREFIX)}
    raise FormatError(
        f"{out_dir}: no {SINGLE_WEIGHTS} or {INDEX}; mergekit-darts needs safetensors weights "
        "(run mergekit with safe serialization)"
    )


def names_ending(names: Iterable[str], suffix: str) -> List[str]:
    """Every name that is ``suffix`` or ends with ``.suffix``."""
    return [name for name in names if name == suffix or name.endswith("." + suffix)]


def unique_name_ending(names: Iterable[str], suffix: str) -> Optional[str]:
    """The one name that is ``suffix`` or ends with ``.suffix``; None when there is none or several."""
    found = names_ending(names, suffix)
    return found[0] if len(found) == 1 else None


def shard_path(model_dir: str, name: str) -> str:
    """The file of ``merged_weight_map``'s entry ``name`` (its single-file name is ``model.safetensors``
    until the export renames it)."""
    path = os.path.join(model_dir, name)
    if name == SINGLE_SHARD and not os.path.exists(path):
        return os.path.join(model_dir, SINGLE_WEIGHTS)  # a merge that was never exported, or any plain model
    return path


class SafetensorsWeights:
    """The weight tensors of a model directory by name, read one at a time (never the whole model)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        try:  # single file or index, darts entries of an earlier export left out
            weight_map = merged_weight_map(model_dir)
        except FormatError as error:
            raise FormatError(f"{error} (adapter_init: delta and the report's baseline read the weights)") from None
        self.files = {name: shard_path(model_dir, file) for name, file in weight_map.items()}

    def names_ending(self, suffix: str):
        """Every tensor whose name is ``suffix`` or ends with ``.suffix``."""
        return names_ending(self.files, suffix)

    def name_ending(self, suffix: str) -> str:
        """The one tensor whose name is ``suffix`` or ends with ``.suffix``."""
        found = self.names_ending(suffix)
        if len(found) != 1:
            what = "no tensor" if not found else f"{len(found)} tensors ({', '.join(sorted(found)[:3])})"
            raise FormatError(f"{self.model_dir}: {what} named like '*{suffix}'; adapter_init: delta needs the "
                              "expert and the merge to have the same architecture and tensor names")
        return found[0]

    def read(self, suffix: str):
        """The tensor named like ``*suffix``, as stored (a torch tensor)."""
        from safetensors import safe_open

        name = self.name_ending(suffix)
        with safe_open(self.files[name], framework="pt") as handle:
            return handle.get_tensor(name)
