"""Issue 53 ask 5: SIGTERM and SIGINT at the moments the earlier tests could not reach, sent to real
processes: during the final switch of a run (after the exchange, while the old contents are deleted)
and while ``bake`` / ``export-peft`` write their staging copy. Each process is the command line itself
(``mergekit_darts.cli.main``) with one step slowed down by a driver, so that the signal lands there;
then the one line, the exit status and what is on disk are checked. Also the leftover warning's words
and ``held_signals`` itself, in this process."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import QUICK_TEXTS, linear_surgery_output, merge_yaml

# Slows one step down: ``TARGET`` (module:Class.method or module:function) runs, then (``AFTER``) or before
# it the driver prints PAUSED and waits until the file GO exists (or 120 s), then the command goes on.
DRIVER = '''
import importlib, os, sys, time
module_name, _, attribute = os.environ["TARGET"].partition(":")
module = importlib.import_module(module_name)
owner, name = (getattr(module, attribute.split(".")[0]), attribute.split(".")[1]) if "." in attribute else (module, attribute)
original = getattr(owner, name)

def pause():
    print("PAUSED", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["GO"]) and time.monotonic() < deadline:
        time.sleep(0.05)

def slowed(*args, **kwargs):
    if os.environ.get("AFTER"):
        result = original(*args, **kwargs)
        pause()
        return result
    pause()
    return original(*args, **kwargs)

setattr(owner, name, slowed)
from mergekit_darts.cli import main
main(sys.argv[1:], prog_name="mergekit-darts")
'''


def _start(tmp_path: Path, target: str, args, after: bool = False) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TARGET=target, GO=str(tmp_path / "go"),
               AFTER="1" if after else "")
    return subprocess.Popen(
        [sys.executable, str(driver), *map(str, args)], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=env,
        # a parent that ignores SIGINT (a test runner's worker) would pass that on (test_interrupts.py)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _signal_when_paused(process: subprocess.Popen, numbers, go: Path) -> str:
    """Wait for PAUSED, send each of ``numbers`` (a second apart), let the step go on, return all of stderr."""
    seen = []
    watchdog = threading.Timer(600, process.kill)  # a hung run fails the test instead of hanging it
    watchdog.start()
    try:
        for line in process.stderr:
            seen.append(line)
            if line.strip() == "PAUSED":
                break
        else:
            raise AssertionError("the command ended before the slowed step:\n" + "".join(seen))
        for number in numbers:
            process.send_signal(number)
            time.sleep(1)
        go.touch()
        rest = process.stderr.read()
        process.wait()
    finally:
        watchdog.cancel()
    return "".join(seen) + rest


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def _staging(folder: Path):
    return sorted(folder / name for name in os.listdir(folder) if name.startswith(".darts-staging-"))


def _quick_run_config(family, cache: Path) -> str:
    return merge_yaml(family, domains=("math",)) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {cache}\n  domains:\n    math:\n      model: {family['math']}\n"
        f"      calibration: {{texts: {QUICK_TEXTS['math']}, samples: 3}}\n")


def test_a_signal_during_the_final_switch_finishes_it_or_names_what_is_left(tiny_family, tmp_path):
    """``mergekit-darts run`` over a folder that held something, stopped while the old contents are
    deleted (after the switch). SIGTERM once: the deletion finishes, the output is the new repaired merge,
    no staging folder is left, and the line says so. SIGINT twice: the second stops the deletion, and the
    line names the staging folder that holds the rest of the old contents."""
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_quick_run_config(tiny_family, tmp_path / "cache"))
    target = "mergekit_darts.output.staging:StagedOutput._remove_previous"
    runs = {}
    for number, twice in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        root = tmp_path / signal.Signals(number).name
        out = root / "out"
        out.mkdir(parents=True)
        (out / "earlier.txt").write_text("an earlier result")
        runs[number] = (root, out, twice, _start(root, target, ["run", cfg, out]))
    for number, (root, out, twice, process) in runs.items():
        stderr = _signal_when_paused(process, [number] * (2 if twice else 1), root / "go")
        line = _one_error_line(stderr)
        name = signal.Signals(number).name
        assert process.returncode == 128 + number, (name, process.returncode, stderr[-3000:])
        assert (out / "darts.safetensors").is_file() and (out / "darts_report.json").is_file(), os.listdir(out)
        assert not (out / "earlier.txt").exists()
        if not twice:
            assert line == (f"Error: interrupted by {name} while the finished result was switched in: {out} holds "
                            "this run's repaired merge (its previous contents were deleted, as every finished run "
                            "does)"), line
            assert _staging(root) == []
        else:
            [left] = _staging(root)
            assert line == (f"Error: interrupted by {name} while the previous contents of {out} were deleted: {out} "
                            f"holds this run's repaired merge; the rest of its previous contents is in {left}: "
                            "delete that folder"), line
            kept = [path for path in left.rglob("earlier.txt")]
            assert len(kept) == 1 and kept[0].read_text() == "an earlier result", list(left.rglob("*"))


@pytest.fixture(scope="module")
def repaired(tiny_family, tmp_path_factory):
    """A repaired output with linear corrections: what bake and export-peft read (no training)."""
    return linear_surgery_output(tiny_family["merged"], tmp_path_factory.mktemp("repaired") / "out")


@pytest.mark.parametrize("command,target", [("bake", "mergekit_darts.output.bake:write_weights"),
                                            ("export-peft", "mergekit_darts.output.peft_export:write_plain_base")])
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_bake_or_export_peft_writes_removes_the_partial_copy(repaired, tmp_path, command, target,
                                                                           number):
    """The signal lands after the weights (bake) or the plain base (export-peft) were written into the
    staging folder beside DEST: that partial copy is removed, DEST is not created, OUT is unchanged, and
    the command ends in one line with 128 + the signal's number."""
    dest = tmp_path / "dest"
    before = {name: os.stat(os.path.join(repaired, name)).st_mtime_ns for name in os.listdir(repaired)}
    args = [command, repaired, dest] + (["--domain", "code"] if command == "bake" else [])
    process = _start(tmp_path, target, args, after=True)
    stderr = _signal_when_paused(process, [number], tmp_path / "go")
    line = _one_error_line(stderr)
    name = signal.Signals(number).name
    assert process.returncode == 128 + number, (process.returncode, stderr[-3000:])
    assert line == (f"Error: interrupted by {name} while writing {dest}: it was not created (its partial copy "
                    "was removed)"), line
    assert not dest.exists() and _staging(tmp_path) == [], os.listdir(tmp_path)
    assert {name: os.stat(os.path.join(repaired, name)).st_mtime_ns for name in os.listdir(repaired)} == before


