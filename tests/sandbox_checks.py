"""Shared by the sandbox tests: run an attack, and check independently that nothing of a run remains."""

import json
import os

import pytest

from mergekit_darts.evaluation import sandbox, sandbox_launch, sandbox_run
from mergekit_darts.evaluation.sandbox import check_function

TAG = "darts-attack-%d" % os.getpid()
RIGHT = "assert f(1) == 2\nassert f(5) == 6\n"  # f is wrong in every attack


def _host_files():
    found = []
    for root in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            found += [os.path.join(root, n) for n in os.listdir(root) if TAG in n]
        except OSError:
            pass
    return found


def _shm_used():
    info = os.statvfs("/dev/shm")
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def _live_processes_of(run):
    """Found independently of the sandbox's own check: the run's token in the environment, its uid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                marked = f"DARTS_SANDBOX_RUN={run.token}".encode() in handle.read().split(b"\0")
            with open(f"/proc/{pid}/status") as handle:
                uids = next(line for line in handle if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if marked or (run.uid is not None and str(run.uid) in uids):
            found.append(int(pid))
    return found


@pytest.fixture
def watched(monkeypatch):
    """Records every run; ``watched.check()`` asserts that nothing of them remains."""
    runs = []

    class Watched(sandbox_run.Run):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self)

    monkeypatch.setattr(sandbox, "Run", Watched)
    shm_before = _shm_used()

    def check(result):
        assert result.survivors == 0, result
        assert runs, "no run was made"
        for run in runs:
            assert _live_processes_of(run) == [], run.launch.name
            assert run._workdir is None or not os.path.exists(run._workdir)
        assert _host_files() == []
        assert _shm_used() - shm_before < 4 << 20
        return result

    watched.check = check
    watched.runs = runs
    return watched


def attack(program, tests=RIGHT, **kwargs):
    kwargs.setdefault("timeout", 5.0)
    return check_function(program, "f", tests, check=None, **kwargs)


def spy(tmp_path, argument="1"):
    """Tests that keep what ``f`` returned (here, in the trusted process); no attack returns "never"."""
    path = str(tmp_path / "seen.json")
    tests = f"import json\nvalue = f({argument})\nwith open({path!r}, 'w') as out:\n    json.dump(value, out)\nassert value == 'never'\n"
    return tests, lambda: json.loads(open(path).read())


# every launch mode, with the settings that force it here (docs/sandbox.md has what each guarantees)
MODES = {"namespaces+user": {}, "user": {"UNSHARE": "/nonexistent/unshare"}, "namespaces": {},
         "namespaces-uid0": {"UID_RANGE": None}, "plain": {"UNSHARE": "/nonexistent/unshare", "UID_RANGE": None}}
_PROBED = {}


def launch_mode(name, **settings):
    """The first launch called ``name`` that works here with ``settings`` applied, else skip."""
    key = (name, tuple(sorted(settings.items())))
    if key not in _PROBED:
        saved = {setting: getattr(sandbox_launch, setting) for setting in settings}
        for setting, value in settings.items():
            setattr(sandbox_launch, setting, value)
        try:
            _PROBED[key] = next((c for c in sandbox_launch.candidates() if c.name == name and sandbox._works(c)), None)
        finally:
            for setting, value in saved.items():
                setattr(sandbox_launch, setting, value)
    if _PROBED[key] is None:
        pytest.skip(f"launch mode {name!r} is not available on this machine")
    return _PROBED[key]


@pytest.fixture(params=list(MODES))
def every_mode(request):
    """Each launch mode this machine permits (the others are skipped, saying which)."""
    return launch_mode(request.param, **MODES[request.param])
