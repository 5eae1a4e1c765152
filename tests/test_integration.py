"""The user story end to end: an unchanged `mergekit-yaml` with a surgery: block, the CLI, bad configs.

Everything runs as real subprocesses on tiny random models, with the installed start-up hook.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import merge_yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env(**extra):
    env = dict(os.environ)
    env.pop("MERGEKIT_DARTS_DISABLE", None)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def _run(args, cwd, **env):
    return subprocess.run(args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _run_with_peak(args, cwd):
    """``_run``, plus the process's peak resident memory in GiB over its whole life, as the kernel
    reports it to the parent that reaps it (``wait4``): an outside measure of what ``ru_maxrss`` means."""
    with open(Path(cwd) / "run.stdout", "w+") as out, open(Path(cwd) / "run.stderr", "w+") as err:
        process = subprocess.Popen(args, cwd=cwd, env=_env(), stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + 600
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"{args[0]} ran over 600 s")
            time.sleep(0.2)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(args, process.returncode, out.read(), err.read())
    kib = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return result, usage.ru_maxrss * kib / 2 ** 30


def _surgery_block(paths, tmp_path, **overrides):
    calib = tmp_path / "math.jsonl"
    calib.write_text("".join(json.dumps({"question": f"how many apples are left if we have {i} and give 2 ?"}) + "\n"
                             for i in range(12)))
    settings = dict(method="darts", loss="ewl1", rank=4, max_positions=32, steps=20, lr=0.01,
                    default_domain="math", cache_dir=str(tmp_path / "cache"))
    settings.update(overrides)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in settings.items()]
    lines += [
        "  domains:",
        "    math:",
        f"      model: {paths['math']}",
        f"      calibration: {{path: {calib}, field: question, samples: 10}}",
        "    code:",
        f"      model: {paths['code']}",
        "      calibration:",
        "        texts: ['write a python function that adds two numbers', 'def sum list : return the total',",
        "                'write code to reverse a list', 'print the sum of 1 2 3', 'def count words']",
    ]
    return "\n".join(lines) + "\n"


def _write_config(tmp_path, paths, name="cfg.yml", **overrides):
    cfg = tmp_path / name
    cfg.write_text(merge_yaml(paths) + _surgery_block(paths, tmp_path, **overrides))
    return cfg


def _tree_digest(directory):
    digest = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            digest[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def test_mergekit_yaml_runs_the_surgery_block(tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _write_config(tmp_path, tiny_family)
    out = tmp_path / "out"
    result, lifetime_peak = _run_with_peak([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mergekit-darts: math: held-out bias" in result.stderr
    assert "torch_dtype" not in result.stderr and "Traceback" not in result.stderr  # quiet by default
    assert result.stderr.rstrip().endswith(f"mergekit-darts: repaired merge written to {out}")
    assert "holds an earlier" not in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DartsLlamaForCausalLM"]
    assert config["darts_domain"] == "math"
    assert set(config["darts"]["domains"]) == {"math", "code"}
    assert (out / "modeling_darts.py").is_file() and (out / "darts_report.json").is_file()
    report = json.loads((out / "darts_report.json").read_text())
    assert report["domains"]["math"]["calibration"]["train"] + report["domains"]["math"]["calibration"]["held_out"] == 10
    # each stage timed; the file's stages end before the export (which writes it), the console line has it
    stages = report["stages"]
    assert list(stages) == ["merge", "capture", "train:math", "train:code", "router"]
    assert all(entry["seconds"] > 0 and entry["peak_rss_gib_so_far"] > 0.1 for entry in stages.values())
    stage_line = [line for line in result.stderr.splitlines() if line.startswith("mergekit-darts: stages: merge ")]
    assert len(stage_line) == 1 and ", train math " in stage_line[0] and ", export " in stage_line[0], result.stderr[-2000:]
    assert "; peak RSS " in stage_line[0] and "GPU peak" not in stage_line[0]
    # each stage's figure is the process's peak so far, in GiB: measured against the kernel's figure for
    # the whole process, which the parent reads when it reaps it. Wrong units (KiB or bytes taken for the
    # other), another process's or the current instead of the peak RSS fail here.
    peaks = [entry["peak_rss_gib_so_far"] for entry in stages.values()]
    assert peaks == sorted(peaks), stages  # so far: a later stage never reports less than an earlier one
    assert peaks[-1] <= lifetime_peak + 0.001, (stages, lifetime_peak)
    # the line's figure is the export's (the last stage, near the exit), rounded to 0.1 GiB
    line_peak = float(re.search(r"; peak RSS ([0-9.]+) GiB", stage_line[0]).group(1))
    assert abs(line_peak - lifetime_peak) <= 0.05 + 0.02, (stage_line[0], lifetime_peak)

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("how many apples", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 4
    # the trained correction changes the output relative to the plain merge
    with torch.no_grad():
        corrected = model(**ids).logits
        model.set_darts_domain("none")
        plain = model(**ids).logits
    assert not torch.allclose(corrected, plain)


def test_without_block_output_is_plain_mergekit(tiny_family, tmp_path):
    cfg = tmp_path / "plain.yml"
    cfg.write_text(merge_yaml(tiny_family))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hooked = _run([str(BIN / "mergekit-yaml"), str(cfg), str(tmp_path / "a" / "out")], cwd=tmp_path)
    plain = _run([str(BIN / "mergekit-yaml"), str(cfg), str(tmp_path / "b" / "out")], cwd=tmp_path,
                 MERGEKIT_DARTS_DISABLE="1")
    assert hooked.returncode == 0 and plain.returncode == 0, hooked.stderr[-2000:] + plain.stderr[-2000:]
    a, b = _tree_digest(tmp_path / "a" / "out"), _tree_digest(tmp_path / "b" / "out")
    # mergekit's card lists the models in the order of a set of pydantic models, whose hash
    # involves the class's id: that order can differ between any two runs, hooked or not
    card_a = sorted((tmp_path / "a" / "out" / "README.md").read_text().splitlines())
    card_b = sorted((tmp_path / "b" / "out" / "README.md").read_text().splitlines())
    assert card_a == card_b
    a.pop("README.md"), b.pop("README.md")
    assert a == b and "model.safetensors" in a


def test_disabled_hook_ignores_the_block(tiny_family, tmp_path):
    cfg = _write_config(tmp_path, tiny_family)
    out = tmp_path / "out"
    result = _run([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, MERGEKIT_DARTS_DISABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "darts" not in config
    assert not (out / "modeling_darts.py").exists()


def test_cli_run_surgery_and_info(tiny_family, tmp_path):
    cfg = _write_config(tmp_path, tiny_family, method="standard", loss="kl")
    out = tmp_path / "out"
    result = _run([str(BIN / "mergekit-darts"), "run", str(cfg), str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["darts"]["method"] == "standard" and config["darts"]["loss"] == "kl"

    # surgery only, on a plain merged directory, with another method
    plain = tmp_path / "plain"
    merge_cfg = tmp_path / "plain.yml"
    merge_cfg.write_text(merge_yaml(tiny_family))
    assert _run([str(BIN / "mergekit-yaml"), str(merge_cfg), str(plain)], cwd=tmp_path).returncode == 0
    cfg2 = _write_config(tmp_path, tiny_family, name="cfg2.yml", method="darts", loss="l1")
    result = _run([str(BIN / "mergekit-darts"), "surgery", str(cfg2), str(plain)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # the same lines as mergekit-yaml and `run` print, and where the result went
    assert "mergekit-darts: math: held-out bias" in result.stderr
    assert result.stderr.rstrip().endswith(f"mergekit-darts: surgery written to {plain}")
    config = json.loads((plain / "config.json").read_text())
    assert config["darts"]["method"] == "darts" and config["architectures"] == ["DartsLlamaForCausalLM"]

    info = _run([str(BIN / "mergekit-darts"), "info", str(plain), "--json"], cwd=tmp_path)
    assert info.returncode == 0, info.stderr[-2000:]
    data = json.loads(info.stdout)
    assert "math" in json.dumps(data) and "code" in json.dumps(data)


BAD_CONFIGS = [
    ("typo key", dict(rnak=4), "surgery.rnak"),
    ("rank 0", dict(rank=0), "surgery.rank"),
    ("unknown loss", dict(loss="huber"), "surgery.loss"),
    ("unknown default domain", dict(default_domain="poetry"), "default_domain"),
]


@pytest.mark.parametrize("label, overrides, field", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_surgery_settings_fail_before_merging(tiny_family, tmp_path, label, overrides, field):
    cfg = _write_config(tmp_path, tiny_family, **overrides)
    _assert_fails_before_merge(cfg, tmp_path, field)


def _assert_fails_before_merge(cfg, tmp_path, field):
    out = tmp_path / "out"
    result = _run([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and field in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not out.exists(), "merge output was written before the config was validated"


@pytest.mark.parametrize("problem", ["missing file", "missing field", "unknown expert", "other hidden size"])
def test_bad_references_fail_before_merging(tiny_family, tmp_path, problem):
    from mergekit_darts.tiny import make_random_model

    text = merge_yaml(tiny_family) + _surgery_block(tiny_family, tmp_path)
    if problem == "missing file":
        text = text.replace(str(tmp_path / "math.jsonl"), str(tmp_path / "nope.jsonl"))
        field = "surgery.domains.math.calibration.path"
    elif problem == "missing field":
        text = text.replace("field: question", "field: prompt")
        field = "surgery.domains.math.calibration"
    elif problem == "unknown expert":
        text = text.replace(f"model: {tiny_family['code']}\n      calibration:",
                            f"model: {tmp_path / 'no-such-model'}\n      calibration:")
        field = "surgery.domains.code.model"
    else:
        wide = tmp_path / "wide"
        make_random_model(str(wide), hidden_size=64)
        text = text.replace(f"model: {tiny_family['code']}\n      calibration:", f"model: {wide}\n      calibration:")
        field = "surgery.domains.code.model"
    cfg = tmp_path / "bad.yml"
    cfg.write_text(text)
    _assert_fails_before_merge(cfg, tmp_path, field)


def test_startup_hook_imports_nothing_heavy(tmp_path):
    code = (
        "import sys, json; import mergekit_darts._startup as s; "
        "print(json.dumps([m for m in ('torch', 'transformers', 'pydantic', 'yaml', 'numpy', 'mergekit') "
        "if m in sys.modules] + [any(type(f).__name__ == '_MergekitFinder' for f in sys.meta_path)]))"
    )
    result = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert json.loads(result.stdout) == [True], result.stdout + result.stderr
    disabled = _run([sys.executable, "-c", code], cwd=tmp_path, MERGEKIT_DARTS_DISABLE="1")
    assert json.loads(disabled.stdout) == [False]


@pytest.mark.parametrize("version", ["standard", "editable"])
def test_wheels_install_the_startup_file(tmp_path, version):
    """Both a normal and an editable install put the .pth start-up file into site-packages."""
    from hatchling.builders.wheel import WheelBuilder

    builder = WheelBuilder(str(REPO))
    wheel = next(builder.build(directory=str(tmp_path), versions=[version]))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "mergekit_darts_hook.pth" in names
        line = archive.read("mergekit_darts_hook.pth").decode().strip()
    assert line.startswith("import ") and "import mergekit_darts._startup" in line


# a regular wheel install in a fresh virtualenv running the hook: tests/test_release.py
