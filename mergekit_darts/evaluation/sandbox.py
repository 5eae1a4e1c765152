"""Run untrusted model-written Python (a completion + hidden tests), HumanEval style.

Modelled on nanochat's ``execution.py`` (itself after OpenAI's human-eval), hardened so that a
program can neither change its own score nor hurt the evaluator (docs/sandbox.md: threat model,
guarantees per mode, fallbacks). The program runs in a separate ``python -I -S`` process

- started by ``sandbox_launch``: new pid/mount/network namespaces and an unprivileged user where
  the OS permits (the evaluator is invisible, unsignallable and unreadable; no process outlives
  the run), with a cleared environment, in a fresh temporary working directory;
- with resource limits: address space (``memory_mb``), CPU seconds, file size, no new processes;
- under a wall-clock ``timeout``; on expiry the whole process group (and pid namespace) is killed;
- after a prelude that disables destructive functions (``os.remove``, ``shutil.rmtree``, ...);
- behind an audit hook (PEP 578) that holds the pass marker. "Passed" needs a per-run secret that
  reaches the child through a pipe closed before the program runs and lives only in the hook's
  closure; the hook writes it only when called from the prelude's own frame after the program
  returned. The hook refuses what would reach it (``gc.get_objects``/referrers, other threads'
  frames, tracing, ``ctypes``, new audit hooks), and the child is made non-dumpable so that its
  ``/proc/self/mem`` is closed to it when it runs as another user.

It is not a boundary against kernel exploits or CPython memory-corruption bugs; see docs/sandbox.md.

``run_program(program, timeout=5.0, memory_mb=512) -> ExecutionResult(passed, status, output)``
with status "passed" | "failed" (an assertion failed) | "timeout" | "error" (anything else: syntax
error, exception, memory limit, killed by a signal, exited before the end).
"""

import os
import secrets
import signal
import subprocess
import tempfile
from dataclasses import dataclass

from mergekit_darts.evaluation.sandbox_launch import chosen_launch

MAX_OUTPUT = 4000
_EXIT_FAILED, _EXIT_ERROR = 3, 4
_FINISHED_EVENT = "mergekit_darts.sandbox.finished"

PRELUDE = r'''
import sys


def _install_guard(nonce_fd, main_frame, prelude_code):
    """Keep the pass marker where the program cannot reach it: this hook's closure."""
    import os
    nonce = os.read(nonce_fd, 128).decode("ascii").strip()
    os.close(nonce_fd)
    try:  # non-dumpable: /proc/self/* becomes root-owned, so another user cannot read its own memory
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # a later import must go through the "import" audit event
    # everything the hook uses is bound now: the program may replace builtins and module attributes
    _type, _str, _write, _getframe, _gettrace = type, str, os.write, sys._getframe, sys.gettrace
    _RuntimeError, _ImportError = RuntimeError, ImportError
    refused = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                         "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                         "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof"})
    refused_modules = frozenset({"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_testbuffer",
                                 "_xxsubinterpreters", "_posixsubprocess", "multiprocessing"})
    marker = [nonce]

    def guard(event, args):
        # only exact str/tuple types are inspected: a subclass's methods would be program code
        if _type(event) is not _str:
            return
        if event == "%(finished)s":
            caller = _getframe(1)
            if (marker and caller is main_frame and caller.f_back is not None
                    and caller.f_back.f_code is prelude_code and _gettrace() is None):
                _write(1, ("\n" + marker.pop()).encode())
            return
        if event in refused:
            raise _RuntimeError("sandbox: " + event + " is not allowed")
        if event == "import" and _type(args) is tuple and _type(args[0]) is _str \
                and args[0].partition(".")[0] in refused_modules:
            raise _ImportError("sandbox: import of " + args[0] + " is not allowed")

    sys.addaudithook(guard)


def _main():
    import builtins, faulthandler, os, resource, shutil, subprocess
    faulthandler.disable()
    nonce_fd, memory_mb, cpu = (int(a) for a in sys.argv[1:4])
    program = sys.stdin.read()
    memory = memory_mb * 1024 * 1024
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory),
                         (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 1 << 20),
                         (resource.RLIMIT_CORE, 0), (getattr(resource, "RLIMIT_NPROC", None), 0)):
        if limit is not None:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass
    _install_guard(nonce_fd, sys._getframe(), sys._getframe(1).f_code)
    _audit, _flush, _exit, _print, _stderr = sys.audit, sys.stdout.flush, os._exit, print, sys.stderr
    _AssertionError, _BaseException, _type = AssertionError, BaseException, type
    # guards against accidents (a program deleting files); the guarantees come from the OS and the hook
    for module in (os, __import__("posix")):
        for name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir",
                     "setuid", "fork", "forkpty", "unlink", "fchmod", "fchown", "chmod", "chown", "chroot",
                     "lchown", "lchmod", "lchflags", "chflags", "truncate", "ftruncate", "replace", "rename",
                     "renames", "link", "symlink", "execv", "execve", "execl", "execle", "execlp", "execvp",
                     "execvpe", "spawnv", "spawnve", "spawnl", "posix_spawn", "posix_spawnp", "popen",
                     "getcwd", "chdir", "setsid", "setpgid", "nice", "plock"):
            if hasattr(module, name):
                setattr(module, name, None)
    os.environ.clear()
    for name in ("rmtree", "move", "chown", "copy", "copyfile", "copytree", "disk_usage"):
        setattr(shutil, name, None)
    subprocess.Popen = None
    subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = None
    builtins.exit = builtins.quit = builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[name] = None
    try:
        exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
        _flush()
    except _AssertionError as error:
        _flush()
        _print("failed: AssertionError", error, file=_stderr, flush=True)
        _exit(%(failed)d)
    except _BaseException as error:
        _flush()
        _print("error:", _type(error).__name__, str(error)[:500], file=_stderr, flush=True)
        _exit(%(error)d)
    # reached only when the program ran to its end; the hook checks that this frame is the caller
    _audit("%(finished)s")
    _exit(0)


_main()
''' % {"finished": _FINISHED_EVENT, "failed": _EXIT_FAILED, "error": _EXIT_ERROR}


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    output: str


