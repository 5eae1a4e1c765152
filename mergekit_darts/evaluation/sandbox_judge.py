"""The judge: the dataset's tests against a proxy of the program's function, in a process of its own.

Runs as ``python -I -S -c <loader> <sandbox_wire + this file> <config>`` (``sandbox.JudgeProcess``),
started by the evaluator for each run: standard library only. Its code is trusted (this file and the
dataset's ``setup``/``test``), but the values it works on come from the program, so it runs under the
run's limits -- the evaluator kills it at the run's wall-clock deadline, and it sets its own
``RLIMIT_AS`` (its size after start-up + the run's ``memory_mb``) and ``RLIMIT_CPU`` -- so that
nothing the program returns (``range(0, 10**13)``, a list of hash-colliding ints, a 30-million-item
range the tests turn into a list) makes the evaluator itself run long or grow.

Nothing of the program ever executes here: its answers arrive as JSON frames relayed by the
evaluator and are decoded by ``sandbox_wire.decode`` into plain builtin values.

Protocol (``sandbox_wire`` frames; the evaluator -> judge on stdin, judge -> evaluator on ``out_fd``):
  evaluator -> judge: the job (marshal: {"entry_point", "setup", "test", "check"}) once, then each
                      reply of the program, relayed as it came (a JSON payload).
  judge -> evaluator: b"P" + a marshal frame for the program (answered by exactly one relayed reply),
                      b"J" + JSON {"failure": [status, detail]} (the run failed; sent once, at once) or
                      {"verdict": [status, detail]} (the end).
"""

import builtins
import os
import sys

try:  # in the package; inside the judge's process ``sandbox_wire``'s source precedes this one
    from mergekit_darts.evaluation.sandbox_wire import (HEADER_SIZE, WireError, decode, dump_json, encode, framed,
                                                        frame_length, pack_for_child, read_exactly, unpack,
                                                        write_all)
except ImportError:
    pass

_UNCATCHABLE = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")  # would end a real check program
# raised as themselves they would end an iteration of the tests' own code (``map``, ``next(it, d)``,
# ``iter(f, sentinel)``, an async for) instead of failing it: a function raising StopIteration passed
# ``all(map(lambda ab: f(*ab) == ..., cases))``. They cross as a CandidateError.
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)
_MESSAGE = 300


class CandidateError(Exception):
    """The program's function raised an exception that is not a builtin one, or one that would steer
    the tests' control flow (StopIteration, StopAsyncIteration)."""


class SandboxFailure(BaseException):
    """The run failed (not an Exception: the tests' ``except Exception`` cannot swallow it)."""


def _send(fd, kind, payload):
    write_all(fd, framed(kind + payload))


def _control(message):
    parts = []
    dump_json(message, parts.append, 0)
    return "".join(parts).encode("ascii")


class Judge:
    """A proxy ``candidate`` for the tests, and the record of the first failure of the run."""

    def __init__(self, entry_point, read_fd, out_fd):
        self.entry_point, self.read_fd, self.out_fd = entry_point, read_fd, out_fd
        self.failure = None
        self._callbacks = []

    def fail(self, status, detail):
        if self.failure is None:
            self.failure = (status, detail)
            _send(self.out_fd, b"J", _control({"failure": [status, detail]}))
        return SandboxFailure(detail)

    def _exchange(self, message):
        try:
            frame = pack_for_child(message)
        except (WireError, ValueError) as error:
            raise self.fail("error", "the tests sent a message the program cannot take: %s" % error) from None
        _send(self.out_fd, b"P", frame[HEADER_SIZE:])
        header = read_exactly(self.read_fd, HEADER_SIZE)
        payload = read_exactly(self.read_fd, frame_length(header)) if header is not None else None
        if payload is None:  # the evaluator ended the run
            raise self.fail("error", "the run was ended")
        try:
            return unpack(payload)
        except WireError as error:
            raise self.fail("error", "protocol violation: %s" % error) from None

    def candidate(self, *args, **kwargs):
        if self.failure is not None:
            raise SandboxFailure(self.failure[1])
        try:
            call = encode([list(args), kwargs], callback=self._register)
        except WireError as error:
            raise self.fail("error", "the tests passed an argument that is not plain data: %s" % error) from None
        reply = self._exchange({"call": call})
        while "callback" in reply:
            reply = self._exchange(self._call_back(reply))
        if "value" in reply:
            try:
                return decode(reply["value"])
            except WireError as error:
                raise self.fail("error", "%s returned %s" % (self.entry_point, error)) from None
        if "raised" in reply:
            raise self._exception(str(reply["raised"])[:100], str(reply.get("message", ""))[:_MESSAGE])
        if "not_data" in reply:
            raise self.fail("error", "%s returned a %s, not plain data" % (self.entry_point, str(reply["not_data"])[:100]))
        raise self.fail("error", "protocol violation: unexpected message")

    def _register(self, function):
        self._callbacks.append(function)
        return len(self._callbacks) - 1

    def _call_back(self, request):
        ident = request.get("callback")
        if type(ident) is not int or not 0 <= ident < len(self._callbacks):
            raise self.fail("error", "protocol violation: unknown callback")
        try:
            args, kwargs = decode(request.get("call"))
            if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                raise WireError("malformed call")
        except WireError as error:
            raise self.fail("error", "protocol violation in a callback: %s" % error) from None
        try:
            return {"value": encode(self._callbacks[ident](*args, **kwargs), callback=self._register)}
        except Exception as error:  # the tests' own function failed: the program sees the exception
            return {"raised": type(error).__name__, "message": str(error)[:_MESSAGE]}

    def _exception(self, name, message):
        if name in _UNCATCHABLE:
            return self.fail("error", "%s raised %s" % (self.entry_point, name))
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _CONTROL_FLOW):
            try:
                return kind(message)
            except Exception:  # e.g. UnicodeDecodeError wants five arguments
                pass
        return CandidateError("%s: %s" % (name, message))


