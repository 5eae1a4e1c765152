"""One sandboxed run: its processes, pipes and files, from start to a verified end.

``Run.start`` starts the program's interpreter (through ``sandbox_init`` in the namespace modes),
``send``/``recv`` exchange ``sandbox_wire`` frames with it under the run's wall-clock deadline, and
``end`` kills whatever is left, checks that no process of the run survives (``sandbox_cleanup``:
the run's pid namespace, held open so that its identity cannot be reused; else its per-run uid;
else, in ``plain``, the run's token in a process's environment), kills and reports any survivor,
and removes the run's files.
"""

import fcntl
import functools
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from mergekit_darts.evaluation import sandbox_child, sandbox_cleanup, sandbox_init, sandbox_wire
from mergekit_darts.evaluation.sandbox_launch import PID_MAX, Launch

logger = logging.getLogger(__name__)

MAX_OUTPUT = 4000  # characters of the program's output kept for the report
FILE_BYTES = 1 << 20  # RLIMIT_FSIZE of the program (its output file included)
OPEN_FILES = 32
_REPORTED = set()  # launch modes whose unapplied limits were logged


def _source(module) -> str:
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


CHILD_SOURCE = _source(sandbox_wire) + "\n" + _source(sandbox_child)
INIT_SOURCE = _source(sandbox_init)
# python -I -S -c LOADER <code> <config>: compiled here once (same interpreter: marshal'ed code) or,
# for another interpreter of the same version, compiled there from source
_LOADERS = {"code": "import marshal,sys;exec(marshal.loads(bytes.fromhex(sys.argv[1])))",
            "source": "import sys;exec(compile(sys.argv[1],'<sandbox>','exec'))"}


@functools.lru_cache(maxsize=None)
def _compiled(source: str) -> str:
    return marshal.dumps(compile(source, "<sandbox>", "exec")).hex()


def python_command(python: str, source: str, config: dict) -> List[str]:
    """``python -I -S -c`` running ``source`` with ``config`` (marshal, hex) as argv[2]."""
    if python == os.path.realpath(sys.executable):
        payload, loader = _compiled(source), _LOADERS["code"]
    else:
        payload, loader = source, _LOADERS["source"]
    return [python, "-I", "-S", "-c", loader, payload, marshal.dumps(config).hex()]


