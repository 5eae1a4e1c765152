"""Pydantic schema of a sweep YAML (docs/sweep.md).

A sweep YAML is an ordinary mergekit YAML with its ``surgery:`` block, plus one ``sweep:`` block that
lists what to vary: merge axes (any mergekit key, addressed by a dotted path), surgery variants
(named overrides of the surgery block and/or a grid of surgery keys) and seeds. Every error names
its place in the YAML (``sweep.merge.0.path: ...``) so a typo costs seconds, not a sweep.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergekit_darts.config import format_validation_error, split_yaml
from mergekit_darts.errors import SweepConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MergeAxis(_Strict):
    """One merge setting to vary: each value is written at ``path`` (or at every one of ``paths``,
    tied together, e.g. the weight of both models). Integer parts index lists: ``models.0.parameters.weight``."""

    name: Optional[str] = None
    path: Optional[str] = None
    paths: Optional[List[str]] = None
    values: List[Any] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_target(self):
        if (self.path is None) == (self.paths is None):
            raise ValueError("give exactly one of 'path' (a dotted key of the mergekit config) or 'paths' (a list)")
        if self.paths is not None and not self.paths:
            raise ValueError("'paths' is empty")
        for path in self.targets:
            if not path or any(part == "" for part in path.split(".")):
                raise ValueError(f"path {path!r} is not a dotted key such as 'models.0.parameters.weight'")
            if path.split(".")[0] == "surgery":
                raise ValueError(f"path {path!r}: vary surgery keys under sweep.surgery, not sweep.merge")
        return self

    @property
    def targets(self) -> List[str]:
        return [self.path] if self.path is not None else list(self.paths)

    @property
    def label(self) -> str:
        return self.name or self.targets[0]


class SurgerySweep(_Strict):
    """Surgery variants: named overrides of the ``surgery:`` block, crossed with a grid of keys.
    Neither given: one variant, the surgery block as written (named ``default``)."""

    variants: Optional[Dict[str, Dict[str, Any]]] = None
    grid: Dict[str, List[Any]] = Field(default_factory=dict)

    @field_validator("variants")
    @classmethod
    def _variants(cls, value):
        if value is not None and not value:
            raise ValueError("'variants' is empty; leave it out for the surgery block as written")
        for name, overrides in (value or {}).items():
            if "seed" in overrides:
                raise ValueError(f"variant {name!r} sets 'seed'; seeds are listed in sweep.seeds")
        return value

    @field_validator("grid")
    @classmethod
    def _grid(cls, value):
        for key, values in value.items():
            if key == "seed":
                raise ValueError("grid key 'seed': seeds are listed in sweep.seeds")
            if not isinstance(values, list) or not values:
                raise ValueError(f"grid key {key!r}: give a non-empty list of values")
        return value


class ScoringConfig(_Strict):
    """What each cell is scored on, besides the report's held-out metrics (always recorded)."""

    metric: str = "mean/heldout_kl"  # the one shown in results.md, the plot and the tests
    higher_is_better: Optional[bool] = None  # None: lower for held-out metrics/losses, higher otherwise
    demo: bool = False  # accuracy on the built-in demo family's test sets (demo domains only)
    tasks: List[str] = Field(default_factory=list)  # lm-eval tasks (mergekit_darts.evaluation.harness)
    task_options: Dict[str, Any] = Field(default_factory=dict)  # passed to evaluation.harness.evaluate

    @property
    def lower_is_better(self) -> bool:
        if self.higher_is_better is not None:
            return not self.higher_is_better
        return any(key in self.metric for key in ("heldout", "loss", "kl"))


class ResourcesConfig(_Strict):
    """Ray resource requests of each merge and each cell task."""

    num_cpus: float = Field(1.0, gt=0)
    num_gpus: Union[float, Literal["auto"]] = "auto"  # auto: 1 when the Ray cluster has GPUs, else 0
    memory_gb: Optional[float] = Field(None, gt=0)

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, value):
        if value != "auto" and value < 0:
            raise ValueError("num_gpus must be >= 0 or 'auto'")
        return value


class SweepBlock(_Strict):
    seeds: Union[int, List[int]] = Field(default_factory=lambda: [0])
    merge: List[MergeAxis] = Field(default_factory=list)
    surgery: SurgerySweep = Field(default_factory=SurgerySweep)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    output_dir: Optional[str] = None

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value):
        if isinstance(value, int):
            if value < 1:
                raise ValueError("seeds: give a count >= 1 or a list of seeds")
            return list(range(value))
        if not value or len(set(value)) != len(value):
            raise ValueError("seeds: give a non-empty list of distinct seeds")
        return value

    @field_validator("merge")
    @classmethod
    def _unique_labels(cls, value):
        labels = [axis.label for axis in value]
        if len(set(labels)) != len(labels):
            raise ValueError(f"merge axes need distinct names (got {labels}); set 'name' on each")
        return value


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep YAML: the mergekit part, the raw surgery block, and what to vary."""

    merge: Dict[str, Any]
    surgery: Dict[str, Any]
    sweep: SweepBlock


def parse_sweep(source: str, where: str = "sweep YAML") -> SweepSpec:
    """Parse the text of a sweep YAML; SweepConfigError names the field on bad input."""
    import yaml

    try:
        merge, surgery = split_yaml(source)
    except yaml.YAMLError as error:
        raise SweepConfigError(f"{where}: not valid YAML: {error}") from None
    except ValueError as error:
        raise SweepConfigError(f"{where}: {error}") from None
    raw = merge.pop("sweep", None)
    if raw is None:
        raise SweepConfigError(f"{where}: no sweep: block; add one listing what to vary (docs/sweep.md)")
    if not isinstance(raw, dict):
        raise SweepConfigError(f"sweep: expected a mapping, got {type(raw).__name__}")
    if not isinstance(surgery, dict):
        raise SweepConfigError(f"{where}: a sweep needs a surgery: block (the settings every variant starts from)")
    try:
        block = SweepBlock.model_validate(raw)
    except ValidationError as error:
        raise SweepConfigError(format_validation_error(error, "sweep")) from None
    return SweepSpec(merge=merge, surgery=surgery, sweep=block)
