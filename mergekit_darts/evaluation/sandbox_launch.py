"""How the sandbox starts its child process: the strongest OS isolation this machine permits.

Tried in order, each once per evaluator process (a probe run of ``python -c pass``), the first that
works is used for every later run:

1. ``namespaces+user`` (root): ``unshare`` new pid, mount (fresh ``/proc``), network, IPC and UTS
   namespaces, then ``setpriv`` to an unprivileged user (``nobody``) with no capabilities, no
   supplementary groups and no-new-privs. The evaluator is not visible (its pid does not exist in
   the child's pid namespace, its ``/proc`` entry neither) and could not be signalled or read
   anyway (another user); ``RLIMIT_NPROC=0`` holds (the limit binds non-root users), and every
   descendant dies with the namespace's init when the run ends or is killed.
2. ``user`` (root, namespaces not permitted): the same unprivileged user via ``Popen(user=, group=)``.
   No pid namespace, but ``nobody`` cannot fork (``RLIMIT_NPROC=0``), signal or read the evaluator.
3. ``namespaces`` (not root): ``unshare --user --map-root-user`` + pid/mount/network namespaces.
4. ``namespaces-uid0`` (root, no interpreter the unprivileged user can run): namespaces as in 1 and
   no capabilities, but uid 0: files the evaluator's user owns stay writable.
5. ``plain``: a plain child process; only the in-process guard and resource limits hold.

Anything below the strongest mode for this user is announced by one logged warning. The unprivileged
user needs an interpreter it can execute: ``sys.executable`` when reachable, else a system
``python3.X`` of the same version (an interpreter under ``/root`` is not reachable).
"""

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import threading
from typing import List, Optional

logger = logging.getLogger(__name__)

UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
UNPRIVILEGED_UID: Optional[int] = 65534  # nobody / nogroup; None disables the user switch
_NAMESPACES = ["--fork", "--kill-child", "--pid", "--mount-proc", "--net", "--ipc", "--uts"]

_CHOSEN: Optional["Launch"] = None
_WARNED = False
_LOCK = threading.Lock()  # the demo scores from a thread pool: probe once


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    prefix: List[str]  # command run before the interpreter
    python: str
    user: Optional[int] = None  # Popen(user=, group=) when not done by the prefix
    workdir_owner: Optional[int] = None  # chown the working directory to this uid/gid

    def command(self, *args: str) -> List[str]:
        return [*self.prefix, self.python, *args]

    def popen_kwargs(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user, "group": self.user, "extra_groups": []}


def _interpreters() -> List[str]:
    version = "python%d.%d" % sys.version_info[:2]
    found = [os.path.realpath(sys.executable)]
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidate = os.path.join(folder, version)
        if os.path.exists(candidate) and os.path.realpath(candidate) not in found:
            found.append(os.path.realpath(candidate))
    return found


def _candidates() -> List[Launch]:
    uid = UNPRIVILEGED_UID
    as_root = os.geteuid() == 0
    unshare = [UNSHARE, *_NAMESPACES, "--"]
    no_caps = [SETPRIV, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    candidates: List[Launch] = []
    if as_root and uid is not None:
        drop = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *no_caps[1:]]
        for python in _interpreters():
            candidates.append(Launch("namespaces+user", unshare + drop, python, workdir_owner=uid))
        for python in _interpreters():
            candidates.append(Launch("user", [], python, user=uid, workdir_owner=uid))
    if as_root:
        candidates.append(Launch("namespaces-uid0", unshare + no_caps, sys.executable))
    else:
        candidates.append(Launch("namespaces", [UNSHARE, "--user", "--map-root-user", *_NAMESPACES, "--"],
                                 sys.executable))
    candidates.append(Launch("plain", [], sys.executable))
    return candidates


def _works(launch: Launch) -> bool:
    try:
        done = subprocess.run(launch.command("-I", "-S", "-c", "import os"), cwd="/", env={"PATH": "/usr/bin:/bin"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30, **launch.popen_kwargs())
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return done.returncode == 0


def chosen_launch() -> Launch:
    """The strongest launch that works here (probed once, then cached)."""
    with _LOCK:
        return _choose()


def _choose() -> Launch:
    global _CHOSEN, _WARNED
    if _CHOSEN is None:
        candidates = _candidates()
        _CHOSEN = next((c for c in candidates if c.name == "plain" or _works(c)), candidates[-1])
        best = candidates[0]
        if _CHOSEN.python != os.path.realpath(sys.executable):
            logger.info("code sandbox: programs run under %s (%s cannot be executed by uid %s)",
                        _CHOSEN.python, sys.executable, UNPRIVILEGED_UID)
        if _CHOSEN.name != best.name and not _WARNED:
            _WARNED = True
            logger.warning(
                "code sandbox: running as %r (python %s); the strongest mode %r is not permitted here "
                "(needs namespaces via %s%s). See docs/sandbox.md for what this mode does not guarantee.",
                _CHOSEN.name, _CHOSEN.python, best.name, UNSHARE,
                " and an interpreter the unprivileged user can execute" if best.workdir_owner is not None else "")
    return _CHOSEN
