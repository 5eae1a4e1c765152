"""Pydantic schema of the ``surgery:`` block of a mergekit YAML (docs/design.md §2).

Defaults are the paper's. Unknown keys are errors, and every error names its path in the YAML
(``surgery.domains.math.calibration.samples: ...``) so a typo is caught before any merging starts.
"""

import re
from typing import Any, Dict, List, Literal, Optional, Union, get_args

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
DOMAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DeviceMapStrategy = Literal["auto", "balanced", "balanced_low_0", "sequential"]
KLTarget = Literal["exact", "topk", "bf16"]
KLPrecision = Literal["float32", "mixed"]
_MAP_DEVICE = re.compile(r"^(cpu|disk|mps|cuda:\d+)$")
_MEMORY_KEY = re.compile(r"^(cpu|disk|mps|cuda:\d+|\d+)$")
_MEMORY_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B|B)$", re.IGNORECASE)


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
    # scale (docs/scale.md): capture across devices (accelerate) and KL at the paper's scale.
    # The defaults keep the single-device capture and the exact float32 full-batch KL.
    device_map: Optional[Union[DeviceMapStrategy, Dict[str, Union[int, str]]]] = None
    max_memory: Optional[Dict[Union[int, str], Union[int, str]]] = None
    kl_target: KLTarget = "exact"
    kl_top_k: int = Field(256, gt=0)
    kl_precision: KLPrecision = "float32"
    kl_positions_per_step: Optional[int] = Field(None, gt=0)

    @field_validator("device_map")
    @classmethod
    def _device_map(cls, value):
        if isinstance(value, dict):
            if not value:
                raise ValueError("an explicit map needs at least one entry (module name -> device)")
            for module, device in value.items():
                if not (isinstance(device, int) and device >= 0) and not (
                        isinstance(device, str) and _MAP_DEVICE.match(device)):
                    raise ValueError(f"module {module!r}: unknown device {device!r}; use a GPU index, "
                                     "cuda:N, cpu, mps or disk")
        return value

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, value):
        for device, size in (value or {}).items():
            if not _MEMORY_KEY.match(str(device)):
                raise ValueError(f"unknown device {device!r}; use a GPU index (0, 1, ...), cpu, mps or disk")
            if not ((isinstance(size, int) and size > 0) or (isinstance(size, str) and _MEMORY_SIZE.match(size.strip()))):
                raise ValueError(f"{device}: size {size!r} must be a byte count or like '20GiB' / '500MB'")
        return value

    @model_validator(mode="after")
    def _max_memory_needs_map(self):
        if self.max_memory is not None and self.device_map is None:
            raise ValueError("max_memory needs device_map (e.g. device_map: auto); it has no effect without one")
        return self

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
