"""Verdicts on a report: did a domain's correction beat the plain merge, which domain the output loads
with, and the report made JSON-safe (non-finite numbers named, never written)."""

import math
from typing import Any, Dict, List, Optional


def _headline(entry: Dict[str, Any], loss: str):
    """(label, before, after) of the held-out metric the training loss optimises: the KL to the expert
    for ``kl``, the entropy-weighted L1 bias for the ``ew*`` losses, the plain L1 bias otherwise."""
    if loss == "kl":
        kl = entry.get("held_out_kl") or {}
        return "KL to expert", kl.get("before"), kl.get("after")
    bias = entry.get("bias") or {}
    if loss.startswith("ew"):
        return "entropy-weighted bias", bias.get("mean_before_weighted"), bias.get("mean_after_weighted")
    return "bias", bias.get("mean_before"), bias.get("mean_after")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def domain_verdict(entry: Dict[str, Any], loss: str) -> Dict[str, Any]:
    """``{"status": "improved" | "worse" | "non_finite", "metric", "before", "after", "measured_on"}``:
    whether the correction made the domain's headline metric better than the plain merge."""
    label, before, after = _headline(entry, loss)
    verdict = {"metric": label, "before": before, "after": after,
               "measured_on": "held-out records" if entry.get("bias_split", "held_out") == "held_out"
               else "training records"}
    if not (_finite(before) and _finite(after)):
        verdict["status"] = "non_finite"
    elif after > before:
        verdict["status"] = "worse"
    else:
        verdict["status"] = "improved"
    return verdict


def choose_default(report: Dict[str, Any], requested: str, allow_worse: bool) -> str:
    """The domain the output loads with. A requested domain whose verdict is not "improved" becomes
    "none" (the plain merge) unless ``allow_worse`` (surgery.allow_worse_default); the choice and
    its reason are recorded in ``report["default_domain"]``."""
    entry = report.get("domains", {}).get(requested)
    verdict = (entry or {}).get("verdict") or {}
    chosen, reason = requested, None
    if entry is not None and verdict.get("status") != "improved":
        if verdict.get("status") == "non_finite":
            chosen, reason = "none", "its metric is not finite"
        elif allow_worse:
            reason = "kept although worse than the plain merge (surgery.allow_worse_default: true)"
        else:
            chosen, reason = "none", "worse than the plain merge"
    report["default_domain"] = {"requested": requested, "used": chosen, **({"reason": reason} if reason else {})}
    return chosen


def finite_report(data: Any, path: str = "", found: Optional[List[str]] = None):
    """``data`` with every NaN/inf float replaced by None, and the JSON paths replaced: the report
    must stay valid JSON (``write_json`` refuses NaN) and say which values were not finite."""
    found = [] if found is None else found
    if isinstance(data, float) and not math.isfinite(data):
        found.append(path or "$")
        return None
    if isinstance(data, dict):
        return {key: finite_report(value, f"{path}.{key}" if path else str(key), found) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_report(value, f"{path}[{i}]", found) for i, value in enumerate(data)]
    return data


def sanitized_report(report: Dict[str, Any]) -> Dict[str, Any]:
    """The report as written to darts_report.json: non-finite numbers -> null, listed under
    ``"non_finite_values"`` (absent when there were none)."""
    found: List[str] = []
    clean = finite_report({k: v for k, v in report.items() if k != "non_finite_values"}, "", found)
    if found:
        clean["non_finite_values"] = found
    return clean
