"""What each launch mode guarantees, as docs/sandbox.md states it: the weaker modes are forced here
(no ``unshare``, no per-run uid, a non-root evaluator) and tested for what their row claims.
In every mode the verdict is computed here, so a wrong function never passes."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from sandbox_checks import TAG, attack, launch_mode, spy, watched  # noqa: F401 (watched is a fixture)

from mergekit_darts.evaluation import sandbox, sandbox_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AS_ROOT = os.geteuid() == 0
DOUBLE_FORK = textwrap.dedent("""\
    import os, time
    def f(x):
        made = 0
        for _ in range(2):
            try:
                if os.fork() == 0:
                    os.setsid()
                    if os.fork() == 0:
                        time.sleep(60)
                    os._exit(0)
                made += 1
            except OSError as error:
                print('fork refused:', error, flush=True)
        time.sleep(0.3)
        return made
    """)
FORK_BOMB = textwrap.dedent("""\
    import os, time
    def f(x):
        made = 0
        for _ in range(2000):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                made += 1
            except OSError:
                break
        return made
    """)
FILL_SHM = textwrap.dedent(f"""\
    def f(x):
        total = 0
        for i in range(40):
            try:
                with open('/dev/shm/{TAG}-%d' % i, 'wb') as out:
                    total += out.write(b'x' * (1 << 20))
            except OSError:
                break
        return total
    """)
REACH = textwrap.dedent("""\
    import os, socket
    def f(port):
        seen = {'ppid': os.getppid(), 'proc': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}
        try:
            socket.create_connection(('127.0.0.1', port), timeout=1).close()
            seen['net'] = 'connected'
        except OSError as error:
            seen['net'] = type(error).__name__
        return seen
    """)


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server


def _assert_out_of_reach(seen, evaluator_pid):
    """The program is not pid 1, sees no evaluator, reaches no host network."""
    assert seen["ppid"] == 1 and 1 in seen["proc"] and evaluator_pid not in seen["proc"] and len(seen["proc"]) <= 3
    assert seen["net"] != "connected"


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.setattr(sandbox, "_CHOSEN", None)
    monkeypatch.setattr(sandbox, "_WARNED", False)
    return monkeypatch


def test_the_strongest_mode_is_chosen_here():
    expected = "namespaces+user" if AS_ROOT else "namespaces"
    # CI runs on a machine like this one; elsewhere this says the sandbox runs weaker than it could
    assert sandbox.chosen_launch().name == expected, "unshare / user namespaces not permitted here?"


def test_without_unshare_it_falls_back_with_one_warning(fresh_choice, caplog):
    fresh_choice.setattr(sandbox_launch, "UNSHARE", "/nonexistent/unshare")
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        chosen = sandbox.chosen_launch()
        assert attack("def f(x):\n    return x + 1\n").passed
        assert attack("def f(x):\n    return x\n").status == "failed"
    warnings = [r.getMessage() for r in caplog.records if "code sandbox" in r.getMessage()]
    assert len(warnings) == 1 and repr(chosen.name) in warnings[0], warnings
    assert chosen.name == ("user" if AS_ROOT else "plain")


@pytest.mark.skipif(not AS_ROOT, reason="the user mode switches to a per-run uid: needs root")
def test_user_mode_isolates_by_uid_and_removes_what_the_run_left(watched, tmp_path):
    launch = launch_mode("user", UNSHARE="/nonexistent/unshare")
    tests, seen = spy(tmp_path, argument=str(os.getpid()))
    program = textwrap.dedent("""\
        import os
        def f(evaluator):
            seen = {}
            for name, act in (('signal', lambda: os.kill(evaluator, 0)),
                              ('environ', lambda: open('/proc/%d/environ' % evaluator, 'rb').read()),
                              ('fork', os.fork)):
                try:
                    act()
                    seen[name] = 'allowed'
                except OSError as error:
                    seen[name] = type(error).__name__
            return seen
        """)
    watched.check(attack(program, tests, launch=launch))
    assert seen() == {"signal": "PermissionError", "environ": "PermissionError", "fork": "BlockingIOError"}
    # not bounded in this mode (host /dev/shm, /tmp), but removed after the run, SysV IPC included
    tests, seen = spy(tmp_path)
    leave = FILL_SHM.replace("    return total", f"""\
    for folder in ('/tmp', '/var/tmp'):
        open(folder + '/{TAG}-left', 'w').write('left')
    import ctypes
    return [total, ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600)]  # IPC_PRIVATE, IPC_CREAT | 0600""")
    watched.check(attack(leave, tests, launch=launch))
    written, segment = seen()
    assert written == 40 << 20 and segment >= 0
    with open("/proc/sysvipc/shm") as handle:
        assert str(segment) not in [line.split()[1] for line in handle.readlines()[1:]]


