"""A scratch copy of a merged directory for ``compare``, so that trying surgery variants never
rewrites the user's MERGED_PATH.

The weight files are hard-linked (no copy of a 7B model; the surgery never writes into them: the
export only renames a single ``model.safetensors`` and writes its own files anew), everything else
is copied. The copy sits beside MERGED_PATH under a fixed name and is deleted when the command ends; the
capture cache is keyed by content, so the hard-linked copy reuses MERGED_PATH's captures.
"""

import contextlib
import errno
import os
import shutil
from typing import Iterator

MARKER = ".darts-compare"  # a file inside the copy: only a directory holding it is ever deleted


def scratch_path(merged: str) -> str:
    merged = os.path.abspath(merged)
    return os.path.join(os.path.dirname(merged), f".{os.path.basename(merged)}.darts-compare")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)


def _remove(path: str) -> None:
    if not os.path.exists(path):
        return
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise FileExistsError(f"{path} exists and is not a compare scratch copy; move it away")
    shutil.rmtree(path)


@contextlib.contextmanager
def scratch_copy(merged: str) -> Iterator[str]:
    """``merged`` copied (weights hard-linked) to ``scratch_path(merged)`` for the block's duration."""
    path = scratch_path(merged)
    _remove(path)  # left by an interrupted compare
    os.makedirs(path)
    try:
        open(os.path.join(path, MARKER), "w").close()
        for root, _, files in os.walk(merged):
            target = os.path.join(path, os.path.relpath(root, merged))
            os.makedirs(target, exist_ok=True)
            for name in files:
                copy = _link_or_copy if name.endswith(".safetensors") else shutil.copy2
                copy(os.path.join(root, name), os.path.join(target, name))
        yield path
    finally:
        _remove(path)