class RunFailure(Exception):
    """The run cannot go on: ``status`` is "timeout" or "error"."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def high_pipe():
    """A pipe whose ends are >= 3 (so that they never land on a child's stdin/stdout/stderr)."""
    ends = []
    for fd in os.pipe():
        if fd < 3:
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            os.close(fd)
            fd = moved
        ends.append(fd)
    return ends


def ready_fds(read=(), write=(), timeout: float = 0.0) -> set:
    """The descriptors among ``read``/``write`` that are ready within ``timeout`` seconds (poll: no
    FD_SETSIZE limit, unlike select, in an evaluator with many open files)."""
    poller = select.poll()
    for fd in read:
        poller.register(fd, select.POLLIN)
    for fd in write:
        poller.register(fd, select.POLLOUT)
    return {fd for fd, _ in poller.poll(max(0.0, timeout) * 1000)}


def close_fd(fd: Optional[int]) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class Run:
    def __init__(self, launch: Launch, timeout: float, memory_mb: int, disk_mb: int):
        self.launch, self.timeout, self.memory_mb, self.disk_mb = launch, timeout, int(memory_mb), int(disk_mb)
        self.uid = launch.pick_uid()
        self.token = secrets.token_hex(12)
        self.deadline = 0.0
        self.process: Optional[subprocess.Popen] = None
        self.exit_status: Optional[int] = None
        self.not_applied: List[str] = []  # limits the init could not apply
        self.notes: List[str] = []
        self.namespace = None  # (inode, device) of the run's pid namespace
        self._ns_fd = self._req = self._rep = self._status = self._lifeline = None
        self._buffer = bytearray()
        self._status_buffer = bytearray()
        self.exited = False  # the init reported that the program exited
        self._output = tempfile.TemporaryFile(prefix="darts_sandbox_out_")
        self._workdir: Optional[str] = None

    # ------------------------------------------------------------------------------------------ start
    def _env(self, home: str) -> dict:
        # nothing of the evaluator's environment (tokens) reaches the program; the run's token marks
        # its processes for the plain mode's survivor check
        return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
                "HOME": home, "TMPDIR": home, "DARTS_SANDBOX_RUN": self.token}

    def start(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        request_read, self._req = high_pipe()
        self._rep, reply_write = high_pipe()
        limits = {"memory_mb": self.memory_mb, "cpu_s": int(self.timeout) + 1, "file_bytes": FILE_BYTES,
                  "open_files": OPEN_FILES}
        prefix = self.launch.program_command(self.uid)
        command = prefix[:-1] + python_command(prefix[-1], CHILD_SOURCE, {"reply_fd": reply_write, "limits": limits})
        try:
            if self.launch.namespaces:
                self._start_in_namespaces(command, request_read, reply_write)
            else:
                self._start_direct(command, request_read, reply_write)
        except OSError as error:
            raise RunFailure("error", f"could not start the sandbox: {error}") from None
        finally:
            close_fd(request_read)
            close_fd(reply_write)
        os.set_blocking(self._req, False)
        os.set_blocking(self._rep, False)

    def _start_direct(self, command, request_read, reply_write) -> None:
        self._workdir = tempfile.mkdtemp(prefix="darts_sandbox_")
        if self.uid is not None:
            os.chown(self._workdir, self.uid, self.uid)
        self.process = subprocess.Popen(
            command, stdin=request_read, stdout=self._output, stderr=subprocess.STDOUT, pass_fds=(reply_write,),
            cwd=self._workdir, env=self._env(self._workdir), start_new_session=True)

    def _start_in_namespaces(self, command, request_read, reply_write) -> None:
        self._status, status_write = high_pipe()
        lifeline_read, self._lifeline = high_pipe()
        config = {"fds": {"request": request_read, "reply": reply_write, "status": status_write,
                          "lifeline": lifeline_read},
                  "command": command, "env": self._env("/tmp"), "disk_mb": self.disk_mb, "pid_max": PID_MAX}
        try:
            self.process = subprocess.Popen(
                [*self.launch.namespaces, *python_command(sys.executable, INIT_SOURCE, config)],
                stdin=subprocess.DEVNULL, stdout=self._output, stderr=subprocess.STDOUT, cwd="/",
                env=self._env("/tmp"), start_new_session=True,
                pass_fds=(request_read, reply_write, status_write, lifeline_read))
        finally:
            close_fd(status_write)
            close_fd(lifeline_read)
        message = self._status_message(self.deadline, ("ready", "error"))
        if message is None or message[0] != "ready":
            reason = (message[1] if message else "") or self.output().strip() or "no answer from its init"
            raise RunFailure("error", f"the sandbox did not start ({self.launch.name}): {reason}")
        self.not_applied = [name for name in message[1].split(",") if name]
        if self.not_applied and self.launch.name not in _REPORTED:
            _REPORTED.add(self.launch.name)
            logger.info("code sandbox (%s): this kernel did not let the init set %s", self.launch.name,
                        ", ".join(self.not_applied))
        # holding the namespace open keeps its identity from being reused by a later run
        self._ns_fd = os.open(f"/proc/{self.process.pid}/ns/pid_for_children", os.O_RDONLY)
        info = os.fstat(self._ns_fd)
        self.namespace = (info.st_ino, info.st_dev)

    def _status_message(self, deadline: float, kinds) -> Optional[Tuple[str, str]]:
        """The init's next status line of one of ``kinds`` as (kind, value) (the init is trusted), or
        None at end of file or past ``deadline``; "exited" lines on the way are recorded."""
        while True:
            for message in self._status_lines():
                if message[0] in kinds:
                    return message
            ready = ready_fds([self._status], timeout=deadline - time.monotonic())
            if not ready or not self._read_status():
                return None

    def _read_status(self) -> bool:
        chunk = os.read(self._status, 4096)
        self._status_buffer += chunk
        return bool(chunk)

    def _status_lines(self) -> List[Tuple[str, str]]:
        lines = []
        while b"\n" in self._status_buffer:
            line, _, rest = bytes(self._status_buffer).partition(b"\n")
            self._status_buffer = bytearray(rest)
            kind, _, value = line.decode("utf-8", "replace").partition(" ")
            if kind in ("exited", "exit") and value.lstrip("-").isdigit():
                self.exit_status = int(value)
                self.exited = self.exited or kind == "exited"
            lines.append((kind, value))
        return lines

    def _program_gone(self) -> bool:
        """Whether the init reported the program's exit (read when its status pipe has news)."""
        if not self.exited and self._status is not None:
            ready = ready_fds([self._status])
            if ready and self._read_status():
                self._status_lines()
        return self.exited

    # --------------------------------------------------------------------------------------- messages
    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RunFailure("timeout", f"timed out after {self.timeout:g}s")
        return left

    def _watch(self) -> List[int]:
        return [self._status] if self._status is not None and not self.exited else []

    def send(self, message: dict) -> None:
        self.send_frame(sandbox_wire.pack_for_child(message))

    def send_frame(self, frame: bytes) -> None:
        """A whole frame (header included) of trusted marshal data to the program."""
        data = memoryview(frame)
        while data:
            ready = ready_fds(self._watch(), [self._req], self.remaining())
            if self._req not in ready:
                if self._program_gone():
                    raise RunFailure("error", "the program ended without answering")
                continue
            try:
                data = data[os.write(self._req, data):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                raise RunFailure("error", "the program is gone (it stopped reading its requests)") from None

    def recv(self) -> dict:
        """The program's next message; ``RunFailure`` on end of file, timeout or a malformed frame."""
        try:
            return sandbox_wire.unpack(self.recv_payload())
        except sandbox_wire.WireError as error:
            raise RunFailure("error", f"protocol violation: {error}") from None

    def recv_payload(self) -> bytes:
        """The program's next frame, unparsed (what the judge's process decodes); bounded in size."""
        try:
            length = sandbox_wire.frame_length(self._take(sandbox_wire.HEADER_SIZE))
        except sandbox_wire.WireError as error:
            raise RunFailure("error", f"protocol violation: {error}") from None
        return self._take(length)

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            ready = ready_fds([self._rep, *self._watch()], timeout=self.remaining())
            if self._rep not in ready:
                # the program exited: what it wrote before is still read first (it is in the pipe)
                if self._program_gone() and not ready_fds([self._rep]):
                    raise RunFailure("error", "the program ended without answering")
                continue
            try:
                chunk = os.read(self._rep, max(1 << 16, size - len(self._buffer)))
            except BlockingIOError:
                continue
            if not chunk:
                self.exited = True
                raise RunFailure("error", "the program ended without answering")
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    # -------------------------------------------------------------------------------------------- end
    def end(self) -> int:
        """Stop everything of the run; returns how many of its processes had to be killed afterwards."""
        close_fd(self._req)
        close_fd(self._lifeline)  # the init kills its namespace, reaps it and exits
        self._req = self._lifeline = None
        if self.process is not None:
            if self.launch.namespaces:
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:  # init unresponsive: unshare's kill-child takes it down
                    self.process.kill()
                    self.process.wait()
                if self._status is not None:
                    self._status_message(time.monotonic() + 1.0, ("exit",))  # records the exit status
            else:
                try:  # it closed its end: give it a moment to be reaped, for its exit status
                    self.exit_status = self.process.wait(timeout=1.0 if self.exited else 0)
                except subprocess.TimeoutExpired:
                    pass
                for kill in (os.killpg, os.kill):
                    try:
                        kill(self.process.pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.process.wait()
        survivors = self._kill_survivors()
        self._remove_leftovers()
        for fd in (self._rep, self._status, self._ns_fd):
            close_fd(fd)
        self._rep = self._status = self._ns_fd = None
        return survivors

    def _kill_survivors(self) -> int:
        found = sandbox_cleanup.survivors(self.namespace, self.uid, self.token)
        if found is None:
            self.notes.append("no /proc here: surviving processes cannot be checked")
            return 0
        if found:
            message = f"{len(found)} process(es) of the run outlived it ({self.launch.name}); killed: {found}"
            logger.warning("code sandbox: %s", message)
            self.notes.append(message)
        return len(found)

    def _remove_leftovers(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self.launch.namespaces or self.uid is None:
            return  # namespaces: the private tmpfs and IPC died with the run; plain: cannot tell them apart
        removed = sandbox_cleanup.remove_owned_by(self.uid)
        if removed:
            self.notes.append(f"removed {removed} file(s) or IPC object(s) the program left behind")

    def output(self) -> str:
        self._output.seek(0)
        text = self._output.read(FILE_BYTES + 4096).decode("utf-8", "replace")
        return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n...[truncated]"

    def close(self) -> None:
        self._output.close()

