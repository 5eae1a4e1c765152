"""Score model-written functions HumanEval style, with the verdict decided outside the program.

``check_function(source, entry_point, test, setup=..., check="check")`` runs the untrusted
``source`` (prompt + completion) in a sandboxed process (``sandbox_run``: namespaces, a per-run uid,
resource limits, a private size-limited tmpfs where the machine allows) that only *answers calls*
to ``entry_point``. The dataset's own test code runs in the judge's process (``sandbox_judge``:
trusted code only, started per run under the run's deadline, memory and CPU limits): ``setup`` (the
prompt: its helper functions, e.g. HumanEval/32's ``poly``), then ``test``, then ``check(candidate)``,
where ``candidate`` is a proxy: each call sends its arguments as plain data to the program and
returns the program's answer decoded as plain data (``sandbox_wire``; exact builtin types only, so
no ``__eq__`` of the program's ever runs there). The comparisons, the asserts and the verdict are
all there; this process only relays frames between the two and reads the verdict. A result that
is not plain data, a crash, a timeout (decoding and the tests included) or a protocol violation
fails the run, and that failure is a ``BaseException`` the tests cannot catch (and is recorded
regardless). A function the tests pass as an argument (``key=lambda ...``) is called back with data.

No marker, exit status or output of the program counts: ``passed`` means the tests ran to their end.
docs/sandbox.md has the threat model and what each launch mode guarantees.
"""

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

from mergekit_darts.evaluation import sandbox_judge, sandbox_launch, sandbox_wire
from mergekit_darts.evaluation.sandbox_judge import CandidateError, SandboxFailure  # noqa: F401 (the tests' view)
from mergekit_darts.evaluation.sandbox_launch import Launch
from mergekit_darts.evaluation.sandbox_run import Run, RunFailure, close_fd, high_pipe, python_command, ready_fds

logger = logging.getLogger(__name__)
STATUSES = ("passed", "failed", "timeout", "error")
JUDGE_OUTPUT = 1000  # characters of the judge's own output (its errors) kept for the report


def _source(module) -> str:
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


JUDGE_SOURCE = _source(sandbox_wire) + "\n" + _source(sandbox_judge)


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed" | "failed" (the tests failed) | "timeout" | "error" (load error, crash, protocol ...)
    output: str  # the program's output and what went wrong, for people (never read for the verdict)
    mode: str = ""  # the launch mode it ran under
    survivors: int = 0  # processes of the run found alive after it (killed, and the run failed)


