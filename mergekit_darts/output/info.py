"""What ``mergekit-darts info`` reads from an output directory, without torch: the config's darts
entry, the safetensors headers (no tensor data) and the report.

Torch-free on purpose: ``info`` is a metadata command and answers in well under a second.
"""

import os
from typing import Optional

from mergekit_darts.errors import FormatError
from mergekit_darts.output import layout
from mergekit_darts.output.layout import DARTS_SHARD, MODELING_FILES, NONE_DOMAIN, REPORT, read_json, safetensors_header


def read_darts_info(out_dir: str) -> dict:
    """Summary of a Darts output directory for ``mergekit-darts info``: domains, experts, parameter
    counts and the report's per-domain numbers."""
    config = layout.read_config(out_dir)
    meta = layout.read_darts_entry(out_dir)
    shape = layout.read_shape(meta)
    shard = os.path.join(out_dir, DARTS_SHARD)
    header = safetensors_header(shard) if os.path.exists(shard) else {}
    report_path = os.path.join(out_dir, REPORT)
    report = _read_report(report_path) if os.path.exists(report_path) else {}
    try:
        merged_params = layout.merged_parameter_count(out_dir)
    except (FormatError, FileNotFoundError):
        merged_params = 0
    domains = {}
    for name, expert in (meta.get("domains") or {}).items():
        mine = {k: v for k, v in header.items() if k.startswith(layout.darts_tensor_name(name, ""))}
        info = {"expert": expert, "parameters": layout.numel(mine), "tensors": sorted(mine)}
        for key in ("calibration", "final_loss", "bias", "held_out_kl", "train_seconds", "selection"):
            if key in report.get("domains", {}).get(name, {}):
                info[key] = report["domains"][name][key]
        domains[name] = info
    router = _router_info(meta, header, report)
    added = sum(d["parameters"] for d in domains.values()) + (router["parameters"] if router else 0)
    return {
        "architecture": (config.get("architectures") or [None])[0],
        "default_domain": config.get(layout.DOMAIN_KEY, NONE_DOMAIN),
        **{key: value for key, value in shape.items() if key != "format_version"},
        "layers": config.get("num_hidden_layers"),  # whether depth adapts every block (the 7B share)
        "loss": meta.get("loss"),
        "format_version": shape["format_version"],
        "version": meta.get("version"),
        "domains": domains,
        "parameters": added,
        "merged_parameters": merged_params,
        "share": added / merged_params if merged_params else None,
        "has_modeling_files": all(os.path.exists(os.path.join(out_dir, f)) for f in MODELING_FILES),
        "router": router,
    }


def _read_report(path: str) -> dict:
    """darts_report.json, or a FormatError naming it (a broken file used to give only json's "Expecting value")."""
    from mergekit_darts.errors import first_line

    try:
        report = read_json(path)
    except (ValueError, UnicodeDecodeError) as error:
        raise FormatError(f"{path}: not valid JSON ({first_line(error)}); the surgery's report is unreadable: "
                          "rerun the surgery, or delete the file to see the rest") from None
    if not isinstance(report, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(report).__name__}; rerun the surgery, "
                          "or delete the file to see the rest")
    return report


def _router_info(meta: dict, header: dict, report: dict) -> Optional[dict]:
    """The router's settings, tensors and measured routing (None for a directory without a router)."""
    settings = meta.get(layout.ROUTER_NAME)
    if not isinstance(settings, dict):
        return None
    mine = {k: v for k, v in header.items() if k.startswith(layout.darts_tensor_name(layout.ROUTER_NAME, ""))}
    info = {**settings, "parameters": layout.numel(mine), "tensors": sorted(mine)}
    measured = report.get(layout.ROUTER_NAME) or {}
    for key in ("split", "accuracy", "mean_accuracy", "confusion", "by_prefix", "calibration", "out_of_domain"):
        if key in measured:
            info[key] = measured[key]
    return info
