"""Is a directory one that ``info``, ``bake``, ``export-peft``, ``eval``, ``report`` and ``push`` can
read? Checked before any of them loads anything, so each problem is one line naming the file and what
to do (docs/reliability.md), never a traceback from deep inside a loader.

Torch-free: reads only file names, JSON and safetensors headers.
"""

import json
import os
from typing import Optional

from mergekit_darts.errors import FormatError
from mergekit_darts.output.layout import (DARTS_KEY, INDEX, MODELING_FILES, SINGLE_WEIGHTS, read_config,
                                          read_darts_entry, read_json, read_shape, safetensors_header)
from mergekit_darts.weight_files import DamagedWeights

RERUN = "rerun `mergekit-darts surgery CONFIG_FILE OUT` (or `mergekit-yaml`) to rewrite it"


def shard_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a complete safetensors file (None when it is): ``safetensors_header``'s checks
    (length field, JSON, data length) and the darts tensors' dtype."""
    try:
        header = safetensors_header(path)
    except DamagedWeights as error:
        return error.reason
    except OSError as error:
        return f"unreadable ({type(error).__name__}: {error})"
    for name, info in header.items():  # transformers would cast them to float32 silently (int32 0.3 -> 0)
        if name.startswith("darts.") and info.get("dtype") != "F32":
            return f"{name} is stored as {info.get('dtype')}, but every darts tensor is float32 (F32)"
    return None


def check_directory(path: str, what: str = "OUT_PATH") -> None:
    """``path`` exists, is a directory and holds a config.json."""
    if not os.path.exists(path):
        raise FormatError(f"{what} {path}: no such directory; give the directory mergekit-yaml wrote")
    if not os.path.isdir(path):
        raise FormatError(f"{what} {path}: is a file, not a directory; give the directory mergekit-yaml wrote")
    if not os.listdir(path):
        raise FormatError(f"{what} {path}: the directory is empty (no model was written there); give the "
                          "directory mergekit-yaml wrote")
    read_config(path)  # FormatError: no config.json / not valid JSON


def check_weights(path: str) -> None:
    """The merged weights are there: model.safetensors, or every shard its index names, complete."""
    single = os.path.join(path, SINGLE_WEIGHTS)
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise FormatError(f"{index}: unreadable ({type(error).__name__}: {error}); {RERUN}") from None
    elif os.path.isfile(single):
        shards = [SINGLE_WEIGHTS]
    else:
        raise FormatError(f"{path}: no {SINGLE_WEIGHTS} or {INDEX}; the weights are missing (copy them back, "
                          "or merge again)")
    for shard in shards:
        shard_path = os.path.join(path, shard)
        if not os.path.isfile(shard_path):
            raise FormatError(f"{path}: {INDEX} names {shard}, which is missing; copy it back, or {RERUN}")
        problem = shard_problem(shard_path)
        if problem:
            raise FormatError(f"{shard_path}: {problem}; copy it back, or {RERUN}")


def check_output_dir(path: str, *, darts: bool = True, code: bool = False, weights: bool = True,
                     what: str = "OUT_PATH") -> Optional[dict]:
    """Raise FormatError (one line) unless ``path`` is a readable model directory; with ``darts`` a
    mergekit-darts output whose ``config.darts`` this version reads (a newer format version is named),
    with ``code`` also holding the model code that trust_remote_code runs. Returns the darts entry."""
    check_directory(path, what)
    entry = None
    if darts:
        try:
            entry = read_darts_entry(path)
        except FormatError:
            raise FormatError(f"{what} {path}: config.json has no '{DARTS_KEY}' entry: a plain model directory, not a "
                              "mergekit-darts output (run mergekit-yaml with a surgery: block, or mergekit-darts "
                              "surgery, first)") from None
        try:
            read_shape(entry)  # a newer format version, a missing key: named before anything loads it
        except ValueError as error:
            raise FormatError(f"{path}/config.json: {error}") from None
        if "darts_domain" in (config := read_config(path)) and not isinstance(config["darts_domain"], str):
            raise FormatError(f"{path}/config.json: darts_domain is {json.dumps(config['darts_domain'])}, not a domain "
                              "name; set it to one of the domains or \"none\" (the plain merged model)")
    if weights:
        check_weights(path)
    if code:
        absent = [name for name in MODELING_FILES if not os.path.isfile(os.path.join(path, name))]
        if absent:
            raise FormatError(f"{path}: the model code ({', '.join(absent)}) is missing, so trust_remote_code loading "
                              f"fails; {RERUN}")
    return entry
