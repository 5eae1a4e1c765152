"""The offline example (``mergekit-darts example``): a random tiny model family, its calibration
prompts and a mergekit YAML with a ``surgery:`` block, written into a directory.

The files ship inside the package (``tiny_offline.yml``, ``math_prompts.jsonl`` next to this
module), so the example runs the same from a clone and from a wheel, with nothing downloaded.
"""

import os
import shutil
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = "tiny_offline.yml"
FAMILY = "tiny_family"
PROMPTS = "math_prompts.jsonl"


def example_config(family_dir: str) -> str:
    """The shipped YAML with its ``./tiny_family`` paths pointing at ``family_dir``."""
    with open(os.path.join(HERE, CONFIG), encoding="utf-8") as handle:
        text = handle.read()
    return text if family_dir == f"./{FAMILY}" else text.replace(f"./{FAMILY}", family_dir)


def _complete(family: str) -> bool:
    return all(os.path.isfile(os.path.join(family, part, "config.json")) for part in ("base", "math", "code")) and \
        os.path.isfile(os.path.join(family, PROMPTS))


def write_offline_example(dest: str = ".", force: bool = False) -> Dict[str, object]:
    """Write ``dest/tiny_family/`` (base, math and code experts, the math prompts) and
    ``dest/tiny_offline.yml``. A complete family already there is kept (it is deterministic); a
    different ``tiny_offline.yml`` is only replaced with ``force``. Returns what was written."""
    family = os.path.join(dest, FAMILY)
    config_path = os.path.join(dest, CONFIG)
    # paths as the user typed them, so that mergekit-yaml works from the same working directory
    family_ref = f"./{FAMILY}" if os.path.normpath(dest) == "." else os.path.join(dest, FAMILY)
    config = example_config(family_ref)
    if os.path.exists(config_path) and not force:
        with open(config_path, encoding="utf-8") as handle:
            if handle.read() != config:
                raise FileExistsError(f"{config_path} exists and differs from the example; "
                                      "pass --force to replace it, or use another --dir")
    reused = _complete(family)
    if not reused:
        from mergekit_darts.tiny import make_family

        make_family(family, domains=["math", "code"], seed=0)
        shutil.copyfile(os.path.join(HERE, PROMPTS), os.path.join(family, PROMPTS))
    with open(config_path, "w", encoding="utf-8") as handle:
        handle.write(config)
    return {"family": family, "config": config_path, "reused_family": reused}
