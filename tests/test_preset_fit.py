"""``preset: best`` fits the model it is given (issue 46 item 5) and trains a fixed step count (issue 52): what
it lowers is logged and in the report's preset settings, and a key written in the YAML is never changed (still
refused when invalid)."""

import json
import os
import subprocess
import sys
from pathlib import Path

DOMAINS = {"math": {"model": "m", "calibration": {"texts": ["a b"]}}}
REPO = Path(__file__).resolve().parents[1]


def _block(**keys):
    from mergekit_darts.config import parse_surgery_block

    return parse_surgery_block({"preset": "best", **keys, "domains": DOMAINS})


def test_the_preset_trains_its_steps_on_minibatches_and_a_written_early_stopping_turns_it_on():
    best = _block()
    assert (best.early_stopping, best.steps, best.batch_size, best.depth, best.depth_rank) == (False, 500, 12, "all", 8)
    assert _block(steps=0).steps == 0  # the extract: nothing trained (no error either)
    stopped = _block(early_stopping=True)
    assert stopped.early_stopping is True and (stopped.eval_every, stopped.patience) == (25, 8)  # the schema's
    assert _block(early_stopping=True, patience=2).patience == 2


def test_fit_lowers_only_what_the_preset_set_and_says_why():
    from mergekit_darts.presets import fit_preset, preset_settings

    fitted, changes = fit_preset(_block(), hidden_size=32)
    assert (fitted.rank, fitted.depth_rank, fitted.head_rank) == (32, 8, 0)
    assert changes == {"rank": {"preset": 64, "used": 32, "why": "the merged model's hidden size is 32"}}
    assert preset_settings(fitted)["fitted"] == changes and preset_settings(fitted)["rank"] == 32
    assert "fitted" not in preset_settings(_block())
    tiny, changes = fit_preset(_block(), hidden_size=4)
    assert (tiny.rank, tiny.depth_rank) == (4, 4) and set(changes) == {"rank", "depth_rank"}
    # a written rank is the user's: left for the checks to refuse by name
    written, changes = fit_preset(_block(rank=64), hidden_size=32)
    assert written.rank == 64 and changes == {}
    assert fit_preset(fitted, hidden_size=32)[1] == {}  # fitted once: nothing more to lower


def _offline_example(tmp_path) -> Path:
    """`mergekit-darts example`'s family and YAML in ``tmp_path``, the YAML's training keys replaced by the preset
    (a few steps, to stay cheap) and the code domain cut to 3 prompts (2 train: fewer than a minibatch)."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(bin_dir / "mergekit-darts"), "example"], cwd=tmp_path, check=True, capture_output=True,
                   env=env, timeout=600)
    text = (tmp_path / "tiny_offline.yml").read_text()
    for line in ("  method: darts\n", "  loss: ewl1\n", "  rank: 4\n", "  steps: 100\n", "  lr: 1.0e-2\n",
                 "  content: linear         # foldable into the LM head (bake, export-peft); the paper's default is relu\n"):
        assert line in text, line
        text = text.replace(line, "")
    text = text.replace("surgery:\n", "surgery:\n  preset: best\n  steps: 6\n  device: cpu\n")
    text = text.replace("        samples: 6 ", "        samples: 3 ")
    return Path(tmp_path / "tiny_offline.yml"), text


def test_mergekit_yaml_fits_the_preset_to_the_offline_example(tmp_path):
    """The offline example (hidden size 32) with ``preset: best``: refused before (rank 64 > 32), now trained
    with rank 32, the change logged and in the report; its 3-prompt domain trains on what it has."""
    from transformers import AutoModelForCausalLM

    config, text = _offline_example(tmp_path)
    config.write_text(text)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(bin_dir / "mergekit-yaml"), str(config), "out"], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preset: best: rank: 64 -> 32 (the merged model's hidden size is 32)" in result.stderr
    report = json.loads((tmp_path / "out" / "darts_report.json").read_text())
    settings = report["surgery"]["preset_settings"]
    assert report["surgery"]["rank"] == settings["rank"] == 32 and settings["depth_rank"] == 8
    assert settings["fitted"]["rank"] == {"preset": 64, "used": 32, "why": "the merged model's hidden size is 32"}
    assert set(settings["fitted"]) == {"rank"} and report["surgery"]["early_stopping"] is False
    assert settings["batch_size"] == 12 and report["domains"]["code"]["calibration"]["validation"] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert model.darts["math"].shape.rank == 32 and model.darts["code"].shape.depth_rank == 8


def test_a_rank_written_beside_the_preset_is_still_refused_before_the_merge(tmp_path):
    config, text = _offline_example(tmp_path)
    config.write_text(text.replace("  preset: best\n", "  preset: best\n  rank: 64\n"))
    result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), "out"], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert result.returncode != 0
    assert "surgery.rank: 64 exceeds the merged model's hidden size 32" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_preset_domain_without_continue_tokens_is_warned_about():
    """Issue 54 ask 2: every figure of preset: best was measured with continue_tokens, whose length is the
    domain's, so the preset cannot set it; a domain without it gets one line before the merge saying what
    the run does without it."""
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.presets import continuation_warning

    domains = {"math": {"model": "m", "calibration": {"texts": ["a"], "continue_tokens": 48}},
               "code": {"model": "c", "calibration": {"texts": ["b"]}}}
    warning = continuation_warning(parse_surgery_block({"preset": "best", "domains": domains}))
    assert warning.startswith("preset: best: surgery.domains.code.calibration set(s) no continue_tokens")
    assert "math" not in warning and "no behaviour figures" in warning
    domains["code"]["calibration"]["continue_tokens"] = 16
    assert continuation_warning(parse_surgery_block({"preset": "best", "domains": domains})) is None
    del domains["code"]["calibration"]["continue_tokens"]
    assert continuation_warning(parse_surgery_block({"domains": domains})) is None  # the paper's defaults: no claim
