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

SIGINT and SIGTERM wait while the switch runs (``interrupts.held_signals``): the switch and the deletion
of the old contents finish, then the signal stops the run. Once ``out`` is switched in, a second signal
stops the deletion at once, leaving the rest of the old contents in the staging folder
(``previous_left`` says where).

``staged_directory`` does the same for a new folder (``bake``, ``export-peft``): written in a
``.darts-staging-*`` folder beside it, renamed into place when complete, the partial copy removed when
the command fails or is stopped.

Torch-free; used by ``pipeline.merge_and_repair``, ``output/bake.py`` and ``output/peft_export.py``.
"""

import ctypes
import ctypes.util
import logging
import os
import secrets
import shutil
import time
from typing import List, Optional

from mergekit_darts.errors import FoldError
from mergekit_darts.interrupts import describe, held_signals, terminate_as_interrupt

LOG = logging.getLogger(__name__)

STAGING_PREFIX = ".darts-staging-"
SHOWN_ENTRIES = 5  # what a leftover warning lists of a staging folder's entries
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
    for name in inside[:SHOWN_ENTRIES]:  # a folder with a '/', with or without a model in it; a file as it is
        path = os.path.join(container, name)
        if os.path.isdir(path) and not os.path.islink(path):
            described.append(f"{name}/" + (" with a model in it" if os.path.isfile(os.path.join(path, "config.json"))
                                           else ""))
        else:
            described.append(name)
    if len(inside) > SHOWN_ENTRIES:
        described.append(f"and {len(inside) - SHOWN_ENTRIES} more")
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
        self.switched = False  # whether ``commit`` has switched the staged directory in
        os.mkdir(self.path)
        if os.path.isdir(self.final):
            shutil.copymode(self.final, self.path)

    @property
    def replaces_contents(self) -> bool:
        """True when switching in would replace an existing, non-empty directory."""
        return _non_empty_dir(self.final)

    def commit(self, raise_after: bool = True) -> None:
        """Switch the staged directory in as ``out_path`` (see the module docstring). A signal waits for
        the switch and the deletion of the old contents, then is raised (``raise_after``; else dropped:
        the cleanup of a run that is stopping already, which a second one does not stop either); with
        ``raise_after`` a second one, once switched, stops the deletion."""
        with held_signals(raise_after) as held:
            previous = self._switch()
            self.switched, held.stoppable = True, raise_after
            self._remove_previous(previous)

    def _switch(self) -> Optional[str]:
        """The switch itself; returns where the old contents now are (None when there were none)."""
        if not self.replaces_contents:
            if os.path.isdir(self.final):
                os.rmdir(self.final)  # empty: rename onto it is allowed, but not on every system
            os.rename(self.path, self.final)
            return None
        if _exchange(self.path, self.final):
            return self.path  # now the old contents
        backup = os.path.join(self.container, "previous")
        os.rename(self.final, backup)
        try:
            os.rename(self.path, self.final)
        except OSError:
            os.rename(backup, self.final)
            raise
        return backup

    def _remove_previous(self, previous: Optional[str]) -> None:
        """Delete the old contents (in the staging folder since the switch) and the staging folder."""
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        shutil.rmtree(self.container, ignore_errors=True)
        if os.path.exists(self.container):
            LOG.warning("could not delete %s (the previous contents of %s, replaced by this run); delete it",
                        self.container, self.final)

    @property
    def previous_left(self) -> Optional[str]:
        """After the switch: the staging folder when it is still there (an interrupted deletion), else None."""
        return self.container if self.switched and os.path.exists(self.container) else None

    def interrupted_switch(self, out_path: str) -> str:
        """Where a signal during ``commit`` left things, in the words of the command's one error line."""
        if not self.switched:  # only a signal just before the switch began
            return (f"before the finished result was switched in: {out_path} is unchanged; this run's repaired "
                    f"merge is at {self.path}: move it into place, or delete {self.container}")
        if self.previous_left:
            return (f"while the previous contents of {out_path} were deleted: {out_path} holds this run's repaired "
                    f"merge; the rest of its previous contents is in {self.previous_left}: delete that folder")
        return (f"while the finished result was switched in: {out_path} holds this run's repaired merge (its "
                "previous contents were deleted, as every finished run does)")

    def discard(self) -> None:
        shutil.rmtree(self.container, ignore_errors=True)

    def keep_plain_merge(self) -> Optional[str]:
        """After a failed surgery: where the (complete) plain merge now is. Into ``out_path`` when that
        held nothing; otherwise beside it as ``<out>.plain-merge-<time>``, ``out_path`` left as it was."""
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            self.discard()
            return None
        if not self.replaces_contents:
            self.commit(raise_after=False)  # the run is stopping already: a signal waits for the rename only
            return self.final
        kept = f"{self.final}.plain-merge-{time.strftime('%Y%m%d-%H%M%S')}"
        with held_signals(raise_after=False):
            os.rename(self.path, kept)
            shutil.rmtree(self.container, ignore_errors=True)
        return kept


def _new_directory(parent: str) -> str:
    """A fresh ``.darts-staging-*`` directory in ``parent``, made by os.mkdir so that it (and DEST once
    renamed) gets the umask's mode, not mkdtemp's 0700."""
    while True:
        path = os.path.join(parent, STAGING_PREFIX + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def staged_directory(dest: str, write) -> None:
    """Run ``write(stage)`` in a staging directory beside ``dest``, then rename it to ``dest`` (atomic).
    SIGTERM is handled like Ctrl-C (interrupts.py): either one while writing removes the partial copy
    (the removal itself is not interrupted), leaves ``dest`` absent and ends the command in one line;
    one during the rename waits for it (``dest`` is then complete, and the line says so)."""
    dest = os.path.abspath(dest)
    if os.path.exists(dest):
        raise FoldError(f"DEST: {dest} already exists; choose a new directory (nothing was overwritten)")
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    stage, written = None, False
    with terminate_as_interrupt():
        try:
            stage = _new_directory(parent)
            write(stage)
            with held_signals():
                os.replace(stage, dest)
                written = True
        except BaseException as error:
            if stage is not None and not written:
                with held_signals(raise_after=False):
                    shutil.rmtree(stage, ignore_errors=True)
            if isinstance(error, KeyboardInterrupt):
                describe(error, f"after {dest} was written: it is complete" if written else
                         f"while writing {dest}: it was not created (its partial copy was removed)")
            raise
