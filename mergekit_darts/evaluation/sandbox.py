"""Run untrusted model-written Python (a completion + hidden tests), HumanEval style.

Modelled on nanochat's ``execution.py`` (itself after OpenAI's human-eval): the program runs in a
separate ``python -I`` process (isolated mode: no site dir, no PYTHON* env vars, no cwd on sys.path)

- in a fresh temporary directory as its working directory, deleted afterwards;
- with resource limits: address space (``memory_mb``), CPU seconds, file size, no new processes;
- under a wall-clock ``timeout``; on expiry the whole process group is killed;
- after a prelude that disables destructive functions (``os.remove``, ``os.system``,
  ``shutil.rmtree``, ``subprocess.Popen``, ...) before the program is executed.

This is a guard against accidents by a small model, NOT a security boundary against a malicious
program; run real untrusted code inside a container as well.

``run_program(program, timeout=5.0, memory_mb=512) -> ExecutionResult(passed, status, output)``
with status "passed" | "failed" (an assertion failed) | "timeout" | "error" (anything else: syntax
error, exception, memory limit, killed by a signal).
"""

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MAX_OUTPUT = 4000
_EXIT_FAILED, _EXIT_ERROR = 3, 4

PRELUDE = r'''
import builtins, faulthandler, os, platform, resource, shutil, subprocess, sys
faulthandler.disable()
_nonce = sys.stdin.readline().strip()
_write_fd = os.write
_program = sys.stdin.read()
_memory, _cpu = int(sys.argv[1]) * 1024 * 1024, int(sys.argv[2])
for _limit, _value in ((resource.RLIMIT_AS, _memory), (resource.RLIMIT_DATA, _memory),
                       (resource.RLIMIT_CPU, _cpu), (resource.RLIMIT_FSIZE, 1 << 20),
                       (resource.RLIMIT_CORE, 0), (getattr(resource, "RLIMIT_NPROC", None), 0)):
    if _limit is not None:
        try:
            resource.setrlimit(_limit, (_value, _value))
        except (ValueError, OSError):
            pass
for _mod in (os, __import__("posix")):
    for _name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir",
                  "setuid", "fork", "forkpty", "unlink", "fchmod", "fchown", "chmod", "chown", "chroot",
                  "lchown", "lchmod", "lchflags", "chflags", "truncate", "ftruncate", "replace", "rename",
                  "renames", "link", "symlink", "execv", "execve", "execl", "execle", "execlp", "execvp",
                  "execvpe", "spawnv", "spawnve", "spawnl", "posix_spawn", "posix_spawnp", "popen",
                  "getcwd", "chdir", "setsid", "setpgid", "nice", "plock"):
        if hasattr(_mod, _name):
            setattr(_mod, _name, None)
os.environ.clear()
for _name in ("rmtree", "move", "chown", "copy", "copyfile", "copytree", "disk_usage"):
    setattr(shutil, _name, None)
subprocess.Popen = None
subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = None
builtins.exit = builtins.quit = builtins.help = None
for _name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "ctypes", "_ctypes", "multiprocessing"):
    sys.modules[_name] = None
del _mod, _name, _limit, _value
try:
    exec(compile(_program, "<program>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    # only a program that ran to its end writes this (to fd 1, whatever sys.stdout became):
    # an early os._exit(0) is not a pass
    _write_fd(1, ("\n" + _nonce).encode())
except AssertionError as _error:
    sys.stdout.flush()
    print("failed: AssertionError", _error, file=sys.stderr)
    sys.stderr.flush()
    os._exit(%d)
except BaseException as _error:
    sys.stdout.flush()
    print("error:", type(_error).__name__, str(_error)[:500], file=sys.stderr)
    sys.stderr.flush()
    os._exit(%d)
''' % (_EXIT_FAILED, _EXIT_ERROR)


@dataclass
class ExecutionResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    output: str


def run_program(program: str, timeout: float = 5.0, memory_mb: int = 512) -> ExecutionResult:
    """Execute ``program`` in a sandboxed subprocess; never raises for anything the program does."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="darts_sandbox_") as workdir, \
            tempfile.TemporaryFile() as output_file:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "HOME": workdir, "TMPDIR": workdir}
        try:
            # output goes to a file, not a pipe, so RLIMIT_FSIZE bounds what a printing loop can write
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", PRELUDE, str(int(memory_mb)), str(max(1, int(timeout) + 1))],
                cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=output_file,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        except OSError as error:
            return ExecutionResult(False, "error", f"could not start the sandbox: {error}")
        timed_out = False
        try:
            process.communicate((nonce + "\n" + program).encode("utf-8", "replace"), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(process)
            process.wait()
        finally:
            _kill(process)
        output_file.seek(0)
        raw = output_file.read(1 << 21)
        finished = raw.rstrip().endswith(nonce.encode())
        output = _text(raw.replace(("\n" + nonce).encode(), b""))
        if timed_out:
            return ExecutionResult(False, "timeout", output + f"\ntimed out after {timeout:g}s")
        if process.returncode == 0 and finished:
            return ExecutionResult(True, "passed", output)
        if process.returncode == 0:
            return ExecutionResult(False, "error", output + "\nexited before the tests finished")
        if process.returncode == _EXIT_FAILED:
            return ExecutionResult(False, "failed", output)
        if process.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
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
