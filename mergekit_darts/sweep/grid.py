"""Expanding a sweep into cells, and the content hashes that name merges and cells.

A cell is (merge setting, surgery variant, seed). Its hash covers the full merge config, the full
surgery block (variant applied, seed set) and the scoring: change anything that changes the result
and the cell runs again; re-running an unchanged sweep finds every finished cell by its hash.
Cells that share a merge config share one merge (``merge_hash``).
"""

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from mergekit_darts.errors import SurgeryConfigError, SweepConfigError
from mergekit_darts.sweep.config import SweepSpec

HASH_VERSION = 1  # bump when what a cell computes changes: every cell then runs again


def content_hash(value: Any, length: int = 16) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def set_path(config: Dict[str, Any], path: str, value: Any, where: str) -> None:
    """Write ``value`` at the dotted ``path`` of ``config`` (in place). Missing mapping keys are
    created (a parameter the base config leaves out); list indices must exist."""
    parts = path.split(".")
    node: Any = config
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                raise SweepConfigError(f"{where}: {here!r}: index {part!r} is not in a list of {len(node)}")
            index = int(part)
            if last:
                node[index] = copy.deepcopy(value)
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = copy.deepcopy(value)
            else:
                node = node.setdefault(part, {})
        else:
            raise SweepConfigError(
                f"{where}: {here!r}: cannot go into a {type(node).__name__} value; the path must follow "
                "mappings and lists of the mergekit config"
            )


@dataclass(frozen=True)
class MergeSetting:
    hash: str
    values: Dict[str, Any]  # axis label -> value
    config: Dict[str, Any]  # the full mergekit config (no surgery)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items()) or "base"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: Dict[str, Any]


@dataclass(frozen=True)
class Cell:
    hash: str
    merge: MergeSetting
    variant: Variant
    seed: int
    surgery: Dict[str, Any]  # the full surgery block of this cell (variant applied, seed set)
    scoring: Dict[str, Any] = field(default_factory=dict)

    def describe(self) -> Dict[str, Any]:
        """The cell's identity as results.jsonl records it."""
        return {"cell": self.hash, "merge_hash": self.merge.hash, "merge": self.merge.values,
                "merge_label": self.merge.label, "variant": self.variant.name,
                "overrides": self.variant.overrides, "seed": self.seed}


def merge_settings(spec: SweepSpec) -> List[MergeSetting]:
    axes = spec.sweep.merge
    settings = []
    for combo in itertools.product(*(range(len(axis.values)) for axis in axes)):
        config = copy.deepcopy(spec.merge)
        values = {}
        for number, (axis, index) in enumerate(zip(axes, combo)):
            value = axis.values[index]
            for target in axis.targets:
                set_path(config, target, value, where=f"sweep.merge.{number}")
            values[axis.label] = value
        settings.append(MergeSetting(hash=content_hash({"v": HASH_VERSION, "merge": config}), values=values,
                                     config=config))
    return settings


def _value_name(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def variants(spec: SweepSpec) -> List[Variant]:
    """Named variants × the grid; names join the variant name and ``key=value`` of the grid."""
    named = spec.sweep.surgery.variants or {"default": {}}
    grid = spec.sweep.surgery.grid
    keys = list(grid)
    result = []
    for (name, overrides), combo in itertools.product(named.items(), itertools.product(*grid.values())):
        extra = dict(zip(keys, combo))
        parts = ([name] if spec.sweep.surgery.variants or not extra else []) + [
            f"{k}={_value_name(v)}" for k, v in extra.items()]
        result.append(Variant(name=",".join(parts), overrides={**overrides, **extra}))
    names = [v.name for v in result]
    if len(set(names)) != len(names):
        raise SweepConfigError(f"sweep.surgery: variants expand to duplicate names {names}")
    return result


def expand(spec: SweepSpec) -> List[Cell]:
    """Every cell of the sweep, merge-major (cells sharing a merge are adjacent)."""
    scoring = spec.sweep.scoring.model_dump()
    cells = []
    all_variants = variants(spec)
    for setting in merge_settings(spec):
        for variant in all_variants:
            for seed in spec.sweep.seeds:
                surgery = {**copy.deepcopy(spec.surgery), **copy.deepcopy(variant.overrides), "seed": seed}
                identity = {"v": HASH_VERSION, "merge": setting.config, "surgery": surgery, "scoring": scoring}
                cells.append(Cell(hash=content_hash(identity), merge=setting, variant=variant, seed=seed,
                                  surgery=surgery, scoring=scoring))
    return cells


def validate(spec: SweepSpec, cells: List[Cell]) -> None:
    """Schema checks of every merge config and every surgery block before anything runs (no file
    is opened: a missing model is a failing cell, recorded, not a reason to stop the sweep)."""
    from mergekit.config import MergeConfiguration
    from pydantic import ValidationError

    from mergekit_darts.config import parse_surgery_block

    seen_merges, seen_variants = set(), set()
    for cell in cells:
        if cell.merge.hash not in seen_merges:
            seen_merges.add(cell.merge.hash)
            try:
                MergeConfiguration.model_validate(cell.merge.config)
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise SweepConfigError(
                    f"sweep.merge: the merge setting {cell.merge.label!r} is not a valid mergekit config "
                    f"({where}: {first['msg']})") from None
        if cell.variant.name not in seen_variants:
            seen_variants.add(cell.variant.name)
            try:
                parse_surgery_block(cell.surgery, prefix=f"sweep.surgery[{cell.variant.name}]")
            except SurgeryConfigError as error:
                raise SweepConfigError(str(error)) from None


def group_by_merge(cells: List[Cell]) -> List[Tuple[MergeSetting, List[Cell]]]:
    groups: Dict[str, Tuple[MergeSetting, List[Cell]]] = {}
    for cell in cells:
        groups.setdefault(cell.merge.hash, (cell.merge, []))[1].append(cell)
    return list(groups.values())
