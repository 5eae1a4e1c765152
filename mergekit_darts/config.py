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
DOMAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# "none" = plain merge, "auto" = routed, "router" = the router's tensors (darts.router.*)
RESERVED_NAMES = ("none", "auto", "router")


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
    # automatic domain routing (docs/routing.md)
    router: Optional[bool] = None  # None: true when there are >= 2 domains
    router_threshold: float = Field(0.02, ge=0, le=1)  # chosen by measurement: docs/routing.md
    router_eval: Optional[CalibrationConfig] = None  # out-of-domain prompts to measure the fallback on

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
            if name in RESERVED_NAMES or not DOMAIN_NAME.match(name):
                raise ValueError(
                    f"domain name {name!r} must be a Python-identifier-like name (letters, digits, _) "
                    f"and not one of {list(RESERVED_NAMES)}"
                )
        return value

    @model_validator(mode="after")
    def _default_domain(self):
        if self.default_domain == "auto":
            if not self.router_enabled:
                raise ValueError(
                    "default_domain 'auto' needs the router, but router is "
                    + ("false" if self.router is False else "off by default with a single domain")
                    + "; set router: true or name a domain"
                )
            return self
        if self.default_domain is not None and self.default_domain != "none" and self.default_domain not in self.domains:
            raise ValueError(
                f"default_domain {self.default_domain!r} is not a domain; choose one of "
                f"{sorted(self.domains) + ['none'] + (['auto'] if self.router_enabled else [])}"
            )
        return self

    @property
    def router_enabled(self) -> bool:
        """Whether a router is trained and exported (``router:``, by default with >= 2 domains)."""
        return self.router if self.router is not None else len(self.domains) >= 2

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