def run_tests(judge, setup, test, check):
    """("passed", "") when the tests ran to their end, else ("failed", why)."""
    namespace = {"__name__": "__darts_tests__"}
    if "random" in setup or "random" in test:  # tests that draw random inputs draw the same ones every run
        import random  # (only then: its import costs the judge's start ~10 %)

        random.seed(0)
    try:
        exec(compile(setup, "<setup>", "exec"), namespace)  # the dataset's prompt: trusted
        namespace[judge.entry_point] = judge.candidate
        exec(compile(test, "<test>", "exec"), namespace)
        if check is not None:
            namespace[check](judge.candidate)
    except AssertionError as error:
        return "failed", ("AssertionError %s" % error).strip()[:_MESSAGE + 20]
    except Exception as error:
        return "failed", "the tests raised %s: %s" % (type(error).__name__, str(error)[:_MESSAGE])
    return "passed", ""


def _size_now():
    try:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) << 10 for line in handle if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None


def _set_limits(limits):
    """Address space: what the judge has now + the run's memory; CPU: the run's. Returns what was not set."""
    import resource

    missing = []
    size = _size_now()
    for name, value in (("RLIMIT_AS", None if size is None else size + (limits["memory_mb"] << 20)),
                        ("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_CORE", 0)):
        try:
            if value is None:
                raise ValueError("no /proc/self/status")
            resource.setrlimit(getattr(resource, name), (value, value))
        except (AttributeError, ValueError, OSError):
            missing.append(name)
    return missing


def serve(config):
    """Run one job's tests; the last frame is the verdict. Exits without cleanup (os._exit)."""
    out_fd = config["out_fd"]
    status = 1
    try:
        sys.path.extend(p for p in config["path"] if p not in sys.path)  # datasets' tests may import packages
        missing = _set_limits(config["limits"])
        if missing:
            os.write(2, ("judge: not set: %s\n" % ",".join(missing)).encode())
        job = None
        header = read_exactly(0, HEADER_SIZE)
        if header is not None:
            import marshal

            job = marshal.loads(read_exactly(0, frame_length(header)))  # from the evaluator: trusted
        if job is not None:
            judge = Judge(job["entry_point"], 0, out_fd)
            try:
                verdict = run_tests(judge, job["setup"], job["test"], job["check"])
            except SandboxFailure:
                verdict = judge.failure
            _send(out_fd, b"J", _control({"verdict": list(judge.failure or verdict)}))
            status = 0
    except BaseException as error:  # e.g. MemoryError outside the tests: the evaluator sees the end
        try:
            os.write(2, ("judge: %s: %s\n" % (type(error).__name__, error)).encode("utf-8", "replace"))
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(status)


if __name__ == "__main__":
    import marshal

    serve(marshal.loads(bytes.fromhex(sys.argv[2])))