class JudgeProcess:
    """The evaluator's side of the judge's process (``sandbox_judge``): it gets the job, and then each
    reply of the program relayed unparsed; it runs under the run's deadline (killed when it passes) and
    its own memory and CPU limits, so what the tests do with the program's values is bounded too."""

    def __init__(self, run: Run):
        self.run = run
        self.process: Optional[subprocess.Popen] = None
        self._to = self._from = None
        self._buffer = bytearray()
        self._output = tempfile.TemporaryFile(prefix="darts_judge_out_")

    def start(self) -> None:
        job_read, self._to = high_pipe()
        self._from, out_write = high_pipe()
        config = {"out_fd": out_write, "path": [p for p in sys.path if isinstance(p, str)],
                  "limits": {"memory_mb": self.run.memory_mb, "cpu_s": int(self.run.timeout) + 1}}
        try:
            self.process = subprocess.Popen(
                python_command(os.path.realpath(sys.executable), JUDGE_SOURCE, config), stdin=job_read,
                stdout=self._output, stderr=subprocess.STDOUT, pass_fds=(out_write,), start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"})
        except OSError as error:
            raise RunFailure("error", f"could not start the judge's process: {error}") from None
        finally:
            close_fd(job_read)
            close_fd(out_write)
        os.set_blocking(self._to, False)
        os.set_blocking(self._from, False)

    def write(self, frame: bytes) -> None:
        data = memoryview(frame)
        while data:
            if self._to not in ready_fds(write=[self._to], timeout=self.run.remaining()):
                continue
            try:
                data = data[os.write(self._to, data):]
            except BlockingIOError:
                continue
            except OSError:
                raise self._ended() from None

    def read(self) -> bytes:
        length = int.from_bytes(self._take(sandbox_wire.HEADER_SIZE), "big")
        if length > sandbox_wire.MAX_FRAME + 1:
            raise RunFailure("error", "the judge's process sent an oversized frame")
        return self._take(length)

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            if self._from not in ready_fds([self._from], timeout=self.run.remaining()):
                continue
            try:
                chunk = os.read(self._from, max(1 << 16, size - len(self._buffer)))
            except BlockingIOError:
                continue
            if not chunk:
                raise self._ended()
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _ended(self) -> RunFailure:
        try:
            status = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            status = None
        if status == -signal.SIGXCPU:
            return RunFailure("timeout", "the tests ran out of CPU time on the program's values")
        return RunFailure("error", f"the judge's process ended (exit status {status}): {self.output()[-300:]}")

    def output(self) -> str:
        self._output.seek(0)
        return self._output.read(JUDGE_OUTPUT).decode("utf-8", "replace").strip()

    def end(self) -> None:
        close_fd(self._to)
        close_fd(self._from)
        self._to = self._from = None
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
            self.process.wait()

    def close(self) -> None:
        self._output.close()


def _load(run: Run, source: str, entry_point: str) -> None:
    run.send({"source": source, "entry_point": entry_point})
    reply = run.recv()
    if "load_error" in reply:
        error = reply["load_error"] if isinstance(reply["load_error"], dict) else {}
        raise RunFailure("error", f"the program did not load: {error.get('raised')}: {error.get('message')}")
    if reply.get("ready") is not True:
        raise RunFailure("error", "protocol violation: no ready message")


def _judge(run: Run, judge: JudgeProcess, job: dict) -> Tuple[str, str]:
    """Relay between the judge's process and the program until the judge says a verdict or a failure."""
    judge.write(sandbox_wire.pack_for_child(job))
    while True:
        payload = judge.read()
        kind, body = payload[:1], payload[1:]
        if kind == b"P":  # a request of the judge (trusted marshal data) for the program
            run.send_frame(sandbox_wire.framed(body))
            judge.write(sandbox_wire.framed(run.recv_payload()))
            continue
        try:
            message = sandbox_wire.unpack(body) if kind == b"J" else {}
        except sandbox_wire.WireError:
            message = {}
        said = message.get("failure") or message.get("verdict")
        if type(said) is not list or len(said) != 2 or said[0] not in STATUSES or type(said[1]) is not str:
            raise RunFailure("error", "the judge's process sent a malformed message")
        return said[0], said[1]


def check_function(source: str, entry_point: str, test: str, *, setup: str = "", check: Optional[str] = "check",
                   timeout: float = 5.0, memory_mb: int = 512, disk_mb: int = 16,
                   launch: Optional[Launch] = None) -> ExecutionResult:
    """Run ``source`` sandboxed and the tests in the judge's process (see the module docstring); never
    raises for anything the program does. ``check=None``: ``test`` calls ``entry_point`` by name itself."""
    launch = launch or chosen_launch()
    run = Run(launch, timeout=timeout, memory_mb=memory_mb, disk_mb=disk_mb)
    judge = JudgeProcess(run)
    verdict, detail = "error", ""
    try:
        judge.start()  # boots while the run's sandbox starts
        run.start()
        _load(run, source, entry_point)
        verdict, detail = _judge(run, judge, {"entry_point": entry_point, "setup": setup, "test": test,
                                              "check": check})
    except RunFailure as failure:
        verdict, detail = failure.status, failure.detail
    finally:
        judge.end()
        survivors = run.end()
    if verdict != "passed" and run.exit_status is not None and detail.startswith("the program ended"):
        detail += f" (exit status {run.exit_status})"
        if run.exit_status == -signal.SIGXCPU:
            verdict, detail = "timeout", detail + ": CPU time limit"
    if survivors:
        verdict = "error"
    judge_output = judge.output()
    notes = [n for n in [detail, *run.notes, judge_output and f"judge: {judge_output}"] if n]
    output = "\n".join([run.output().rstrip(), *notes]).strip()
    run.close()
    judge.close()
    return ExecutionResult(verdict == "passed", verdict, output, launch.name, survivors)


# ------------------------------------------------------------------------------------ choosing a launch
_CHOSEN: Optional[Launch] = None
_WARNED = False
_LOCK = threading.Lock()  # the demo scores from a thread pool: probe once


def _works(launch: Launch) -> bool:
    # the imports check that the program's uid can read the standard library (a .py and an extension)
    result = check_function("import colorsys, math\ndef f(x):\n    return [x, {'a': (math.floor(1.5), None)}]\n",
                            "f", "assert f(2) == [2, {'a': (1, None)}]\n", check=None, timeout=30.0, launch=launch)
    if not result.passed:
        logger.debug("code sandbox: %s refused here: %s", launch.name, result.output[-300:])
    return result.passed


def chosen_launch() -> Launch:
    """The strongest launch that works here (probed once per process with a real check, then cached)."""
    global _CHOSEN, _WARNED
    with _LOCK:
        if _CHOSEN is None:
            candidates = sandbox_launch.candidates()
            _CHOSEN = next((c for c in candidates if c.name == "plain" or _works(c)), candidates[-1])
            best = candidates[0]
            if _CHOSEN.name != best.name and not _WARNED:
                _WARNED = True
                logger.warning(
                    "code sandbox: running as %r (python %s); the strongest mode %r is not permitted here "
                    "(needs %s and an interpreter a per-run uid can execute). docs/sandbox.md says what %r "
                    "does not guarantee.", _CHOSEN.name, _CHOSEN.python, best.name, sandbox_launch.UNSHARE,
                    _CHOSEN.name)
        return _CHOSEN
