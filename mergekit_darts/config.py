"""Pydantic schema of the ``surgery:`` block of a mergekit YAML (docs/design.md §2).

Defaults are the paper's. Unknown keys are errors, and every error names its path in the YAML
(``surgery.domains.math.calibration.samples: ...``) so a typo is caught before any merging starts.
"""

import re
from typing import Any, Dict, List, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergekit_darts.errors import SurgeryConfigError  # noqa: F401  (re-exported: the schema's error)

# Each vocabulary is defined once, as a Literal; the tuples are derived from it.
Method = Literal["darts", "standard"]
Loss = Literal["ewl1", "l1", "mse", "ewmse", "cosine", "kl"]
Content = Literal["relu", "linear"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
METHODS = get_args(Method)
LOSSES = get_args(Loss)
CONTENTS = get_args(Content)
DTYPES = get_args(Dtype)
Preset = Literal["paper", "best"]
PRESETS_NAMES = get_args(Preset)
DOMAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationConfig(_Strict):
    """Where a domain's calibration prompts come from: exactly one of path / texts / dataset."""

    path: Optional[str] = None
    texts: Optional[List[str]] = None
    dataset: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    field: str = "text"
    separator: Literal["line", "blank"] = "line"
    samples: int = Field(50, gt=0)
    template: Optional[str] = None
    chat_template: bool = False
    continue_tokens: int = Field(0, ge=0)
    # quality options (docs/quality.md): sampled continuations of each prompt besides the greedy one
    continue_samples: int = Field(0, ge=0)
    continue_temperature: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _samples_need_tokens(self):
        if self.continue_samples > 0 and self.continue_tokens == 0:
            raise ValueError("continue_samples needs continue_tokens > 0 (the length of each sampled continuation)")
        return self

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("path", "texts", "dataset") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'path', 'texts' or 'dataset'"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.texts is not None and not self.texts:
            raise ValueError("'texts' is empty")
        return self


class DomainConfig(_Strict):
    model: str
    calibration: CalibrationConfig


class SurgeryConfig(_Strict):
    method: Method = "darts"
    loss: Loss = "ewl1"
    content: Content = "relu"
    rank: int = Field(16, gt=0)
    head_rank: int = Field(0, ge=0)
    max_positions: int = Field(512, gt=0)
    steps: int = Field(500, ge=0)
    lr: float = Field(1.0e-3, gt=0)
    batch_size: Optional[int] = Field(None, gt=0)
    seed: Optional[int] = None
    device: str = "auto"
    dtype: Dtype = "auto"
    held_out: float = Field(0.2, ge=0, lt=1)
    capture_batch_size: int = Field(8, gt=0)
    kl_chunk_size: int = Field(1024, gt=0)
    cache_dir: Optional[str] = None
    default_domain: Optional[str] = None
    domains: Dict[str, DomainConfig]
    # quality options (docs/quality.md): presets, held-out selection, weight decay
    preset: Optional[Preset] = None
    weight_decay: float = Field(0.0, ge=0)
    lr_candidates: Optional[List[float]] = None
    early_stopping: bool = False
    eval_every: int = Field(25, gt=0)
    patience: int = Field(8, gt=0)
    validation: float = Field(0.2, gt=0, lt=1)
    refit: bool = True

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        return expand_preset(data)

    @field_validator("lr_candidates")
    @classmethod
    def _lr_candidates(cls, value: Optional[List[float]]) -> Optional[List[float]]:
        if value is not None and (not value or any(lr <= 0 for lr in value)):
            raise ValueError("give a non-empty list of positive learning rates")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "auto" and not re.match(r"^(cpu|cuda(:\d+)?|mps)$", value):
            raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda or cuda:N")
        return value

    @field_validator("domains")
    @classmethod
    def _domains(cls, value: Dict[str, DomainConfig]) -> Dict[str, DomainConfig]:
        if not value:
            raise ValueError("at least one domain is required")
        for name in value:
            if name == "none" or not DOMAIN_NAME.match(name):
                raise ValueError(
                    f"domain name {name!r} must be a Python-identifier-like name (letters, digits, _) "
                    "and not 'none'"
                )
        return value

    @model_validator(mode="after")
    def _default_domain(self):
        if self.default_domain is not None and self.default_domain != "none" and self.default_domain not in self.domains:
            raise ValueError(
                f"default_domain {self.default_domain!r} is not a domain; choose one of "
                f"{sorted(self.domains) + ['none']}"
            )
        return self

    @property
    def active_domain(self) -> str:
        """The domain active when the output directory is loaded."""
        return self.default_domain if self.default_domain is not None else next(iter(self.domains))


# What each preset sets; keys written in the YAML win. Calibration keys go to every domain's
# calibration block. "paper" is the defaults, spelled out. "best": docs/quality.md (measured).
PRESETS: Dict[str, Dict[str, Any]] = {
    "paper": {"method": "darts", "loss": "ewl1", "content": "relu", "head_rank": 0, "steps": 500, "lr": 1.0e-3},
    "best": {"method": "darts", "loss": "kl", "content": "relu", "head_rank": 0, "steps": 500, "lr": 1.0e-3},
}
PRESET_CALIBRATION: Dict[str, Dict[str, Any]] = {"paper": {}, "best": {}}


def expand_preset(data: Any) -> Any:
    """The ``surgery:`` mapping with its preset's settings filled in where the YAML gives none."""
    if not isinstance(data, dict) or data.get("preset") is None:
        return data
    preset = data["preset"]
    if preset not in PRESETS:
        return data  # the Literal check names the field and the choices
    expanded = {**PRESETS[preset], **data}
    calibration = PRESET_CALIBRATION[preset]
    if calibration and isinstance(data.get("domains"), dict):
        domains = {}
        for name, domain in data["domains"].items():
            if isinstance(domain, dict) and isinstance(domain.get("calibration"), dict):
                domain = {**domain, "calibration": {**calibration, **domain["calibration"]}}
            domains[name] = domain
        expanded["domains"] = domains
    return expanded


def preset_settings(surgery: "SurgeryConfig") -> Optional[Dict[str, Any]]:
    """The settings a preset controls, as this run resolved them (explicit keys included)."""
    if surgery.preset is None:
        return None
    settings = {key: getattr(surgery, key) for key in PRESETS[surgery.preset]}
    for key in PRESET_CALIBRATION[surgery.preset]:
        settings[f"calibration.{key}"] = {n: getattr(d.calibration, key) for n, d in surgery.domains.items()}
    return settings


def _format_error(error: ValidationError, prefix: str) -> str:
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in (prefix, *item["loc"]) if part != "")
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see the README for the supported keys)"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def parse_surgery_block(raw: Any, prefix: str = "surgery") -> SurgeryConfig:
    """Validate the ``surgery:`` mapping of a YAML file; raise SurgeryConfigError naming the field."""
    if not isinstance(raw, dict):
        raise SurgeryConfigError(f"{prefix}: expected a mapping, got {type(raw).__name__}")
    try:
        return SurgeryConfig.model_validate(raw)
    except ValidationError as error:
        raise SurgeryConfigError(_format_error(error, prefix)) from None


def split_yaml(config_source: str):
    """Parse a mergekit YAML text into (merge config dict without ``surgery``, surgery block or None)."""
    import yaml

    data = yaml.safe_load(config_source)
    if not isinstance(data, dict):
        raise SurgeryConfigError("config: expected a YAML mapping at the top level")
    surgery = data.pop("surgery", None)
    return data, surgery
