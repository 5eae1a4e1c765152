"""Every command reports a broken or foreign directory, a full disk and an unreachable Hub in one
``Error:`` line naming the file and what to do, never a traceback (issue 25 items 10 and 11)."""

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(REPO, "examples", "data", "gsm8k_example.jsonl")


@pytest.fixture(scope="module")
def darts_out(tiny_family, tmp_path_factory):
    from helpers import quick_surgery_output

    root = tmp_path_factory.mktemp("cli-errors")
    return quick_surgery_output(tiny_family, root / "out", root / "cache")


def _broken(darts_out, root: Path, kind: str) -> str:
    """A copy of ``darts_out`` broken in one way (or a path that is no output directory at all)."""
    if kind == "missing directory":
        return str(root / "nowhere")
    if kind == "empty directory":
        (root / "empty").mkdir()
        return str(root / "empty")
    if kind == "a file":
        return os.path.join(darts_out, "config.json")
    out = Path(shutil.copytree(darts_out, root / "copy"))
    if kind == "newer format version":
        config = json.loads((out / "config.json").read_text())
        config["darts"]["format_version"] = 99
        (out / "config.json").write_text(json.dumps(config))
    elif kind == "string format version":  # "3" must not read as a version newer than this one
        config = json.loads((out / "config.json").read_text())
        config["darts"]["format_version"] = str(config["darts"]["format_version"])
        (out / "config.json").write_text(json.dumps(config))
    elif kind == "missing weight shard":
        (out / "model-00001-of-00001.safetensors").unlink()
    elif kind == "missing modeling_darts.py":
        (out / "modeling_darts.py").unlink()
    return str(out)


EXPECTED = {
    "missing directory": "no such directory",
    "empty directory": "the directory is empty",
    "a file": "is a file, not a directory",
    "newer format version": "config.darts.format_version 99 is not supported by this mergekit-darts",
    "string format version": "config.darts.format_version: must be an integer",
    "missing weight shard": "names model-00001-of-00001.safetensors, which is missing",
    "missing modeling_darts.py": "modeling_darts.py",
}
COMMANDS = {
    "info": lambda out, dest: ["info", out],
    "bake": lambda out, dest: ["bake", out, dest, "--domain", "math"],
    "export-peft": lambda out, dest: ["export-peft", out, dest],
    "eval": lambda out, dest: ["eval", out, "--domain", "math", "--trust-remote-code", "--data", GSM8K, "--limit", "1",
                               "--device", "cpu"],
    "push --check-only": lambda out, dest: ["push", out, "me/tiny", "--check-only"],
    "report": lambda out, dest: ["report", out, "--no-plot"],
}
# the model code matters only to what loads it; report reads only darts_report.json
NOT_NEEDED = {("missing modeling_darts.py", c) for c in ("info", "bake", "export-peft", "report")} | {
    ("newer format version", "report"), ("string format version", "report"), ("missing weight shard", "report")}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_every_command_reports_a_bad_directory_in_one_line(darts_out, tmp_path, kind):
    from mergekit_darts.cli import main

    out = _broken(darts_out, tmp_path, kind)
    for command, args in COMMANDS.items():
        if (kind, command) in NOT_NEEDED:
            continue
        dest = str(tmp_path / f"dest-{command.split()[0]}")
        result = CliRunner().invoke(main, args(out, dest), catch_exceptions=False)  # a traceback fails the test
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 2 and len(errors) == 1, (command, result.output[-1500:])
        assert EXPECTED[kind] in errors[0], (command, errors[0])
        assert "not a mergekit-darts output" not in errors[0] or kind not in ("missing directory", "empty directory")
        assert not os.path.exists(dest), command  # nothing half-written


def _limited(args, limit_bytes: int, **kwargs):
    """``args`` in a fresh process whose files cannot grow past ``limit_bytes`` (RLIMIT_FSIZE: a write
    past it fails with EFBIG, what a full disk does with ENOSPC)."""
    def limit():
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, preexec_fn=limit,
                          env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, **kwargs)


def _one_error(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def _surgery_yaml(family, cache) -> str:
    from helpers import merge_yaml

    return merge_yaml(family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {cache}\n  domains:\n    math:\n      model: {family['math']}\n"
        "      calibration: {texts: ['what is 1 plus 2 ?', 'add 3 and 4'], samples: 2}\n")


def test_full_disk_during_the_merge_is_one_line(tiny_family, tmp_path):
    """mergekit's raw SafetensorError/OSError when the merged shard cannot be written."""
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_surgery_yaml(tiny_family, tmp_path / "cache"))
    out = tmp_path / "out"
    script = "import sys; from mergekit.scripts.run_yaml import main; sys.argv[0] = 'mergekit-yaml'; main()"
    error = _one_error(_limited([sys.executable, "-c", script, str(cfg), str(out)], 50_000, cwd=tmp_path))
    assert error.startswith(f"Error: merge (staged for {out}, which is unchanged)") and "free disk space" in error
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".darts-staging-")]


def test_full_disk_during_the_export_is_one_line(tiny_family, merged_copy, tmp_path):
    """The surgery's own files (darts.safetensors, ~6 kB here) cannot be written: one line, the merged
    directory exactly as it was (the cache's failed writes are warnings)."""
    before = {p.name: p.read_bytes() for p in Path(merged_copy).iterdir()}
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_surgery_yaml(tiny_family, tmp_path / "cache"))
    result = _limited([sys.executable, "-c", "from mergekit_darts.cli import main; main()", "surgery", str(cfg),
                       merged_copy], 4096)
    error = _one_error(result)
    assert error.startswith(f"Error: surgery ({merged_copy} is left as it was)") and "free disk space" in error
    assert {p.name: p.read_bytes() for p in Path(merged_copy).iterdir()} == before


def test_push_to_an_unreachable_hub_is_one_line(darts_out, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_unused",
           "HF_HOME": str(tmp_path / "hf_home"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    result = subprocess.run([sys.executable, "-c", "from mergekit_darts.cli import main; main()", "push", darts_out,
                             "me/tiny"], capture_output=True, text=True, env=env, timeout=300)
    error = _one_error(result)
    assert "cannot reach the Hub at http://127.0.0.1:9" in error and "HF_ENDPOINT" in error

