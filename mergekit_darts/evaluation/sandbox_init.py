"""The minimal init of a namespace run: pid 1 of the run's pid namespace; trusted; never runs the program.

Started by ``unshare --pid --fork --kill-child --mount --mount-proc --net --ipc --uts`` as
``python -I -S -c <loader> <this file, compiled> <marshal config>`` (standard library only, no
``json``: start-up time is paid per run). Being pid 1, it is what the
kernel kills the whole namespace with: when it exits or dies, every process of the run dies too,
and the program (its child) can neither signal it (pid 1 gets no default signals
from inside its namespace) nor ``setsid`` its way out of it.

It builds the run's file system in the private mount namespace, then starts the program:
- a minimal ``/dev`` (null, zero, full, random, urandom bound from the host; fd links);
- every mount read-only (``mount_setattr(AT_RECURSIVE)``), so nothing outside the next point is
  writable whatever the files' permissions say;
- one private tmpfs of ``disk_mb`` (``nr_inodes`` bounded too) at ``/tmp``, shown also at
  ``/var/tmp`` and ``/dev/shm``: the program's working directory, HOME and TMPDIR;
- SysV IPC of the run's IPC namespace capped, and ``pid_max`` of the pid namespace lowered
  (kernels >= 6.14) so that a program that can fork cannot make more than a few hundred processes;
- then the program: ``setpriv`` (per-run uid or uid 0, no capabilities, no-new-privs) exec'ing its
  interpreter (``command``).
Limits it could not apply are reported in its "ready" message (the judge logs them).

It reports the program's exit at once ("exited"). When the judge closes the lifeline pipe (end of
the run, or the judge died), it kills every other process of the namespace, reaps them, reports the
program's exit status ("exit") and exits.
"""

import ctypes
import marshal
import os
import select
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE = 1, 2, 4, 8, 4096, 8192
MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = 0x1, -100, 0x8000, 442
DEVICES = ("null", "zero", "full", "random", "urandom")
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result, what):
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, "%s: %s" % (what, os.strerror(error)))


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), "mount %s" % target)


def _make_dev():
    """A fresh /dev with only harmless devices: built on a staging tmpfs, then moved over /dev."""
    stage = "/tmp"
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(os.path.join(stage, name), "w").close()
            _mount("/dev/" + name, os.path.join(stage, name), None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(stage, name))
    os.mkdir(os.path.join(stage, "shm"))
    _mount(stage, "/dev", None, MS_MOVE)


def _read_only_everywhere():
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                         ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           "mount_setattr / read-only")


def _private_scratch(disk_mb):
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _mount("tmpfs", "/tmp", "tmpfs", flags, "size=%dm,nr_inodes=%d,mode=1777" % (disk_mb, 64 * disk_mb + 64))
    for target in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(target):
            _mount("/tmp", target, None, MS_BIND)


def _write_sysctls(values):
    """Best effort; returns the settings that could not be applied."""
    missed = []
    for name, value in values.items():
        try:
            with open("/proc/sys/" + name.replace(".", "/"), "w") as handle:
                handle.write(str(value))
        except OSError:
            missed.append(name)
    return missed


def _start(config):
    fds = config["fds"]
    pid = os.fork()
    if pid == 0:  # the program's side: only its request (as stdin), output and reply descriptors
        try:
            signal.set_wakeup_fd(-1)
            for number in (signal.SIGINT, signal.SIGCHLD):
                signal.signal(number, signal.SIG_DFL)
            os.dup2(fds["request"], 0)
            reply = fds["reply"]
            os.closerange(3, reply)
            os.closerange(reply + 1, 1 << 16)
            os.chdir("/tmp")
            os.execve(config["command"][0], config["command"], config["env"])
        except BaseException as error:
            os.write(2, ("sandbox init: %s: %s\n" % (type(error).__name__, error)).encode())
        finally:
            os._exit(127)
    os.close(fds["request"])
    os.close(fds["reply"])
    return pid


def main():
    config = marshal.loads(bytes.fromhex(sys.argv[2]))  # from the judge (trusted)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the only default handler Python installs
    status_fd, lifeline = config["fds"]["status"], config["fds"]["lifeline"]
    disk_bytes = config["disk_mb"] << 20
    wake_read, wake_write = os.pipe()  # SIGCHLD wakes the wait below
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        missed = _write_sysctls({
            "kernel.shmmax": disk_bytes, "kernel.shmall": disk_bytes // 4096, "kernel.shmmni": 16,
            "kernel.msgmni": 16, "kernel.msgmnb": 16384, "kernel.msgmax": 8192,
            "kernel.pid_max": config["pid_max"],
        })
        _make_dev()
        _read_only_everywhere()
        _private_scratch(config["disk_mb"])
        child = _start(config)
    except Exception as error:
        _report(status_fd, "error", "%s: %s" % (type(error).__name__, error))
        os._exit(1)
    _report(status_fd, "ready", ",".join(missed))
    exit_status = None
    while True:  # until the judge closes the lifeline (end of run, or the judge died)
        ready, _, _ = select.select([lifeline, wake_read], [], [])
        if wake_read in ready:  # SIGCHLD: the program (or, where it may fork, an orphan) exited
            os.read(wake_read, 4096)
            exit_status = _reap(child, exit_status, status_fd)
        if lifeline in ready and not os.read(lifeline, 1):
            break
    try:
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of this pid namespace
    except ProcessLookupError:  # none left
        pass
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            exit_status = os.waitstatus_to_exitcode(status)
    _report(status_fd, "exit", exit_status)
    os._exit(0)


def _reap(child, exit_status, status_fd):
    """Reap what exited; tell the judge at once when it is the program (unshare keeps the program's
    pipes open, so the judge would not see their end of file)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exit_status
        if pid == 0:
            return exit_status
        if pid == child:
            exit_status = os.waitstatus_to_exitcode(status)
            _report(status_fd, "exited", exit_status)


def _report(fd, kind, value):
    """One status line: "ready <limits not applied>", "error <why>", "exited <status>", "exit <status>"."""
    os.write(fd, ("%s %s\n" % (kind, "" if value is None else str(value).replace("\n", " "))).encode())


if __name__ == "__main__":
    main()
