"""Write trained surgery modules into a mergekit output directory (DESIGN §5).

The merged weight bytes are never rewritten: a single ``model.safetensors`` is only renamed into a
one-shard index, and the surgery tensors go to their own shard ``darts.safetensors``. Everything is
staged in a temporary folder inside ``out_dir`` and switched in with ``os.replace`` in an order that
keeps the directory a loadable plain merged model at every step; ``config.json`` claiming the Darts
architecture is written last, once weights, index and modeling files are in place.
"""

import json
import os
import re
import shutil
import struct
import tempfile
from typing import Dict, Optional

import torch
from safetensors.torch import save_file

from . import __version__
from .modeling_darts import DARTS_CLASSES
from .surgery import DomainSurgery

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MODELING_FILES = ("modeling_darts.py", "surgery.py")
# plain architectures that modeling_darts.py wraps: one list, owned by the model file
SUPPORTED_ARCHITECTURES = tuple(DARTS_CLASSES)
DARTS_PREFIX = "Darts"
SINGLE_WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SINGLE_SHARD = "model-00001-of-00001.safetensors"
DARTS_SHARD = "darts.safetensors"
REPORT = "darts_report.json"
STAGING_PREFIX = ".darts-staging-"
CARD_BEGIN = "<!-- mergekit-darts:begin -->"
CARD_END = "<!-- mergekit-darts:end -->"
_CARD_SECTION = re.compile(re.escape(CARD_BEGIN) + r".*?" + re.escape(CARD_END) + r"\n?", re.S)


# ---------------------------------------------------------------------------------------------- helpers

def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")


def safetensors_header(path: str) -> Dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors header (no tensor data read)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def _tensor_bytes(header: dict) -> int:
    return sum(end - start for start, end in (info["data_offsets"] for info in header.values()))


def _numel(header: dict) -> int:
    total = 0
    for info in header.values():
        count = 1
        for dim in info["shape"]:
            count *= dim
        total += count
    return total


def plain_architecture(config: dict) -> str:
    """The merged model's own architecture name, also for a directory that was exported before."""
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch and arch.startswith(DARTS_PREFIX) and arch[len(DARTS_PREFIX):] in SUPPORTED_ARCHITECTURES:
        arch = arch[len(DARTS_PREFIX):]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported by mergekit-darts; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def plain_config(config: dict) -> dict:
    """``config`` with every Darts addition removed (what mergekit wrote)."""
    plain = {k: v for k, v in config.items() if k not in ("darts", "darts_domain")}
    plain["architectures"] = [plain_architecture(config)]
    auto_map = {k: v for k, v in (config.get("auto_map") or {}).items() if not str(v).startswith("modeling_darts.")}
    if auto_map:
        plain["auto_map"] = auto_map
    else:
        plain.pop("auto_map", None)
    return plain


def _weight_map(out_dir: str) -> Dict[str, str]:
    """Tensor name -> file of the merged weights only (darts entries of an earlier export dropped)."""
    if os.path.exists(os.path.join(out_dir, SINGLE_WEIGHTS)):
        return {name: SINGLE_SHARD for name in safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS))}
    if os.path.exists(os.path.join(out_dir, INDEX)):
        weight_map = _read_json(os.path.join(out_dir, INDEX))["weight_map"]
        return {name: f for name, f in weight_map.items() if f != DARTS_SHARD and not name.startswith("darts.")}
    raise FileNotFoundError(
        f"{out_dir}: no {SINGLE_WEIGHTS} or {INDEX}; mergekit-darts needs safetensors weights "
        "(run mergekit with safe serialization)"
    )


