"""How a sandboxed program is started: the launch modes, strongest first (docs/sandbox.md has the table).

- ``namespaces+user`` (root): ``unshare`` new pid, mount, network, IPC and UTS namespaces; pid 1 is
  the trusted ``sandbox_init`` (read-only file system, private size-limited tmpfs, capped IPC);
  the program runs under a per-run uid through ``setpriv`` (no capabilities, no supplementary
  groups, no-new-privs), so it cannot fork (``RLIMIT_NPROC=0`` binds non-root users).
- ``user`` (root, namespaces refused): the same per-run uid, no namespaces: the judge removes what
  that uid left in /tmp, /var/tmp, /dev/shm and SysV IPC afterwards, but cannot bound it meanwhile.
- ``namespaces`` (not root, user namespaces permitted): as the first, in a user namespace; the
  program is uid 0 of that namespace without capabilities (the evaluator's own uid outside).
- ``namespaces-uid0`` (root, namespaces permitted, no interpreter a per-run uid can execute): as the
  first but the program stays uid 0 without capabilities, so it can fork (up to ``PID_MAX``).
- ``plain``: a plain child process under the evaluator's own user; only resource limits hold.

The judge probes these once per process, in this order, with a real check (``sandbox.chosen_launch``).
The per-run uid needs an interpreter it may execute: ``sys.executable`` when reachable, else a
system ``python3.X`` of the same version (the program's side uses only the standard library).
"""

import dataclasses
import os
import secrets
import shutil
import sys
from typing import List, Optional, Tuple

UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
# per-run uids are drawn from here (each run its own: runs cannot signal or write each other's files);
# None disables the user switch
UID_RANGE: Optional[Tuple[int, int]] = (1_600_000_000, 1 << 20)
FALLBACK_UID = 65534  # nobody, when UID_RANGE is not mapped in this user namespace
PID_MAX = 310  # processes of one run's pid namespace where the kernel lets it be set (>= 6.14; min 301)
_NAMESPACES = ["--fork", "--kill-child", "--pid", "--mount", "--mount-proc", "--net", "--ipc", "--uts"]
_NO_CAPS = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    python: str  # the program's interpreter
    namespaces: List[str]  # the unshare command before the init; [] = no namespaces, no init
    switch_user: bool  # the program runs under a per-run uid
    drop_caps: bool  # setpriv removes capabilities (and sets no-new-privs)

    def program_command(self, uid: Optional[int]) -> List[str]:
        prefix = []
        if self.switch_user:
            prefix = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *_NO_CAPS]
        elif self.drop_caps:
            prefix = [SETPRIV, *_NO_CAPS]
        return [*prefix, self.python]

    def pick_uid(self) -> Optional[int]:
        return run_uid() if self.switch_user else None


def _mapped(first: int, count: int) -> bool:
    """Whether uids first..first+count-1 exist in this process's user namespace."""
    try:
        with open("/proc/self/uid_map") as handle:
            rows = [tuple(int(v) for v in line.split()) for line in handle if line.strip()]
    except OSError:
        return False
    return any(inside <= first and first + count <= inside + length for inside, _, length in rows)


def run_uid() -> int:
    if UID_RANGE is not None and _mapped(*UID_RANGE):
        return UID_RANGE[0] + secrets.randbelow(UID_RANGE[1])
    return FALLBACK_UID


def interpreters() -> List[str]:
    version = "python%d.%d" % sys.version_info[:2]
    found = [os.path.realpath(sys.executable)]
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidate = os.path.join(folder, version)
        if os.path.exists(candidate) and os.path.realpath(candidate) not in found:
            found.append(os.path.realpath(candidate))
    return found


def candidates() -> List[Launch]:
    """Every launch worth probing here, strongest first; the last one (plain) always works."""
    unshare = [UNSHARE, *_NAMESPACES, "--"]
    found: List[Launch] = []
    if os.geteuid() == 0:
        if UID_RANGE is not None:
            found += [Launch("namespaces+user", p, unshare, True, True) for p in interpreters()]
            found += [Launch("user", p, [], True, True) for p in interpreters()]
        found.append(Launch("namespaces-uid0", sys.executable, unshare, False, True))
    else:
        found.append(Launch("namespaces", sys.executable, [UNSHARE, "--user", "--map-root-user", *_NAMESPACES, "--"],
                            False, True))
    found.append(Launch("plain", sys.executable, [], False, False))
    return found
