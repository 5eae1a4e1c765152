"""Every check of issue 14 that must stop a run BEFORE mergekit merges anything: each one a one-line
error naming the field (or, for the expert that is the output itself, a warning).

In-process through ``pipeline.merge_and_repair`` with a ``run_merge`` that records calls (the checks
must leave it uncalled); one case runs the real ``mergekit-yaml`` to show the user sees one line.
"""

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import merge_yaml
from mergekit_darts.errors import DartsError

BIN = Path(sys.executable).parent


def _block(paths, tmp_path, domains_yaml=None, **settings):
    base = dict(rank=4, max_positions=32, steps=5, lr=0.01, cache_dir=str(tmp_path / "cache"))
    base.update(settings)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in base.items()]
    lines += ["  domains:"] + (domains_yaml or [
        "    math:",
        f"      model: {paths['math']}",
        "      calibration: {texts: ['what is 3 plus 4 ?', 'how many apples are left ?']}",
        "    code:",
        f"      model: {paths['code']}",
        "      calibration: {texts: ['def sum list', 'write a python function']}",
    ])
    return merge_yaml(paths) + "\n".join(lines) + "\n"


def _fails_before_merge(source: str, out) -> str:
    """The run's error message; asserts mergekit was never called and nothing was written."""
    from mergekit_darts.pipeline import merge_and_repair

    calls = []
    with pytest.raises(DartsError) as info:
        merge_and_repair(source, str(out), lambda *args: calls.append(args))
    assert calls == [], "run_merge was called before the check"
    message = str(info.value)
    assert "\n" not in message
    assert not Path(out).exists() or Path(out) == Path("/sys")
    return message


@pytest.fixture(scope="module")
def odd_experts(tiny_family, tmp_path_factory):
    """A Mistral expert and a Llama expert with a shuffled tokenizer, both of the family's sizes."""
    from transformers import AutoConfig

    from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_random_model

    root = tmp_path_factory.mktemp("odd")
    reference = AutoConfig.from_pretrained(tiny_family["base"])
    sizes = dict(hidden_size=reference.hidden_size, vocab_size=reference.vocab_size)
    make_random_model(str(root / "mistral"), arch="mistral", **sizes)
    words = list(DEFAULT_WORDS)
    random.Random(0).shuffle(words)
    make_random_model(str(root / "shuffled"), tokenizer=build_tokenizer(words), **sizes)
    return {"mistral": str(root / "mistral"), "shuffled": str(root / "shuffled")}


@pytest.mark.parametrize("settings, field", [
    (dict(seed="1e25"), "surgery.seed"),
    (dict(seed=10**25), "surgery.seed"),
    (dict(rank=1000000000), "surgery.rank"),
    (dict(max_positions=1000000000), "surgery.max_positions"),
    (dict(rank=64), "surgery.rank"),  # above the tiny models' hidden size 32
    (dict(rank="true"), "surgery.rank"),
    (dict(steps="yes"), "surgery.steps"),
    (dict(lr="true"), "surgery.lr"),
], ids=["seed-1e25-string", "seed-1e25-int", "rank-1e9", "max_positions-1e9", "rank-above-hidden", "rank-true",
        "steps-yes", "lr-true"])
def test_bad_numbers_are_errors(tiny_family, tmp_path, settings, field):
    message = _fails_before_merge(_block(tiny_family, tmp_path, **settings), tmp_path / "out")
    assert message.startswith(field), message


def test_device_that_is_not_there(tiny_family, tmp_path):
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    message = _fails_before_merge(_block(tiny_family, tmp_path, device=device), tmp_path / "out")
    assert message.startswith("surgery.device") and "CUDA" in message


def test_duplicate_domain_keys(tiny_family, tmp_path):
    domains = ["    math:", f"      model: {tiny_family['math']}", "      calibration: {texts: ['a b']}",
               "    math:", f"      model: {tiny_family['code']}", "      calibration: {texts: ['c d']}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert "duplicate key 'math'" in message


@pytest.mark.parametrize("name", ["keys", "forward", "items", "training", "_modules"])
def test_domain_names_that_nn_moduledict_refuses(tiny_family, tmp_path, name):
    domains = [f"    {name}:", f"      model: {tiny_family['math']}", "      calibration: {texts: ['a b']}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert message.startswith("surgery.domains") and repr(name) in message
    with pytest.raises(KeyError):  # what the emitted model would hit at load time
        torch.nn.ModuleDict({name: torch.nn.Linear(1, 1)})


def test_expert_of_another_architecture(tiny_family, odd_experts, tmp_path):
    source = _block(tiny_family, tmp_path).replace(f"model: {tiny_family['code']}", f"model: {odd_experts['mistral']}")
    message = _fails_before_merge(source, tmp_path / "out")
    assert message.startswith("surgery.domains.code.model") and "MistralForCausalLM" in message


def test_expert_with_another_tokenizer(tiny_family, odd_experts, tmp_path):
    source = _block(tiny_family, tmp_path).replace(f"model: {tiny_family['code']}", f"model: {odd_experts['shuffled']}")
    message = _fails_before_merge(source, tmp_path / "out")
    assert message.startswith("surgery.domains.code.model") and "tokenizer" in message


def _calibration_file(tmp_path, values):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"question": value}) + "\n" for value in values))
    return path


@pytest.mark.parametrize("kind", ["empty texts", "null records", "unencodable records"])
def test_calibration_texts_that_give_nothing(tiny_family, tmp_path, kind):
    if kind == "empty texts":
        calibration = "{texts: ['', '   ']}"
    else:
        values = [None, None, None] if kind == "null records" else ["\ud800", "\udfff \ud800"]
        calibration = f"{{path: {_calibration_file(tmp_path, values)}, field: question}}"
    domains = ["    math:", f"      model: {tiny_family['math']}", f"      calibration: {calibration}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert message.startswith("surgery.domains.math.calibration"), message


def test_read_only_output_directory(tiny_family, tmp_path):
    if os.geteuid() == 0:  # permissions do not bind root: a read-only file system does (sysfs)
        read_only, out = Path("/sys"), Path("/sys/darts-out")
    else:
        read_only = tmp_path / "locked"
        read_only.mkdir()
        read_only.chmod(0o555)
        out = read_only / "out"
    try:
        message = _fails_before_merge(_block(tiny_family, tmp_path), out)
    finally:
        if read_only != Path("/sys"):
            read_only.chmod(0o755)
    assert message.startswith("output directory") and str(read_only) in message and not out.exists()


def test_expert_that_is_the_output_directory_warns(tiny_family, tmp_path, caplog):
    from mergekit.config import MergeConfiguration

    from mergekit_darts.pipeline import parse_config_source
    from mergekit_darts.preflight import check_before_merge
    from mergekit_darts.settings import RunSettings

    merge_part, surgery = parse_config_source(_block(tiny_family, tmp_path))
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.preflight"):
        check_before_merge(surgery, MergeConfiguration.model_validate(merge_part), RunSettings.resolve(surgery),
                           out_path=tiny_family["code"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("surgery.domains.code.model" in w and "output directory" in w for w in warnings), warnings
    assert not any("surgery.domains.math.model" in w for w in warnings)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_mergekit_yaml_reports_missing_cuda_in_one_line_before_merging(tiny_family, tmp_path):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_block(tiny_family, tmp_path, device="cuda"))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    result = subprocess.run([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "surgery.device" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not out.exists()
    assert not any(name.startswith(".darts-staging-") for name in os.listdir(tmp_path))
