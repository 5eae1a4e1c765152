"""A model reference that is meant as a local folder but names none: one line naming the field, the
path and the nearest existing sibling, before mergekit or transformers treat it as a Hub id (which
costs a network timeout and ends in "couldn't connect to huggingface.co" or "Repo id must be ...").

A reference is taken as local when it looks like one: it starts with ``/``, ``./``, ``../`` or ``~``,
or it has a path separator and its first component exists here (``tiny_family/cod`` next to
``tiny_family/``). ``org/name`` where no ``org`` exists here stays a Hub id. Torch-free.
"""

import difflib
import os
from typing import Any, Iterator, Optional, Tuple

from mergekit_darts.errors import SurgeryConfigError

_LOCAL_PREFIXES = ("/", "./", "../", "~", "." + os.sep, ".." + os.sep)


def looks_local(path: str) -> bool:
    """Whether ``path`` is meant as a folder on this machine rather than a Hub id."""
    if path.startswith(_LOCAL_PREFIXES) or path in (".", "..") or os.path.isabs(path):
        return True
    separators = [sep for sep in {"/", os.sep} if sep in path]
    if not separators:
        return False  # "gpt2": a Hub id
    first = path.replace(os.sep, "/").split("/", 1)[0]
    return bool(first) and os.path.exists(first)


def nearest_sibling(path: str) -> Optional[str]:
    """The existing entry closest in spelling to ``path``'s first missing component, as a path written
    like ``path`` (``tiny_family/cod`` -> ``tiny_family/code``); None when nothing is close."""
    parts = os.path.normpath(path).split(os.sep)
    for index in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:index]) or os.sep
        if os.path.exists(os.path.expanduser(prefix)):
            continue
        folder = os.path.expanduser(os.sep.join(parts[:index - 1]) or ("." if not path.startswith(os.sep) else os.sep))
        try:
            entries = [name for name in os.listdir(folder) if not name.startswith(".")]
        except OSError:
            return None
        match = difflib.get_close_matches(parts[index - 1], entries, n=1, cutoff=0.6)
        if not match:
            return None
        return os.sep.join(parts[:index - 1] + [match[0]])
    return None


def missing_local_model(path: str) -> Optional[str]:
    """Why ``path`` cannot be the local model folder it looks like (one clause), or None."""
    if not isinstance(path, str) or not path or not looks_local(path):
        return None
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return None
    if os.path.exists(expanded):
        return f"{path!r} is not a directory (a model is a folder holding config.json and weights)"
    near = nearest_sibling(path)
    return f"no such directory {path!r}" + (f" (did you mean {near!r}?)" if near else "")


def check_local_model(path: str, where: str) -> None:
    """Raise a SurgeryConfigError ``where: no such directory ...`` for a local-looking path that is not there."""
    problem = missing_local_model(path)
    if problem:
        raise SurgeryConfigError(f"{where}: {problem}")


def _references(node: Any, where: str) -> Iterator[Tuple[str, str]]:
    """(field, path) of every model a mergekit config mapping names: ``base_model``, ``models[i].model``,
    ``slices[i].sources[j].model``, LoRAs (``model+lora``) and ``path@revision`` spelled as mergekit parses them."""
    if isinstance(node, dict):
        for key, value in node.items():
            field = f"{where}.{key}" if where else str(key)
            if key in ("model", "base_model") and isinstance(value, str):
                model, _, lora = value.partition("+")
                yield field, model.split("@", 1)[0]
                if lora:
                    yield f"{field} (its LoRA)", lora.split("@", 1)[0]
            elif key in ("model", "base_model", "lora", "path") and isinstance(value, dict):
                yield from _references(value, field)
            elif key == "path" and isinstance(value, str) and where.endswith(("model", "lora")):
                yield field, value
            elif isinstance(value, (dict, list)):
                yield from _references(value, field)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _references(item, f"{where}[{index}]")


def check_merge_model_paths(merge_part: dict) -> None:
    """Every local-looking model path of mergekit's part of the config exists (a MergeConfigError otherwise)."""
    from mergekit_darts.errors import MergeConfigError

    for field, path in _references(merge_part, ""):
        problem = missing_local_model(path)
        if problem:
            raise MergeConfigError(f"{field}: {problem}")