def run_program(program: str, timeout: float = 5.0, memory_mb: int = 512) -> ExecutionResult:
    """Execute ``program`` in a sandboxed subprocess; never raises for anything the program does."""
    launch = chosen_launch()
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="darts_sandbox_") as workdir, \
            tempfile.TemporaryFile() as output_file:
        if launch.workdir_owner is not None:
            os.chown(workdir, launch.workdir_owner, launch.workdir_owner)
        # a cleared environment: nothing of the evaluator's (tokens) reaches the program
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "HOME": workdir, "TMPDIR": workdir}
        # the secret travels through a pipe that the prelude reads and closes before the program runs
        nonce_read, nonce_write = os.pipe()
        try:
            os.write(nonce_write, nonce.encode() + b"\n")
            os.close(nonce_write)
            # output goes to a file, not a pipe, so RLIMIT_FSIZE bounds what a printing loop can write
            process = subprocess.Popen(
                launch.command("-I", "-S", "-c", PRELUDE, str(nonce_read), str(int(memory_mb)),
                               str(max(1, int(timeout) + 1))),
                cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=output_file, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, pass_fds=(nonce_read,), **launch.popen_kwargs(),
            )
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            return ExecutionResult(False, "error", f"could not start the sandbox: {error}")
        finally:
            os.close(nonce_read)
        timed_out = False
        try:
            process.communicate(program.encode("utf-8", "replace"), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(process)
            process.wait()
        finally:
            _kill(process)
        output_file.seek(0)
        raw = output_file.read(1 << 21)
        finished = raw.rstrip().endswith(b"\n" + nonce.encode())
        output = _text(raw.replace(("\n" + nonce).encode(), b""))
        if timed_out:
            return ExecutionResult(False, "timeout", output + f"\ntimed out after {timeout:g}s")
        if process.returncode == 0 and finished:
            return ExecutionResult(True, "passed", output)
        if process.returncode == 0:
            return ExecutionResult(False, "error", output + "\nexited before the tests finished")
        if process.returncode == _EXIT_FAILED:
            return ExecutionResult(False, "failed", output)
        if process.returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            return ExecutionResult(False, "timeout", output + "\nCPU time limit exceeded")
        return ExecutionResult(False, "error", output or f"exit status {process.returncode}")


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _text(data: bytes) -> str:
    text = (data or b"").decode("utf-8", "replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n...[truncated]"
