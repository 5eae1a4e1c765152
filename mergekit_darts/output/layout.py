"""The output directory's format, defined once (docs/design.md §5): file names, ``config.json`` keys,
the reserved domain names, and how to read a directory's darts entry.

Torch-free on purpose: ``info``, ``report``, ``eval`` and the pre-merge checks use it without loading
a model. The shipped ``remote_code`` files cannot import it (they may import only torch and
transformers); the constants they repeat are checked against these by the tests.
"""

import json
import os
from typing import Dict, Optional

from mergekit_darts.errors import FormatError
# the weight files' names and readers live below output/ and repair/ (both read model weights);
# they are part of the output format, so this module names them too
from mergekit_darts.weight_files import (  # noqa: F401 - re-exported
    DARTS_SHARD, DARTS_TENSOR_PREFIX, INDEX, SINGLE_SHARD, SINGLE_WEIGHTS, merged_weight_map, numel, read_json,
    safetensors_header, shard_path, tensor_bytes,
)

# config.json keys
DARTS_KEY = "darts"  # the correction's description (see ``darts_entry``)
DOMAIN_KEY = "darts_domain"  # the domain active when the directory is loaded
NONE_DOMAIN = "none"  # the plain merged model
AUTO_DOMAIN = "auto"  # routed per prompt by the router (docs/routing.md)
ROUTER_NAME = "router"  # the router's tensors are darts.router.*, its settings config.darts["router"]
RESERVED_DOMAINS = (NONE_DOMAIN, AUTO_DOMAIN, ROUTER_NAME)
ARCH_PREFIX = "Darts"  # DartsLlamaForCausalLM wraps LlamaForCausalLM
# files
MODELING_FILES = ("modeling_darts.py", "surgery.py", "blocks.py", "routing.py", "hooks.py", "generation.py")  # copied from mergekit_darts/remote_code
REPORT = "darts_report.json"
PLOT = "darts_bias.png"
CARD = "README.md"
STAGING_PREFIX = ".darts-staging-"

# plain architectures the emitted classes wrap (remote_code/modeling_darts.py: DARTS_CLASSES, tested equal)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Phi3ForCausalLM",
)


def write_json(path: str, data: dict) -> None:
    # allow_nan=False: a NaN would make the file invalid JSON for every other reader
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False, allow_nan=False)
        handle.write("\n")


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        return read_json(path)
    except FileNotFoundError:
        raise FormatError(f"{model_dir}: no config.json; not a model directory") from None
    except ValueError as error:
        raise FormatError(f"{path}: not valid JSON ({error})") from None


def is_darts_dir(model_dir: str) -> bool:
    """True when ``model_dir/config.json`` carries a darts entry (a repaired merge)."""
    try:
        return isinstance(read_config(model_dir).get(DARTS_KEY), dict)
    except FormatError:
        return False


def read_darts_entry(model_dir: str) -> dict:
    """The ``darts`` entry of ``model_dir/config.json``; FormatError for a plain directory."""
    entry = read_config(model_dir).get(DARTS_KEY)
    if not isinstance(entry, dict):
        raise FormatError(
            f"{model_dir}: config.json has no '{DARTS_KEY}' entry; not a mergekit-darts output directory"
        )
    return entry


# the module shape's description in config.darts (remote_code/surgery.py: FORMAT_VERSION and
# _SHAPE_KEYS, tested equal; read_shape is SurgeryShape.from_meta without torch, tested to agree)
SHAPE_FORMAT_VERSION = 3
SHAPE_KEYS = ("method", "rank", "head_rank", "max_positions", "content", "depth", "depth_rank")


def read_shape(meta: dict) -> dict:
    """The shape keys of a darts entry, upgraded from older format versions, plus its
    ``format_version``; ValueError for an unknown version or a missing key (no silent defaults)."""
    if not isinstance(meta, dict):
        raise ValueError(f"config.darts: expected a mapping, got {type(meta).__name__}")
    version = meta.get("format_version", 1)
    # the same rules as remote_code/surgery.py's SurgeryShape.from_meta (kept apart: this module is torch-free)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(
            f"config.darts.format_version: must be an integer, got {version!r} ({type(version).__name__}); "
            "config.json was edited or written by another tool: restore the number mergekit-darts wrote")
    if version == 1:  # mergekit-darts 0.1.x: ReLU content was the only kind
        meta = {**meta, "content": "relu"}
    if version in (1, 2):  # before depth existed: the final state only
        meta = {**meta, "depth": 0, "depth_rank": 0}
    elif version != SHAPE_FORMAT_VERSION:
        raise ValueError(
            f"config.darts.format_version {version!r} is not supported by this mergekit-darts "
            f"(it reads versions 1 to {SHAPE_FORMAT_VERSION}); upgrade mergekit-darts"
        )
    missing = [key for key in SHAPE_KEYS if key not in meta]
    if missing:
        raise ValueError(f"config.darts: missing {', '.join(missing)}; the directory was not written by mergekit-darts")
    return {**{key: meta[key] for key in SHAPE_KEYS}, "format_version": version}


def darts_entry(shape_meta: dict, loss: str, domains: Dict[str, str], package_version: str,
                extra: Optional[dict] = None) -> dict:
    """The ``config.json`` darts entry: the module shape (``SurgeryShape.to_meta``), the training loss,
    the domains (name -> expert) and the package version that wrote it."""
    entry = {**shape_meta, "loss": loss, "domains": dict(domains), "version": package_version}
    entry.update(extra or {})
    return entry


def read_router_entry(model_dir: str) -> Optional[dict]:
    """The router's settings (``config.darts["router"]``), or None for a directory without a router
    (every directory written before routing existed)."""
    entry = read_darts_entry(model_dir).get(ROUTER_NAME)
    if entry is not None and not isinstance(entry, dict):
        raise FormatError(f"{model_dir}: config.json darts.{ROUTER_NAME} is not a mapping")
    return entry


def darts_tensor_name(domain: str, param: str) -> str:
    return f"{DARTS_TENSOR_PREFIX}{domain}.{param}"


def plain_architecture(config: dict) -> str:
    """The merged model's own architecture name, also for a directory that was exported before."""
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch and arch.startswith(ARCH_PREFIX) and arch[len(ARCH_PREFIX):] in SUPPORTED_ARCHITECTURES:
        arch = arch[len(ARCH_PREFIX):]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FormatError(
            f"architecture {arch!r} is not supported by mergekit-darts; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def plain_config(config: dict) -> dict:
    """``config`` with every Darts addition removed (what mergekit wrote)."""
    plain = {k: v for k, v in config.items() if k not in (DARTS_KEY, DOMAIN_KEY)}
    plain["architectures"] = [plain_architecture(config)]
    auto_map = {k: v for k, v in (config.get("auto_map") or {}).items() if not str(v).startswith("modeling_darts.")}
    if auto_map:
        plain["auto_map"] = auto_map
    else:
        plain.pop("auto_map", None)
    return plain


def merged_parameter_count(out_dir: str) -> int:
    """Parameters of the merged weights (darts tensors excluded), from the safetensors headers."""
    total = 0
    for name in set(merged_weight_map(out_dir).values()):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path) and name == SINGLE_SHARD:
            path = os.path.join(out_dir, SINGLE_WEIGHTS)
        total += numel(safetensors_header(path))
    return total
