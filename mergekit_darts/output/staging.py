"""Merge into a staging sibling and switch it in only once everything succeeded (docs/reliability.md).

``mergekit-yaml cfg.yml out/`` over a directory that already holds a model must never leave a mix
of the old and the new: mergekit writes its files over whatever is there (a new ``model.safetensors``
beside the old renamed shard and index, the old ``darts.safetensors``, report and code). So the merge
and the surgery run in ``<parent>/.darts-staging-<random>/<name>`` (same file system, same base
name: mergekit names the model card after it), and only a finished result replaces ``out``:

- ``out`` a symlink: its target is staged beside and replaced; the link itself is left as it is.
- ``out`` absent or empty: one ``rename`` (atomic).
- ``out`` holds something: Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one
  atomic step, then the old contents are deleted. Elsewhere (or where the file system refuses the
  exchange) two renames: ``out`` -> backup, staging -> ``out``; a crash between them leaves ``out``
  missing with both complete directories beside it (logged names), never a mixture.

Torch-free; used by ``pipeline.merge_and_repair``.
"""

import ctypes
import ctypes.util
import logging
import os
import secrets
import shutil
import time
from typing import List, Optional

LOG = logging.getLogger(__name__)

STAGING_PREFIX = ".darts-staging-"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(first: str, second: str) -> bool:
    """Atomically swap two directories (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result != 0:
        LOG.debug("renameat2(RENAME_EXCHANGE) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _non_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def staging_leftovers(parent: str) -> List[str]:
    """The ``.darts-staging-*`` folders in ``parent``: a run killed before it could clean up (SIGKILL, a power
    loss) leaves one holding a whole plain merge, for any output name, so every one is reported."""
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    return [os.path.join(parent, name) for name in names
            if name.startswith(STAGING_PREFIX) and os.path.isdir(os.path.join(parent, name))]


def _holding(container: str) -> str:
    """What a staging folder holds, in words: the output it was for and whether a merge is in it."""
    try:
        inside = sorted(os.listdir(container))
    except OSError:
        return "unreadable"
    if not inside:
        return "empty"
    described = []
    for name in inside:
        model = os.path.isfile(os.path.join(container, name, "config.json"))
        described.append(f"{name}/" + (" with a model in it" if model else ""))
    return "holds " + ", ".join(described)


class StagedOutput:
    """A staging directory for ``out_path``; ``path`` is where mergekit and the surgery write."""

    def __init__(self, out_path: str):
        # a symlink is followed: its target is what gets replaced (staged beside it), the link stays
        self.final = os.path.realpath(out_path)
        parent = os.path.dirname(self.final)
        os.makedirs(parent, exist_ok=True)
        for leftover in staging_leftovers(parent):  # whatever output each was for
            LOG.warning("found %s, left by an interrupted run (%s); delete it when no other run is writing there",
                        leftover, _holding(leftover))
        # os.mkdir (not mkdtemp, whose 0700 would become the output's mode) honours the umask
        while True:
            self.container = os.path.join(parent, STAGING_PREFIX + secrets.token_hex(4))
            try:
                os.mkdir(self.container)
                break
            except FileExistsError:
                continue
        self.path = os.path.join(self.container, os.path.basename(self.final))
        os.mkdir(self.path)
        if os.path.isdir(self.final):
            shutil.copymode(self.final, self.path)

    @property
    def replaces_contents(self) -> bool:
        """True when switching in would replace an existing, non-empty directory."""
        return _non_empty_dir(self.final)

    def commit(self) -> None:
        """Switch the staged directory in as ``out_path`` (see the module docstring)."""
        if not self.replaces_contents:
            if os.path.isdir(self.final):
                os.rmdir(self.final)  # empty: rename onto it is allowed, but not on every system
            os.rename(self.path, self.final)
        elif _exchange(self.path, self.final):
            shutil.rmtree(self.path, ignore_errors=True)  # now the old contents
        else:
            backup = os.path.join(self.container, "previous")
            os.rename(self.final, backup)
            try:
                os.rename(self.path, self.final)
            except OSError:
                os.rename(backup, self.final)
                raise
            shutil.rmtree(backup, ignore_errors=True)
        shutil.rmtree(self.container, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.container, ignore_errors=True)

    def keep_plain_merge(self) -> Optional[str]:
        """After a failed surgery: where the (complete) plain merge now is. Into ``out_path`` when that
        held nothing; otherwise beside it as ``<out>.plain-merge-<time>``, ``out_path`` left as it was."""
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            self.discard()
            return None
        if not self.replaces_contents:
            self.commit()
            return self.final
        kept = f"{self.final}.plain-merge-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(self.path, kept)
        shutil.rmtree(self.container, ignore_errors=True)
        return kept
