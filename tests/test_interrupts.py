"""Issue 46 item 10: SIGTERM during a run is handled like Ctrl-C, with real signals sent to real
``mergekit-yaml`` processes: one line saying where the output is, exit 128 + the signal's number, the
plain merge kept or the output unchanged as docs/reliability.md says, no ``.darts-staging-*`` folder
left. A staging folder left by a killed run is reported by the next run whatever output it targets."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import merge_yaml

BIN = Path(sys.executable).parent


def _long_surgery(paths, cache_dir) -> str:
    """A surgery that trains far longer than the test waits (it is always interrupted)."""
    return merge_yaml(paths, domains=("math",)) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 5000000\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {cache_dir}\n  domains:\n    math:\n      model: {paths['math']}\n"
        "      calibration: {texts: ['what is 1 plus 2 ?', 'how many apples are left', 'add 3 and 4'], samples: 3}\n")


def _start(cfg: Path, out: Path, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    return subprocess.Popen(
        [str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        # a parent that ignores SIGINT (a test runner's worker) would pass that on: Python then never raises
        # KeyboardInterrupt; the user's shell does not ignore it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupt_once_training(process: subprocess.Popen, number: int) -> str:
    """Wait for the surgery to start (its stage line), send ``number``, return all of stderr."""
    seen = []
    watchdog = threading.Timer(900, process.kill)  # a hung run fails the test instead of hanging it
    watchdog.start()
    try:
        for line in process.stderr:
            seen.append(line)
            if "capturing hidden states" in line:
                break
        else:
            raise AssertionError("the run ended before the surgery started:\n" + "".join(seen))
        time.sleep(3)  # into the capture or the training: both are the surgery, after the merge
        process.send_signal(number)
        rest = process.stderr.read()  # the same buffered reader to the end (the process closes it on exit)
        process.wait()
    finally:
        watchdog.cancel()
    return "".join(seen) + rest


def _staging_left(parent: Path):
    return [name for name in os.listdir(parent) if name.startswith(".darts-staging-")]


def test_sigterm_and_sigint_during_the_surgery_end_in_one_line_and_clean_up(tiny_family, tmp_path):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_long_surgery(tiny_family, tmp_path / "cache"))
    fresh = tmp_path / "term" / "out"  # held nothing: becomes the plain merge
    kept = tmp_path / "int" / "out"  # held something: left as it was, the plain merge beside it
    fresh.parent.mkdir()
    kept.mkdir(parents=True)
    (kept / "earlier.txt").write_text("an earlier result")
    runs = {signal.SIGTERM: (fresh, _start(cfg, fresh, tmp_path)), signal.SIGINT: (kept, _start(cfg, kept, tmp_path))}
    for number, (out, process) in runs.items():
        stderr = _interrupt_once_training(process, number)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert process.returncode == 128 + number, (number, process.returncode, stderr[-3000:])
        assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
        name = signal.Signals(number).name
        assert _staging_left(out.parent) == [], (name, os.listdir(out.parent))
        if number == signal.SIGTERM:
            assert errors[0] == (f"Error: interrupted by SIGTERM during the surgery: {out} is left as the plain merge "
                                 f"of this config; `mergekit-darts surgery CONFIG {out}` repairs it without merging "
                                 "again"), errors
            config = json.loads((out / "config.json").read_text())
            assert "darts" not in config and config["architectures"] == ["LlamaForCausalLM"]
            assert (out / "model.safetensors").is_file() and not (out / "darts.safetensors").exists()
        else:
            beside = [p for p in os.listdir(out.parent) if p.startswith("out.plain-merge-")]
            assert len(beside) == 1 and (out.parent / beside[0] / "config.json").is_file(), os.listdir(out.parent)
            assert errors[0] == (f"Error: interrupted by SIGINT during the surgery: {out} is unchanged; the new plain "
                                 f"merge is kept at {out.parent / beside[0]}: repair it with `mergekit-darts surgery "
                                 f"CONFIG {out.parent / beside[0]}` and move it into place, or delete it"), errors
            assert os.listdir(out) == ["earlier.txt"] and (out / "earlier.txt").read_text() == "an earlier result"


def test_a_leftover_staging_folder_is_reported_whatever_output_the_next_run_targets(tmp_path, caplog):
    """SIGKILL cannot be handled: its staging folder (a whole plain merge) stays; the next run into the same
    parent folder names it, also when it targets another output name (before, only the same name warned)."""
    from mergekit_darts.output.staging import StagedOutput

    leftover = tmp_path / ".darts-staging-0badf00d" / "yesterday"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.output.staging"):
        stage = StagedOutput(str(tmp_path / "today"))
    stage.discard()
    warned = [record.getMessage() for record in caplog.records]
    assert warned == [f"found {leftover.parent}, left by an interrupted run (holds yesterday/ with a model in it); "
                      "delete it when no other run is writing there"], warned
    assert leftover.is_dir()  # reported, never deleted: another run may be writing there
