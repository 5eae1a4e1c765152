"""The code sandbox holds against programs that try to change their own score or hurt the evaluator.

Each attack here is a real attempt (it worked against the sandbox before the launch/guard rework):
forging the pass marker, killing the evaluator, reading the evaluator's environment, and leaving a
forked, ``setsid`` descendant running after the run. Attacks that could kill or read the evaluator
run against an evaluator in a child process, so a working attack fails the test instead of pytest.
"""

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from mergekit_darts.evaluation import sandbox, sandbox_launch
from mergekit_darts.evaluation.sandbox import run_program

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRONG = "\ndef add(a, b):\n    return a - b\nassert add(2, 2) == 4\n"  # the hidden test fails

FORGE_THEN_EXIT = "os.write(1, ('\\n' + found[0]).encode())\nos._exit(0)\n"
MARKER_ATTACKS = {
    "main_module_global": "import os\nfound = [__import__('__main__')._nonce]\n" + FORGE_THEN_EXIT,
    "frame_walk": textwrap.dedent("""\
        import os, re, sys
        found, frame = [], sys._getframe()
        while frame is not None:
            for scope in (frame.f_globals, frame.f_locals):
                found += [v for v in scope.values() if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)]
            frame = frame.f_back
        """) + FORGE_THEN_EXIT,
    "gc_scan": textwrap.dedent("""\
        import gc, os, re
        found = []
        for obj in gc.get_objects():
            values = []
            if isinstance(obj, dict):
                values = list(obj.values())
            elif getattr(obj, '__closure__', None):
                values = [getattr(cell, 'cell_contents', None) for cell in obj.__closure__]
            found += [v for v in values if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)]
        """) + FORGE_THEN_EXIT,
    "stdin_and_fds": textwrap.dedent("""\
        import os, re
        found = []
        for fd in range(0, 64):
            try:
                os.lseek(fd, 0, 0)
            except OSError:
                pass
            try:
                found += re.findall('[0-9a-f]{32}', os.read(fd, 1 << 16).decode('latin-1'))
            except OSError:
                pass
        """) + FORGE_THEN_EXIT,
}


@pytest.mark.parametrize("attack", sorted(MARKER_ATTACKS))
def test_a_program_cannot_forge_the_pass_marker(attack):
    result = run_program(MARKER_ATTACKS[attack] + WRONG)
    assert not result.passed and result.status != "passed", (attack, result)


def test_honest_programs_still_pass_and_wrong_ones_fail():
    assert run_program("import math, re, collections\ndef add(a, b):\n    return a + b\nassert add(2, 2) == 4\n"
                       "assert math.gcd(4, 6) == 2\n").passed
    assert run_program("import warnings\nwarnings.warn('x')\nassert True\n").passed  # uses sys._getframe
    assert run_program(WRONG).status == "failed"


def _evaluate_in_child(attack_source: str, env_extra=None) -> subprocess.CompletedProcess:
    """Run ``run_program(attack)`` in a fresh evaluator process; ``{evaluator}`` is its pid."""
    script = textwrap.dedent("""\
        import os, sys
        from mergekit_darts.evaluation.sandbox import run_program
        attack = sys.stdin.read().replace('{evaluator}', str(os.getpid()))
        result = run_program(attack, timeout=10.0)
        print('EVALUATOR ALIVE', result.status)
        print(result.output)
        """)
    env = dict(os.environ, PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", script], input=attack_source, capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_program_cannot_kill_the_evaluator():
    attack = textwrap.dedent("""\
        import os, signal
        for pid in {os.getppid(), {evaluator}}:
            try:
                signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
            except Exception as error:
                print('refused', pid, type(error).__name__)
        assert True
        """)
    done = _evaluate_in_child(attack)
    assert done.returncode == 0 and "EVALUATOR ALIVE" in done.stdout, (done.returncode, done.stdout, done.stderr)


def test_a_program_cannot_read_the_evaluators_environment():
    token = "darts-test-token-5f1e2d"
    attack = textwrap.dedent("""\
        import os
        print('ENV', dict(os.environ))
        paths = ['/proc/self/environ', '/proc/%d/environ' % os.getppid(), '/proc/{evaluator}/environ']
        try:
            paths += ['/proc/%s/environ' % p for p in os.listdir('/proc') if p.isdigit()]
        except Exception:
            pass
        for path in paths:
            try:
                print(path, open(path, 'rb').read())
            except Exception as error:
                print(path, 'refused', type(error).__name__)
        assert True
        """)
    done = _evaluate_in_child(attack, {"HF_TOKEN": token})
    assert "EVALUATOR ALIVE" in done.stdout, (done.stdout, done.stderr)
    assert token not in done.stdout, done.stdout


def _processes_named(name: str):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() == name:
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_forked_setsid_descendant_does_not_outlive_the_run():
    name = "dartsescape%d" % (os.getpid() % 10000)
    attack = textwrap.dedent(f"""\
        import sys, time
        for module in ('ctypes', '_ctypes'):
            sys.modules.pop(module, None)
        import ctypes
        libc = ctypes.CDLL(None)
        if libc.fork() == 0:
            libc.setsid()
            libc.prctl(15, b'{name}', 0, 0, 0)
            time.sleep(20)
            libc._exit(0)
        assert True
        """)
    run_program(attack, timeout=5.0)
    time.sleep(0.5)
    survivors = _processes_named(name)
    for pid in survivors:  # clean up before failing
        os.kill(pid, 9)
    assert survivors == []


# ------------------------------------------------------------------------------------- fallbacks
@pytest.fixture
def fresh_launch(monkeypatch):
    """Forget the cached launch choice (and restore it afterwards)."""
    monkeypatch.setattr(sandbox_launch, "_CHOSEN", None)
    monkeypatch.setattr(sandbox_launch, "_WARNED", False)
    yield monkeypatch


def test_without_unshare_it_falls_back_with_one_warning_and_still_holds(fresh_launch, caplog):
    fresh_launch.setattr(sandbox_launch, "UNSHARE", "/nonexistent/unshare")
    with caplog.at_level(logging.WARNING, logger=sandbox_launch.__name__):
        assert run_program("assert 1 + 1 == 2\n").passed
        assert run_program(WRONG).status == "failed"
        assert not run_program(MARKER_ATTACKS["main_module_global"] + WRONG).passed
    warnings = [r for r in caplog.records if "sandbox" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "namespaces" in warnings[0].getMessage()
    if os.getuid() == 0 and sandbox_launch.chosen_launch().user is not None:
        # still a separate unprivileged user: the evaluator cannot be signalled, fork is refused
        result = run_program("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)\n")
        assert result.status == "error" and "PermissionError" in result.output, result


def test_plain_fallback_warns_and_runs_honest_code(fresh_launch, caplog):
    fresh_launch.setattr(sandbox_launch, "UNSHARE", "/nonexistent/unshare")
    fresh_launch.setattr(sandbox_launch, "UNPRIVILEGED_UID", None)
    with caplog.at_level(logging.WARNING, logger=sandbox_launch.__name__):
        assert sandbox_launch.chosen_launch().name == "plain"
        assert run_program("assert sorted([3, 1]) == [1, 3]\n").passed
        assert not run_program(MARKER_ATTACKS["frame_walk"] + WRONG).passed
        assert run_program("while True:\n    pass\n", timeout=1.0).status == "timeout"
    assert sum("sandbox" in r.getMessage() for r in caplog.records) == 1
    assert sandbox.run_program is run_program
