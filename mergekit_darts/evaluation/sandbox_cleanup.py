"""After a sandboxed run: find the processes it left (to kill and report them), remove its files.

A process belongs to a run if it is in the run's pid namespace (namespace modes: exact, the judge
holds the namespace open so its identity is not reused), else if it has the run's uid (``user``:
exact, each run its own uid), else if its environment holds the run's token (``plain``: best
effort -- a program as the evaluator's own user can rewrite its environment).
"""

import os
import shutil
import signal
import subprocess
import time
from typing import List, Optional, Tuple

SETTLE_S = 2.0  # how long the kernel may take to tear a killed namespace down


def processes_of(namespace: Optional[Tuple[int, int]], uid: Optional[int], token: str) -> List[int]:
    found = []
    marker = f"DARTS_SANDBOX_RUN={token}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if namespace is not None:
                info = os.stat(f"/proc/{name}/ns/pid")
                hit = (info.st_ino, info.st_dev) == namespace
            elif uid is not None:
                with open(f"/proc/{name}/status") as handle:
                    uids = next(line for line in handle if line.startswith("Uid:")).split()[1:]
                hit = str(uid) in uids
            else:
                with open(f"/proc/{name}/environ", "rb") as handle:
                    hit = marker in handle.read().split(b"\0")
        except (OSError, StopIteration):
            continue
        if hit:
            found.append(int(name))
    return found


def survivors(namespace, uid, token) -> Optional[List[int]]:
    """The run's processes still alive after its end, each killed; None where /proc is missing."""
    if not os.path.isdir("/proc/self"):
        return None
    found, settle = processes_of(namespace, uid, token), time.monotonic() + SETTLE_S
    while found and time.monotonic() < settle:
        time.sleep(0.05)
        found = processes_of(namespace, uid, token)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return found


def remove_owned_by(uid: int) -> int:
    """Remove what ``uid`` left at the top of /tmp, /var/tmp, /dev/shm and its SysV IPC objects (the
    ``user`` mode: those places are shared with the host there). Returns how many were removed."""
    removed = 0
    for root in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
    return removed + _remove_ipc(uid)


def _remove_ipc(uid: int) -> int:
    removed = 0
    for kind, flag, column in (("shm", "-m", 7), ("msg", "-q", 7), ("sem", "-s", 4)):
        try:
            with open(f"/proc/sysvipc/{kind}") as handle:
                rows = [line.split() for line in handle.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > column and row[column] == str(uid):
                done = subprocess.run(["ipcrm", flag, row[1]], capture_output=True)
                removed += done.returncode == 0
    return removed
