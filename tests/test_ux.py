"""What a new user meets: eval on small-context models, the documented example commands, warnings
printed once and readably, compare's wording, the report's KL, the bias figure, benchmark outputs."""

import json
import logging
import os
import shlex
import shutil
import sys

import pytest
from click.testing import CliRunner

from mergekit_darts.evaluation.harness import EvaluationError, evaluate, generation_length

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "ux_readme_notes.md")]
# The offline example's evaluation commands exactly as documented (docs/ux_readme_notes.md, then the
# README): they must run as printed from the repository root on the tiny example's output.
DOCUMENTED_EVAL = [
    "mergekit-darts eval tiny_out --domain math --tasks gsm8k_darts --data examples/data/gsm8k_example.jsonl "
    "--compare-none --limit 2",
    "mergekit-darts eval tiny_out --domain code --tasks humaneval_darts --allow-code-execution --limit 2",
    "mergekit-darts eval tiny_out --domain math --tasks alpaca_darts --data examples/data/alpaca_example.jsonl "
    "--output-dir gen --limit 2",
]


def _cli(args, **kwargs):
    from mergekit_darts.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False, **kwargs)


@pytest.fixture(scope="module")
def darts_dir(tiny_family, tmp_path_factory):
    """The tiny family's merge with a math and a code surgery (context 256, like the offline example)."""
    from helpers import merge_yaml

    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("ux")
    out = root / "tiny_out"
    shutil.copytree(tiny_family["merged"], out)
    cfg = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {root / 'cache'}\n  domains:\n"
        f"    math:\n      model: {tiny_family['math']}\n"
        "      calibration: {texts: ['what is 1 plus 2 ?', 'how many apples are left', 'add 3 and 4'], samples: 3}\n"
        f"    code:\n      model: {tiny_family['code']}\n"
        "      calibration: {texts: ['def sum list', 'write code to reverse a list', 'print the sum'], samples: 3}\n"
    )
    run_surgery(cfg, str(out))
    return str(out)


# --- 1. eval on a model whose context is shorter than the tasks' generation length -----------

def test_eval_clips_generation_to_a_small_context_through_lm_eval(tmp_path, caplog):
    from mergekit_darts.tiny import make_random_model

    model_dir = str(tmp_path / "ctx128")
    make_random_model(model_dir, seed=0, max_position_embeddings=128)
    with pytest.raises(EvaluationError, match=r"--max-gen-toks 512: .* context of 128 tokens.*--max-gen-toks 64"):
        generation_length(model_dir, ["gsm8k_darts"], 512)
    assert generation_length(model_dir, ["gsm8k_darts"], 20) == 20
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.evaluation.harness"):
        assert generation_length(model_dir, ["gsm8k_darts"], None) == 64
    assert "context of 128 tokens" in caplog.text and "512" in caplog.text
    # the real lm-eval run that used to fail with "requested max tokens to generate (512) must be less ..."
    data = os.path.join(REPO, "examples", "data", "gsm8k_example.jsonl")
    out = evaluate(model_dir, "none", ["gsm8k_darts"], data=data, limit=1, device="cpu")
    assert 0.0 <= out["tasks"]["gsm8k_darts"]["exact_match,strict-match"] <= 1.0
    result = _cli(["eval", model_dir, "--domain", "none", "--data", data, "--limit", "1", "--device", "cpu",
                   "--max-gen-toks", "128"])
    assert result.exit_code == 2
    assert "--max-gen-toks 128" in result.output and "context of 128 tokens" in result.output
    assert "Traceback" not in result.output


# --- 2. the example data files and the documented commands -----------------------------------

def test_example_data_files_are_in_the_tasks_formats():
    with open(os.path.join(REPO, "examples", "data", "gsm8k_example.jsonl")) as handle:
        gsm = [json.loads(line) for line in handle]
    assert len(gsm) >= 10 and all(r["question"] and "\n#### " in r["answer"] for r in gsm)
    with open(os.path.join(REPO, "examples", "data", "alpaca_example.jsonl")) as handle:
        alpaca = [json.loads(line) for line in handle]
    assert len(alpaca) >= 10 and all(r["instruction"] for r in alpaca)
    assert any("output" in r for r in alpaca) and any("output" not in r for r in alpaca)


def test_documented_eval_commands_run_as_printed(darts_dir, tmp_path, monkeypatch):
    documented = "\n".join(open(p).read() for p in DOCS if os.path.exists(p))
    monkeypatch.chdir(REPO)  # the commands use paths relative to the repository root
    for command in DOCUMENTED_EVAL:
        assert command in documented.replace("\\\n", ""), f"not documented as tested: {command}"
        args = shlex.split(command)[1:]
        args = [darts_dir if a == "tiny_out" else str(tmp_path / "gen") if a == "gen" else a for a in args]
        result = _cli(args + ["--device", "cpu"])
        assert result.exit_code == 0, result.output
        assert "generating at most 128 new tokens" in result.output  # context 256: clipped, said once
        assert result.output.count("generating at most") == 1
        table = [line for line in result.output.splitlines() if line.startswith("task")]
        assert table, result.output
    exported = json.loads((tmp_path / "gen" / "alpaca_outputs.math.json").read_text())
    assert [r["instruction"] for r in exported][:1] == ["Reverse the order of the words: red green blue"]
