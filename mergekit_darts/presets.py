"""The ``surgery:`` block's presets (docs/quality.md): named settings that keys written in the YAML override.

A preset fits the run it is given: ``fit_preset`` lowers what the preset chose (never what the YAML
wrote) where the merged model cannot take it — a rank above the hidden size — and records each change,
which the run logs and ``preset_settings`` puts in the report.
"""

import logging
from typing import Any, Dict, FrozenSet, Optional, Tuple

LOG = logging.getLogger(__name__)

# Keys written in the YAML win. "paper": the defaults spelled out. "best": the highest six-seed mean held-out
# gap with the demo's 50 prompts, within budget.PRESET_SHARE (quality_synthesis.json "real50"; docs/quality.md),
# its final-state correction the one that folds into the LM head (content: linear, no position table), and its
# training the cheapest within noise of the best on every demo family it was measured on (preset_grid.json, issue
# 52): every block, 500 steps on minibatches of 12 records, all of them (no early stopping: on the demo it chose
# the last step nearly always, then trained them again in its refit; docs/scale.md has the cost).
PRESETS: Dict[str, Dict[str, Any]] = {
    "paper": {"method": "darts", "loss": "ewl1", "content": "relu", "rank": 16, "head_rank": 0, "steps": 500, "lr": 1.0e-3},
    "best": {"method": "standard", "loss": "kl", "content": "linear", "rank": 64, "head_rank": 0, "steps": 500, "lr": 1.0e-3,
             "depth": "all", "depth_rank": 8, "batch_size": 12, "adapter_init": "delta"},
}
# the ranks a model's hidden size bounds (the pre-merge checks refuse a written one above it)
_RANKS = ("rank", "head_rank", "depth_rank")


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


def filled_keys(data: Any, expanded: Any) -> FrozenSet[str]:
    """The keys the preset filled in (not written in the YAML)."""
    if not isinstance(data, dict) or not isinstance(expanded, dict):
        return frozenset()
    return frozenset(set(expanded) - set(data))


def filled_by_preset(surgery, key: str) -> bool:
    """Whether the preset, not the YAML, gave ``key`` its value (so ``fit_preset`` may lower it)."""
    return key in getattr(surgery, "_preset_filled", frozenset())


def fit_preset(surgery, hidden_size: Optional[int] = None, log: bool = True) -> Tuple[Any, Dict[str, Dict[str, Any]]]:
    """``surgery`` with the preset's own ranks lowered where this run's merged model cannot take them, and the
    new changes ({key: {"preset": value, "used": value, "why": text}}). ``hidden_size``: the merged model's.
    Keys written in the YAML are never changed (the checks report them). ``log``: a warning line per change."""
    update: Dict[str, Any] = {}
    changes: Dict[str, Dict[str, Any]] = {}
    if hidden_size is not None:
        for key in _RANKS:
            if filled_by_preset(surgery, key) and getattr(surgery, key) > hidden_size:
                update[key] = hidden_size
                changes[key] = {"preset": getattr(surgery, key), "used": hidden_size,
                                "why": f"the merged model's hidden size is {hidden_size}"}
    if not update:
        return surgery, {}
    fitted = surgery.model_copy(update=update)
    fitted._preset_fitted = {**getattr(surgery, "_preset_fitted", {}), **changes}
    for key, change in changes.items() if log else ():
        LOG.warning("preset: %s: %s: %s -> %s (%s)", surgery.preset, key, change["preset"], change["used"], change["why"])
    return fitted, changes


def continuation_warning(surgery) -> Optional[str]:
    """A line for ``preset: best`` domains without ``continue_tokens``: every figure of the preset was
    measured with each prompt followed by its expert's own greedy answer, whose length is the domain's (the
    demo's 48 / 16 / 16 tokens), so the preset cannot set it; it says what the run does without it."""
    if surgery.preset != "best":
        return None
    bare = [name for name, domain in surgery.domains.items() if domain.calibration.continue_tokens == 0]
    if not bare:
        return None
    return (f"preset: best: {', '.join(f'surgery.domains.{name}.calibration' for name in bare)} set(s) no "
            "continue_tokens; the preset's figures were measured with each prompt followed by its expert's own "
            "answer (continue_tokens: about an answer's length, docs/hub-models.md): without it the training sees the "
            "prompts only and the report has no behaviour figures")


def preset_settings(surgery) -> Optional[Dict[str, Any]]:
    """The settings a preset controls, as this run resolved them (explicit keys included), and under
    ``fitted`` what the run changed from the preset's values to fit the model and data (``fit_preset``)."""
    if surgery.preset is None:
        return None
    settings: Dict[str, Any] = {key: getattr(surgery, key) for key in PRESETS[surgery.preset]}
    fitted = getattr(surgery, "_preset_fitted", None)
    if fitted:
        settings["fitted"] = fitted
    return settings