def test_a_signal_during_the_rename_of_a_new_folder_waits_for_it(tmp_path, monkeypatch):
    """``staged_directory``'s rename is never cut: a signal arriving in it is raised after, and the
    outcome says DEST is complete."""
    from mergekit_darts.interrupts import Interrupted
    from mergekit_darts.output import staging

    replace = os.replace

    def replace_signalled(source, target):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once: held until the rename is done
        replace(source, target)

    monkeypatch.setattr(staging.os, "replace", replace_signalled)
    dest = tmp_path / "dest"
    with pytest.raises(Interrupted) as raised:
        staging.staged_directory(str(dest), lambda stage: Path(stage, "config.json").write_text("{}"))
    assert raised.value.signal_name == "SIGTERM"
    assert raised.value.outcome == f"after {dest} was written: it is complete"
    assert (dest / "config.json").is_file() and _staging(tmp_path) == []


def test_held_signals_hold_then_raise_and_leave_ignored_signals_ignored():
    from mergekit_darts.interrupts import Interrupted, held_signals

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as raised:
        with held_signals() as held:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # a second one, not stoppable yet: held too
            finished = True
    assert finished and held.received == "SIGTERM" and raised.value.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(Interrupted):  # stoppable: the second one stops the block at once
        with held_signals() as held:
            os.kill(os.getpid(), signal.SIGTERM)
            held.stoppable = True
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("not stopped")
    with held_signals(raise_after=False):  # a cleanup: the signal is dropped
        os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_signals():  # an ignored signal stays ignored
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_leftover_warning_shows_files_as_files_and_folders_with_a_slash(tmp_path, caplog):
    """A bake's staging folder holds files; a run's holds the output's folder: each shown as what it is."""
    from mergekit_darts.output.staging import StagedOutput

    baked = tmp_path / ".darts-staging-00000001"
    baked.mkdir()
    for name in ("config.json", "model.safetensors"):
        (baked / name).write_text("{}")
    run = tmp_path / ".darts-staging-00000002"
    (run / "yesterday").mkdir(parents=True)
    (run / "notes").mkdir()
    (run / "yesterday" / "config.json").write_text("{}")
    many = tmp_path / ".darts-staging-00000003"
    many.mkdir()
    for index in range(7):
        (many / f"shard-{index}.safetensors").write_text("")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.output.staging"):
        StagedOutput(str(tmp_path / "today")).discard()
    warned = [record.getMessage() for record in caplog.records]
    tail = "; delete it when no other run is writing there"
    assert warned == [
        f"found {baked}, left by an interrupted run (holds config.json, model.safetensors){tail}",
        f"found {run}, left by an interrupted run (holds notes/, yesterday/ with a model in it){tail}",
        f"found {many}, left by an interrupted run (holds " + ", ".join(f"shard-{i}.safetensors" for i in range(5))
        + f", and 2 more){tail}",
    ], warned
