"""Reading a mergekit YAML: duplicate keys are errors, YAML merge keys work, and a misspelled or empty
``surgery:`` block is an error instead of a silent plain merge (docs/reliability.md).

Torch- and pydantic-free: the mergekit hook calls ``mentions_surgery`` on every merge, surgery or not.
"""

import re
from typing import Any, Iterable, Optional, Tuple

from mergekit_darts.errors import SurgeryConfigError

SURGERY_KEY = "surgery"
# a top-level key at column 0 ("key:" or "key :"), what the hook scans the raw text for
_TOP_LEVEL_KEY = re.compile(r"^([A-Za-z_][\w-]*)\s*:", re.MULTILINE)


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, rows[-2][j - 2] + 1)
            row.append(cost)
        rows.append(row)
    return rows[-1][-1]


def near_miss(key: Any) -> bool:
    """True for a top-level key that is almost ``surgery`` (``Surgery``, ``surgey``, ``surgery_``):
    mergekit ignores unknown keys, so such a block would be a plain merge without a word."""
    if not isinstance(key, str) or key == SURGERY_KEY:
        return False
    folded = key.strip().lower().replace("-", "_").rstrip("_")
    return folded == SURGERY_KEY or (len(folded) >= 5 and _edit_distance(folded, SURGERY_KEY) <= 2)


def check_top_level_keys(keys: Iterable[Any]) -> None:
    for key in keys:
        if near_miss(key):
            raise SurgeryConfigError(
                f"config: top-level key {key!r} looks like a misspelled 'surgery' (mergekit ignores unknown keys, "
                "so this would be a plain merge with no surgery); rename it to 'surgery:', or delete the block for "
                "a plain merge")


def mentions_surgery(config_source: str) -> bool:
    """Whether a config text needs mergekit-darts at all: a ``surgery`` key, or a near miss of one
    (which must fail loudly). Cheap: a regex over the text, no YAML parsing."""
    if SURGERY_KEY in config_source:
        return True
    return any(near_miss(match.group(1)) for match in _TOP_LEVEL_KEY.finditer(config_source))


def unique_key_loader():
    """A SafeLoader that rejects duplicate mapping keys (PyYAML keeps the last one silently: a second
    ``math:`` domain would replace the first without a word) and expands YAML merge keys
    (``<<: *defaults``) as PyYAML's SafeLoader does: keys written in the mapping win over merged ones."""
    import yaml

    merge_tag = "tag:yaml.org,2002:merge"

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == merge_tag:  # "<<": expanded by flatten_mapping in construct_mapping
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hashable = key in seen
                except TypeError:
                    continue  # an unhashable key: construct_mapping reports it
                if hashable:
                    raise SurgeryConfigError(
                        f"config: duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at line "
                        f"{seen[key] + 1}); YAML would silently keep only the last one"
                    )
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def split_yaml(config_source: str) -> Tuple[dict, Optional[Any]]:
    """Parse a mergekit YAML text into (merge config dict without ``surgery``, surgery block or None
    when there is no ``surgery`` key). Duplicate keys anywhere, a near miss of ``surgery`` at the top
    level and an empty ``surgery:`` block are errors."""
    import yaml

    data = yaml.load(config_source, Loader=unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    if not isinstance(data, dict):
        raise SurgeryConfigError("config: expected a YAML mapping at the top level")
    check_top_level_keys(data)
    if SURGERY_KEY not in data:
        return data, None
    surgery = data.pop(SURGERY_KEY)
    if surgery is None or surgery == {}:
        raise SurgeryConfigError(
            "surgery: the block is empty, so nothing would be repaired; add its settings and domains "
            "(docs/options.md), or delete the 'surgery:' line for a plain merge")
    return data, surgery