@pytest.mark.skipif(not AS_ROOT, reason="uid 0 without capabilities: needs root")
def test_uid0_mode_kills_forks_at_the_end_and_bounds_their_number(watched, tmp_path):
    launch = launch_mode("namespaces-uid0", UID_RANGE=None)
    tests, seen = spy(tmp_path)
    result = watched.check(attack(DOUBLE_FORK, tests, launch=launch))
    assert result.status == "failed" and seen() == 2  # forks work here; the init killed them all
    tests, seen = spy(tmp_path)
    watched.check(attack(FORK_BOMB, tests, launch=launch, timeout=10.0))
    if "kernel.pid_max" not in watched.runs[-1].not_applied:  # per-namespace pid_max: kernel >= 6.14
        assert 0 < seen() < sandbox_launch.PID_MAX
    tests, seen = spy(tmp_path)
    writer = ("def f(x):\n    seen = {}\n    for path in ('/etc/%s', '%s/%s', '/dev/sda'):\n        try:\n"
              "            open(path, 'w').write('x')\n            seen[path] = 'written'\n"
              "        except OSError as error:\n            seen[path] = type(error).__name__\n"
              "    return seen\n") % (TAG, REPO, TAG)
    watched.check(attack(writer, tests, launch=launch))
    assert set(seen().values()) <= {"OSError", "PermissionError", "FileNotFoundError"} and "written" not in seen().values()
    assert not os.path.exists(f"/etc/{TAG}") and not os.path.exists(f"{REPO}/{TAG}")
    server = _listener()
    tests, seen = spy(tmp_path, argument=str(server.getsockname()[1]))
    watched.check(attack(REACH, tests, launch=launch))
    server.close()
    _assert_out_of_reach(seen(), os.getpid())
    tests, seen = spy(tmp_path)
    watched.check(attack(FILL_SHM, tests, launch=launch, disk_mb=16))
    assert seen() <= 16 << 20  # the private tmpfs behind /dev/shm


@pytest.mark.skipif(not AS_ROOT, reason="a root evaluator's plain child may fork: the case the check must catch")
def test_plain_mode_finds_and_kills_processes_that_outlive_the_run(tmp_path):
    launch = launch_mode("plain", UNSHARE="/nonexistent/unshare", UID_RANGE=None)
    result = attack(DOUBLE_FORK, "assert f(1) == 'never'\n", launch=launch)
    assert result.status == "error" and result.survivors == 2 and "outlived" in result.output, result
    assert attack(DOUBLE_FORK.replace("time.sleep(60)", "pass"), launch=launch).survivors == 0


@pytest.mark.skipif(not AS_ROOT or not shutil.which("setpriv"), reason="runs an evaluator as uid 1000")
def test_a_non_root_evaluator_gets_the_namespaces_mode():
    python = "/usr/bin/python%d.%d" % sys.version_info[:2]
    if not os.path.exists(python):
        pytest.skip(f"no {python} that uid 1000 can run")
    script = textwrap.dedent(f"""\
        import json, os, sys
        from mergekit_darts.evaluation import sandbox
        from mergekit_darts.evaluation.sandbox_run import Run
        tokens = []
        class Watched(Run):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                tokens.append(self.token)
        sandbox.Run = Watched
        fork = {DOUBLE_FORK!r}
        fill = {FILL_SHM!r}
        reach = {REACH!r}
        import tempfile
        spied = tempfile.mkdtemp()  # the tests run in the judge's process: what they saw comes back in files
        spy = ('import json, os\\nvalue = f(1)\\nout = open(os.path.join(%r, str(len(os.listdir(%r)))), "w")\\n'
               'json.dump(value, out)\\nout.close()\\nassert value == "never"\\n') % (spied, spied)
        def attack(program, tests='assert f(1) == 2', **kwargs):
            return sandbox.check_function(program, 'f', tests, check=None, **kwargs)
        results = [attack('def f(x):\\n    return x + 1\\n'), attack(fork, spy), attack(fill, spy, disk_mb=16),
                   attack(reach, spy.replace('f(1)', 'f(PORT)'))]
        seen = [json.load(open(os.path.join(spied, str(i)))) for i in range(len(os.listdir(spied)))]
        print(json.dumps({{"mode": sandbox.chosen_launch().name, "tokens": tokens, "seen": seen, "pid": os.getpid(),
                          "results": [[r.status, r.survivors, r.output] for r in results]}}))
        """)
    server = _listener()
    script = script.replace("PORT", str(server.getsockname()[1]))
    done = subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", python, "-c", script],
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": REPO})
    server.close()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mode"] == "namespaces"
    (right, _, _), (forked, fork_survivors, fork_output), (filled, _, _), (reached, _, _) = report["results"]
    assert right == "passed" and forked == filled == reached == "failed" and fork_survivors == 0
    _assert_out_of_reach(report["seen"][2], report["pid"])
    assert "fork refused" in fork_output and report["seen"][0] == 0  # RLIMIT_NPROC binds: uid 1000 outside
    assert report["seen"][1] <= 16 << 20  # the private tmpfs behind /dev/shm
    assert not [n for n in os.listdir("/dev/shm") if TAG in n]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        assert not any(token.encode() in environ for token in report["tokens"])


@pytest.mark.skipif(not AS_ROOT, reason="per-run uids need root")
def test_the_program_runs_without_capabilities_under_its_own_uid(watched, tmp_path):
    tests, seen = spy(tmp_path)
    program = "import os\ndef f(x):\n    return [os.getuid(), os.getgroups(), open('/proc/self/status').read()]\n"
    watched.check(attack(program, tests))
    uid, groups, status = seen()
    assert uid == watched.runs[-1].uid > 65535 and groups == []
    assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status and "NoNewPrivs:\t1" in status


def test_if_the_evaluator_dies_mid_run_nothing_of_the_run_survives():
    script = textwrap.dedent("""\
        import sys
        from mergekit_darts.evaluation import sandbox, sandbox_run
        class Announced(sandbox_run.Run):
            def start(self):
                super().start()
                print(self.token, self.uid, flush=True)
        sandbox.Run = Announced
        sandbox.check_function("def f(x):\\n    while True:\\n        pass\\n", "f", "f(1)", check=None, timeout=60)
        """)
    evaluator = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONPATH=REPO))
    token, uid = evaluator.stdout.readline().split()
    evaluator.kill()
    evaluator.wait()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = [pid for pid in _pids_with(token, uid)]
        if not left:
            break
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, 9)
    assert left == []


def _pids_with(token, uid):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        if f"DARTS_SANDBOX_RUN={token}".encode() in environ or (uid != "None" and uid in uids):
            yield int(pid)
