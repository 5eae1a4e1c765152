"""The ``surgery:`` block's presets (docs/quality.md): named settings that keys written in the YAML override."""

from typing import Any, Dict, Optional

# Keys written in the YAML win. "paper": the defaults spelled out. "best": the highest six-seed mean held-out
# gap with the demo's 50 prompts, within budget.PRESET_SHARE (quality_synthesis.json "real50"; docs/quality.md).
PRESETS: Dict[str, Dict[str, Any]] = {
    "paper": {"method": "darts", "loss": "ewl1", "content": "relu", "rank": 16, "head_rank": 0, "steps": 500, "lr": 1.0e-3},
    "best": {"method": "darts", "loss": "kl", "content": "relu", "rank": 64, "head_rank": 0, "steps": 500, "lr": 1.0e-3,
             "depth": "all", "depth_rank": 8, "batch_size": 50, "adapter_init": "delta"},
}


def expand_preset(data: Any) -> Any:
    """The ``surgery:`` mapping with its preset's settings filled in where the YAML gives none."""
    if not isinstance(data, dict) or data.get("preset") is None:
        return data
    preset = data["preset"]
    if preset not in PRESETS:
        return data  # the Literal check names the field and the choices
    # lr_candidates replaces the preset's lr (written, both would be an error: one lr is ignored)
    filled = {k: v for k, v in PRESETS[preset].items() if not (k == "lr" and "lr_candidates" in data)}
    if data.get("depth") == 0:  # the preset's block adapters turned off: their rank would be an ignored key
        filled.pop("depth_rank", None)
        if not data.get("head_rank"):  # nor the start from the deltas: nothing left to start
            filled.pop("adapter_init", None)
    return {**filled, **data}


def preset_settings(surgery)  -> Optional[Dict[str, Any]]:
    """The settings a preset controls, as this run resolved them (explicit keys included)."""
    if surgery.preset is None:
        return None
    return {key: getattr(surgery, key) for key in PRESETS[surgery.preset]}
