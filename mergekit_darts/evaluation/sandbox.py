"""Score model-written functions HumanEval style, with the verdict decided outside the program.

``check_function(source, entry_point, test, setup=..., check="check")`` runs the untrusted
``source`` (prompt + completion) in a sandboxed process (``sandbox_run``: namespaces, a per-run uid,
resource limits, a private size-limited tmpfs where the machine allows) that only *answers calls*
to ``entry_point``. The dataset's own test code runs here, in the trusted process: ``setup`` (the
prompt: its helper functions, e.g. HumanEval/32's ``poly``), then ``test``, then ``check(candidate)``,
where ``candidate`` is a proxy: each call sends its arguments as plain data to the program and
returns the program's answer decoded as plain data (``sandbox_wire``; exact builtin types only, so
no ``__eq__`` of the program's ever runs here). The comparisons, the asserts and the verdict are
all here. A result that is not plain data, a crash, a timeout or a protocol violation fails the
run, and that failure is a ``BaseException`` the tests cannot catch (and is recorded regardless).
A function the tests pass as an argument (``key=lambda ...``) is called back here with data.

No marker, exit status or output of the program counts: ``passed`` means the tests ran to their end.
docs/sandbox.md has the threat model and what each launch mode guarantees.
"""

import builtins
import logging
import random
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from mergekit_darts.evaluation import sandbox_launch
from mergekit_darts.evaluation.sandbox_launch import Launch
from mergekit_darts.evaluation.sandbox_run import Run, RunFailure
from mergekit_darts.evaluation.sandbox_wire import WireError, decode, encode

logger = logging.getLogger(__name__)
_UNCATCHABLE = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")  # would end a real check program
# raised as themselves they would end an iteration of the tests' own code (``map``, ``next(it, d)``,
# ``iter(f, sentinel)``, an async for) instead of failing it: a function raising StopIteration passed
# ``all(map(lambda ab: f(*ab) == ..., cases))``. They cross as a CandidateError.
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed" | "failed" (the tests failed) | "timeout" | "error" (load error, crash, protocol ...)
    output: str  # the program's output and what went wrong, for people (never read for the verdict)
    mode: str = ""  # the launch mode it ran under
    survivors: int = 0  # processes of the run found alive after it (killed, and the run failed)


class CandidateError(Exception):
    """The program's function raised an exception that is not a builtin one, or one that would steer
    the tests' control flow (StopIteration, StopAsyncIteration)."""


class SandboxFailure(BaseException):
    """The run failed (not an Exception: the tests' ``except Exception`` cannot swallow it)."""


