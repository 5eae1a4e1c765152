"""Captured states that are not finite stop the run, blaming what produced them (docs/reliability.md).

NaN/inf in the merged model's states come from the merge (a non-finite weight in any of its inputs
propagates) or from the capture dtype; in an expert's, from that expert. The weights are scanned only
when the states are not finite, to name the first non-finite tensor.
"""

import os
from typing import Optional

import torch

from mergekit_darts.errors import SurgeryConfigError


def first_non_finite_weight(model_dir: str) -> Optional[str]:
    """``"<file>: <tensor>"`` of the first floating-point weight in ``model_dir`` holding NaN/inf, or None
    (also for a Hub id or a directory without safetensors weights)."""
    from safetensors import safe_open

    if not os.path.isdir(model_dir):
        return None
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors") or name == "darts.safetensors":
            continue
        with safe_open(os.path.join(model_dir, name), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return f"{name}: {key}"
    return None


def _cause(model_dir: str, dtype: str) -> str:
    weight = first_non_finite_weight(model_dir)
    if weight is not None:
        return f"weight {weight.split(': ', 1)[1]} holds NaN/inf"
    return f"all weights are finite: the states overflow in dtype {dtype}; capture with dtype: float32"


def check_finite_capture(captured, surgery, settings, merged_dir: str) -> None:
    """NaN/inf hidden states would train a NaN module. The merged model's are blamed on the merge,
    an expert's on that expert; each names the first non-finite weight when there is one."""
    for name, data in captured.domains.items():
        if not bool(torch.isfinite(data.merged_hidden).all()):
            raise SurgeryConfigError(
                f"surgery.domains.{name}: the merged model's captured states hold NaN/inf (in the merge, "
                f"{_cause(merged_dir, settings.dtype)}); check the merge's input models (base_model, models) for "
                "non-finite weights")
        for what, tensor in (("states", data.expert_hidden), ("entropy", data.expert_entropy)):
            if not bool(torch.isfinite(tensor).all()):
                expert = surgery.domains[name].model
                raise SurgeryConfigError(
                    f"surgery.domains.{name}.model: the expert's captured {what} hold NaN/inf (expert {expert!r}: "
                    f"{_cause(expert, settings.dtype)}); check that model")