def _check_modules(modules: Dict[str, DomainSurgery], darts_meta: dict, config: dict, default_domain: str):
    domains = dict(darts_meta.get("domains") or {})
    if not modules:
        raise ValueError("modules: no surgery modules to export")
    if "none" in modules:
        raise ValueError("domain name 'none' is reserved: it selects the plain merged model")
    if set(modules) != set(domains):
        raise ValueError(f"darts_meta.domains {sorted(domains)} does not match the modules {sorted(modules)}")
    if default_domain != "none" and default_domain not in modules:
        raise ValueError(f"default_domain: unknown domain {default_domain!r}; choose one of {[*modules, 'none']}")
    expected = {
        "hidden_size": config.get("hidden_size"),
        "rank": darts_meta.get("rank", 16),
        "max_positions": darts_meta.get("max_positions", 512),
        "method": darts_meta.get("method", "darts"),
        "head_rank": darts_meta.get("head_rank", 0) or 0,
    }
    for name, module in modules.items():
        for key, value in expected.items():
            if getattr(module, key) != value:
                raise ValueError(
                    f"domain {name!r}: module {key}={getattr(module, key)!r}, but the model needs {value!r}"
                )
        if module.head_rank and module.vocab_size != config.get("vocab_size"):
            raise ValueError(
                f"domain {name!r}: head vocab {module.vocab_size} != model vocab {config.get('vocab_size')}"
            )


def darts_tensors(modules: Dict[str, DomainSurgery]) -> Dict[str, torch.Tensor]:
    """``darts.<domain>.<param>`` -> float32 contiguous CPU tensor (the Darts model's state-dict keys)."""
    return {
        f"darts.{domain}.{key}": value.detach().to("cpu", torch.float32).contiguous()
        for domain, module in modules.items()
        for key, value in module.state_dict().items()
    }


# ---------------------------------------------------------------------------------------------- card

def _fmt(value, digits=4):
    return "–" if value is None else (f"{value:.{digits}g}" if isinstance(value, float) else str(value))


def card_section(arch: str, darts_meta: dict, default_domain: str, report: Optional[dict],
                 added: int, merged: int) -> str:
    domains = darts_meta["domains"]
    by_domain = (report or {}).get("domains", {})
    method = darts_meta.get("method", "darts")
    detail = f"content correction of rank {darts_meta.get('rank', 16)}"
    if method == "darts":
        detail += f" + per-position bias over {darts_meta.get('max_positions', 512)} positions"
    if darts_meta.get("head_rank"):
        detail += f" + logit correction of rank {darts_meta['head_rank']}"
    lines = [
        CARD_BEGIN,
        "## Representation surgery",
        "",
        "This merge carries per-domain representation surgery modules (DARTS, added by "
        "[mergekit-darts](https://pypi.org/project/mergekit-darts/)): each corrects the merged model's "
        "final hidden state towards its domain's expert before the LM head.",
        "",
        f"- Method: `{method}` ({detail})",
        f"- Loss: `{darts_meta.get('loss', 'ewl1')}`",
        f"- Added parameters: {added:,} ({100.0 * added / max(merged, 1):.3f}% of the merged model's {merged:,})",
        f"- Default domain: `{default_domain}`",
        "",
        "| Domain | Expert | Calibration (train / held-out) | Final loss | Held-out bias before → after "
        "| Held-out KL to expert before → after |",
        "|---|---|---|---|---|---|",
    ]
    for name, expert in domains.items():
        info = by_domain.get(name, {})
        calib = info.get("calibration") or {}
        bias = info.get("bias") or {}
        sizes = f"{_fmt(calib.get('train'))} / {_fmt(calib.get('held_out'))}" if calib else "–"
        change = f"{_fmt(bias.get('mean_before'))} → {_fmt(bias.get('mean_after'))}" if bias else "–"
        kl = info.get("held_out_kl") or {}
        kl_change = f"{_fmt(kl.get('before'))} → {_fmt(kl.get('after'))}" if kl else "–"
        lines.append(f"| `{name}` | {expert} | {sizes} | {_fmt(info.get('final_loss'))} | {change} | {kl_change} |")
    example = next(iter(domains))
    lines += [
        "",
        "Load with the correction (the domain is chosen at load time or switched at run time):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this-model", trust_remote_code=True)',
        'model = AutoModelForCausalLM.from_pretrained(',
        f'    "path/to/this-model", trust_remote_code=True, darts_domain="{example}"',
        ")",
        'model.set_darts_domain("none")  # the plain merged model',
        "```",
        "",
        "lm-evaluation-harness: `--model hf --model_args "
        f"pretrained=path/to/this-model,trust_remote_code=True,darts_domain={example}`. "
        f"Without `trust_remote_code` the directory loads as the plain merged `{arch}`.",
        CARD_END,
        "",
    ]
    return "\n".join(lines)