class Judge:
    """The trusted side of one run: a proxy ``candidate`` and the record of what went wrong."""

    def __init__(self, run: Run, entry_point: str):
        self.run, self.entry_point = run, entry_point
        self.failure: Optional[RunFailure] = None
        self._callbacks: List[Callable] = []

    def fail(self, status: str, detail: str):
        if self.failure is None:
            self.failure = RunFailure(status, detail)
        return SandboxFailure(detail)

    def _exchange(self, message: dict) -> dict:
        try:
            self.run.send(message)
            return self.run.recv()
        except RunFailure as failure:
            raise self.fail(failure.status, failure.detail) from None

    def load(self, source: str) -> None:
        reply = self._exchange({"source": source, "entry_point": self.entry_point})
        if "load_error" in reply:
            error = reply["load_error"] if isinstance(reply["load_error"], dict) else {}
            raise self.fail("error", f"the program did not load: {error.get('raised')}: {error.get('message')}")
        if reply.get("ready") is not True:
            raise self.fail("error", "protocol violation: no ready message")

    def candidate(self, *args, **kwargs) -> Any:
        if self.failure is not None:
            raise SandboxFailure(self.failure.detail)
        try:
            call = encode([list(args), kwargs], callback=self._register)
        except WireError as error:
            raise self.fail("error", f"the tests passed an argument that is not plain data: {error}") from None
        reply = self._exchange({"call": call})
        while "callback" in reply:
            reply = self._exchange(self._call_back(reply))
        if "value" in reply:
            try:
                return decode(reply["value"])
            except WireError as error:
                raise self.fail("error", f"{self.entry_point} returned {error}") from None
        if "raised" in reply:
            raise self._exception(str(reply["raised"])[:100], str(reply.get("message", ""))[:300])
        if "not_data" in reply:
            raise self.fail("error", f"{self.entry_point} returned a {str(reply['not_data'])[:100]}, not plain data")
        raise self.fail("error", "protocol violation: unexpected message")

    def _register(self, function: Callable) -> int:
        self._callbacks.append(function)
        return len(self._callbacks) - 1

    def _call_back(self, request: dict) -> dict:
        ident = request.get("callback")
        if type(ident) is not int or not 0 <= ident < len(self._callbacks):
            raise self.fail("error", "protocol violation: unknown callback")
        try:
            args, kwargs = decode(request.get("call"))
            if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                raise WireError("malformed call")
        except WireError as error:
            raise self.fail("error", f"protocol violation in a callback: {error}") from None
        try:
            return {"value": encode(self._callbacks[ident](*args, **kwargs), callback=self._register)}
        except Exception as error:  # the tests' own function failed: the program sees the exception
            return {"raised": type(error).__name__, "message": str(error)[:300]}

    def _exception(self, name: str, message: str) -> BaseException:
        if name in _UNCATCHABLE:
            return self.fail("error", f"{self.entry_point} raised {name}")
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _CONTROL_FLOW):
            try:
                return kind(message)
            except Exception:  # e.g. UnicodeDecodeError wants five arguments
                pass
        return CandidateError(f"{name}: {message}")


def check_function(source: str, entry_point: str, test: str, *, setup: str = "", check: Optional[str] = "check",
                   timeout: float = 5.0, memory_mb: int = 512, disk_mb: int = 16,
                   launch: Optional[Launch] = None) -> ExecutionResult:
    """Run ``source`` sandboxed and the tests here (see the module docstring); never raises for
    anything the program does. ``check=None``: ``test`` calls ``entry_point`` by name itself."""
    launch = launch or chosen_launch()
    run = Run(launch, timeout=timeout, memory_mb=memory_mb, disk_mb=disk_mb)
    judge = Judge(run, entry_point)
    verdict, detail = "error", ""
    try:
        run.start()
        judge.load(source)
        verdict, detail = _run_tests(judge, setup, test, check)
    except RunFailure as failure:  # could not start
        judge.fail(failure.status, failure.detail)
    except SandboxFailure:
        pass
    finally:
        survivors = run.end()
    if judge.failure is not None:
        verdict, detail = judge.failure.status, judge.failure.detail
        if run.exit_status is not None and detail.startswith("the program ended"):
            detail += f" (exit status {run.exit_status})"
            if run.exit_status == -signal.SIGXCPU:
                verdict, detail = "timeout", detail + ": CPU time limit"
    if survivors:
        verdict = "error"
    notes = [n for n in [detail, *run.notes] if n]
    output = "\n".join([run.output().rstrip(), *notes]).strip()
    run.close()
    return ExecutionResult(verdict == "passed", verdict, output, launch.name, survivors)



def _run_tests(judge: Judge, setup: str, test: str, check: Optional[str]):
    namespace = {"__name__": "__darts_tests__"}
    state = random.getstate()
    random.seed(0)  # tests that draw random inputs draw the same ones every run; restored below
    try:
        exec(compile(setup, "<setup>", "exec"), namespace)  # the dataset's prompt: trusted
        namespace[judge.entry_point] = judge.candidate
        exec(compile(test, "<test>", "exec"), namespace)
        if check is not None:
            namespace[check](judge.candidate)
    except AssertionError as error:
        return "failed", f"AssertionError {error}".strip()
    except Exception as error:
        return "failed", f"the tests raised {type(error).__name__}: {str(error)[:300]}"
    finally:
        random.setstate(state)
    return "passed", ""


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