def _updated_card(out_dir: str, section: str) -> str:
    path = os.path.join(out_dir, "README.md")
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    text = _CARD_SECTION.sub("", text).rstrip("\n")
    return (text + "\n\n" if text else "") + section


# ---------------------------------------------------------------------------------------------- export

def export_surgery(
    out_dir: str,
    modules: Dict[str, DomainSurgery],
    darts_meta: dict,
    default_domain: str,
    report: Optional[dict] = None,
    extra_files: Optional[Dict[str, str]] = None,
) -> None:
    """Add the surgery ``modules`` (domain -> DomainSurgery) to the merged model in ``out_dir``.

    ``darts_meta`` becomes ``config.darts``; ``default_domain`` (a domain or "none") ``config.darts_domain``.
    ``report`` is written to darts_report.json and summarised in the model card; ``extra_files``
    (name -> source path) are copied in. Running it again replaces the previous surgery entirely.
    """
    config_path = os.path.join(out_dir, "config.json")
    config = _read_json(config_path)
    arch = plain_architecture(config)
    darts_meta = {**darts_meta, "domains": dict(darts_meta.get("domains") or {})}
    darts_meta.setdefault("version", __version__)
    _check_modules(modules, darts_meta, config, default_domain)
    for name, source in (extra_files or {}).items():
        if os.path.basename(name) != name or not os.path.isfile(source):
            raise ValueError(f"extra_files: {name!r} must be a plain file name with an existing source ({source!r})")

    merged_map = _weight_map(out_dir)
    single = os.path.exists(os.path.join(out_dir, SINGLE_WEIGHTS))
    if single:
        merged_bytes = _tensor_bytes(safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS)))
        merged_params = _numel(safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS)))
        old_index = {"metadata": {}}
    else:
        headers = [safetensors_header(os.path.join(out_dir, f)) for f in sorted(set(merged_map.values()))]
        merged_bytes = sum(_tensor_bytes(h) for h in headers)
        merged_params = sum(_numel(h) for h in headers)
        old_index = _read_json(os.path.join(out_dir, INDEX))
    tensors = darts_tensors(modules)
    added = sum(t.numel() for t in tensors.values())

    for leftover in os.listdir(out_dir):  # from an export that was killed before its cleanup
        if leftover.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(out_dir, leftover), ignore_errors=True)
    stage = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    try:
        staged = lambda name: os.path.join(stage, name)  # noqa: E731
        target = lambda name: os.path.join(out_dir, name)  # noqa: E731

        save_file(tensors, staged(DARTS_SHARD), metadata={"format": "pt"})
        metadata = {k: v for k, v in (old_index.get("metadata") or {}).items() if k != "total_size"}
        metadata["total_size"] = merged_bytes + sum(t.numel() * 4 for t in tensors.values())
        weight_map = {**merged_map, **{name: DARTS_SHARD for name in tensors}}
        _write_json(staged(INDEX), {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
        _write_json(staged("plain_index.json"), {"metadata": old_index.get("metadata") or {}, "weight_map": merged_map})
        _write_json(staged("plain_config.json"), plain_config(config))
        for name in MODELING_FILES:
            shutil.copyfile(os.path.join(PACKAGE_DIR, name), staged(name))
        if report is not None:
            _write_json(staged(REPORT), report)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staged(name))
        section = card_section(arch, darts_meta, default_domain, report, added, merged_params)
        with open(staged("README.md"), "w", encoding="utf-8") as handle:
            handle.write(_updated_card(out_dir, section))
        darts_config = {**plain_config(config), "darts": darts_meta, "darts_domain": default_domain}
        darts_config["architectures"] = [DARTS_PREFIX + arch]
        darts_config["auto_map"] = {
            **(darts_config.get("auto_map") or {}),
            "AutoModelForCausalLM": f"modeling_darts.{DARTS_PREFIX}{arch}",
        }
        _write_json(staged("config.json"), darts_config)

        # The switch. After every single os.replace the directory loads as a plain merged model.
        # 1. an earlier export: first back to a plain config and an index without darts entries
        if "darts" in config or config.get("architectures") != [arch]:
            os.replace(staged("plain_config.json"), config_path)
        if not single:
            os.replace(staged("plain_index.json"), target(INDEX))
        # 2. the darts shard, then the index naming it (ignored while model.safetensors exists)
        os.replace(staged(DARTS_SHARD), target(DARTS_SHARD))
        os.replace(staged(INDEX), target(INDEX))
        # 3. model.safetensors -> a shard of the index (a rename: the bytes stay as mergekit wrote them)
        if single:
            os.replace(target(SINGLE_WEIGHTS), target(SINGLE_SHARD))
        # 4. modeling code, report, extra files, card; a stale report of an earlier export goes
        for name in (*MODELING_FILES, *(extra_files or {}), "README.md"):
            os.replace(staged(name), target(name))
        if report is not None:
            os.replace(staged(REPORT), target(REPORT))
        elif os.path.exists(target(REPORT)):
            os.remove(target(REPORT))
        # 5. last: the config that claims the Darts architecture
        os.replace(staged("config.json"), config_path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- info

def read_darts_info(out_dir: str) -> dict:
    """Summary of a Darts output directory for ``mergekit-darts info``: domains, experts, parameter
    counts and the report's per-domain numbers."""
    config = _read_json(os.path.join(out_dir, "config.json"))
    meta = config.get("darts")
    if not meta:
        raise ValueError(f"{out_dir}: config.json has no 'darts' entry; not a mergekit-darts output directory")
    shard = os.path.join(out_dir, DARTS_SHARD)
    header = safetensors_header(shard) if os.path.exists(shard) else {}
    report_path = os.path.join(out_dir, REPORT)
    report = _read_json(report_path) if os.path.exists(report_path) else {}
    merged_params = 0
    try:
        files = set(_weight_map(out_dir).values())
        for name in files:
            path = os.path.join(out_dir, name)
            if not os.path.exists(path) and name == SINGLE_SHARD:
                path = os.path.join(out_dir, SINGLE_WEIGHTS)
            merged_params += _numel(safetensors_header(path))
    except FileNotFoundError:
        pass
    domains = {}
    for name, expert in (meta.get("domains") or {}).items():
        mine = {k: v for k, v in header.items() if k.startswith(f"darts.{name}.")}
        info = {"expert": expert, "parameters": _numel(mine), "tensors": sorted(mine)}
        for key in ("calibration", "final_loss", "bias"):
            if key in report.get("domains", {}).get(name, {}):
                info[key] = report["domains"][name][key]
        domains[name] = info
    added = sum(d["parameters"] for d in domains.values())
    return {
        "architecture": (config.get("architectures") or [None])[0],
        "default_domain": config.get("darts_domain", "none"),
        "method": meta.get("method"),
        "loss": meta.get("loss"),
        "rank": meta.get("rank"),
        "head_rank": meta.get("head_rank", 0),
        "max_positions": meta.get("max_positions"),
        "version": meta.get("version"),
        "domains": domains,
        "parameters": added,
        "merged_parameters": merged_params,
        "share": added / merged_params if merged_params else None,
        "has_modeling_files": all(os.path.exists(os.path.join(out_dir, f)) for f in MODELING_FILES),
    }
