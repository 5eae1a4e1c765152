"""The pipeline in-process: surgery-only runs with each method/objective through the YAML block."""

import json

import pytest
import torch
from safetensors import safe_open

from helpers import merge_yaml
from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.pipeline import run_surgery


def _config(paths, tmp_path, **settings):
    base = dict(rank=4, max_positions=32, steps=60, lr=0.01, cache_dir=str(tmp_path / "cache"), held_out=0.25)
    base.update(settings)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in base.items()] + [
        "  domains:",
        "    math:",
        f"      model: {paths['math']}",
        "      calibration:",
        "        texts: ['how many apples are left if we have 7 and give 2 ?', 'what is 3 plus 4 ?',",
        "                'how many pears are left if we have 9 and give 4 ?', 'what is 8 minus 5 ?',",
        "                'total of 2 and 6 is ?', 'each has 3 apples how many in total ?',",
        "                'take 5 from 12 then add 1', 'give 2 pears and take 3 apples']",
    ]
    return merge_yaml(paths) + "\n".join(lines) + "\n"


@pytest.mark.parametrize("method", ["darts", "standard"])
def test_kl_with_head_correction_through_yaml(tiny_family, merged_copy, tmp_path, method):
    report = run_surgery(_config(tiny_family, tmp_path, method=method, loss="kl", head_rank=2), merged_copy,
                         progress=False)
    kl = report["domains"]["math"]["held_out_kl"]
    assert kl["after"] < kl["before"]
    with safe_open(f"{merged_copy}/darts.safetensors", "pt") as handle:
        keys = set(handle.keys())
    assert {"darts.math.head_down.weight", "darts.math.head_up.weight"} <= keys
    assert ("darts.math.position_bias" in keys) == (method == "darts")
    config = json.loads(open(f"{merged_copy}/config.json").read())
    assert config["darts"]["head_rank"] == 2 and config["darts"]["loss"] == "kl"
    # the one description of the shape: what the surgery block says is what the file says
    from mergekit_darts.pipeline import parse_config_source
    from mergekit_darts.remote_code.surgery import SurgeryShape

    surgery = parse_config_source(_config(tiny_family, tmp_path, method=method, loss="kl", head_rank=2))[1]
    shape = SurgeryShape.from_config(surgery)
    assert SurgeryShape.from_meta(config["darts"]) == shape and shape.depth == shape.depth_rank == 0
    assert {k: config["darts"][k] for k in shape.to_meta()} == shape.to_meta()


def test_rerun_with_cached_capture_loads_no_model(tiny_family, merged_copy, tmp_path, monkeypatch):
    run_surgery(_config(tiny_family, tmp_path, loss="l1"), merged_copy, progress=False)
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the capture is cached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    report = run_surgery(_config(tiny_family, tmp_path, loss="ewl1", method="standard"), merged_copy, progress=False)
    assert report["surgery"]["method"] == "standard"
    bias = report["domains"]["math"]["bias"]
    assert bias["mean_after"] < bias["mean_before"]


def test_seed_makes_runs_identical(tiny_family, merged_copy, tmp_path):
    first = run_surgery(_config(tiny_family, tmp_path, seed=3), merged_copy, progress=False)
    with safe_open(f"{merged_copy}/darts.safetensors", "pt") as handle:
        weights = {k: handle.get_tensor(k) for k in handle.keys()}
    second = run_surgery(_config(tiny_family, tmp_path, seed=3), merged_copy, progress=False)
    with safe_open(f"{merged_copy}/darts.safetensors", "pt") as handle:
        for key, value in weights.items():
            assert torch.equal(handle.get_tensor(key), value), key
    assert first["domains"]["math"]["final_loss"] == second["domains"]["math"]["final_loss"]


def test_surgery_needs_a_merged_directory(tiny_family, tmp_path):
    with pytest.raises(SurgeryConfigError, match="config.json"):
        run_surgery(_config(tiny_family, tmp_path), str(tmp_path / "missing"))
    with pytest.raises(SurgeryConfigError, match="surgery"):
        run_surgery(merge_yaml(tiny_family), str(tmp_path))


def test_unsupported_architecture_is_rejected_before_any_work(tiny_family, merged_copy, tmp_path):
    config_path = f"{merged_copy}/config.json"
    config = json.loads(open(config_path).read())
    config["architectures"] = ["LlamaForSequenceClassification"]
    open(config_path, "w").write(json.dumps(config))
    with pytest.raises(SurgeryConfigError, match="LlamaForSequenceClassification.*not supported.*LlamaForCausalLM"):
        run_surgery(_config(tiny_family, tmp_path), merged_copy)
    assert not (tmp_path / "cache").exists()


def test_mergekit_options_fill_in_seed_and_device():
    from mergekit.options import MergeOptions

    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.settings import RunSettings

    block = {"domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}}
    surgery = parse_surgery_block(block)
    resolve = RunSettings.resolve
    assert resolve(surgery, MergeOptions(random_seed=7)).seed == 7
    assert resolve(surgery, MergeOptions()).seed == 0
    assert resolve(parse_surgery_block({**block, "seed": 3}), MergeOptions(random_seed=7)).seed == 3
    assert resolve(surgery, MergeOptions(cuda=True)).device == "cuda"
    assert resolve(surgery, MergeOptions(device="cuda:1")).device == "cuda:1"
    assert resolve(surgery, MergeOptions()).device == "auto"
    assert resolve(parse_surgery_block({**block, "device": "cpu"}), MergeOptions(cuda=True)).device == "cpu"
    assert resolve(surgery, MergeOptions(trust_remote_code=True, quiet=True)).trust_remote_code is True
    assert resolve(surgery, MergeOptions(quiet=True)).progress is False


def test_calibration_is_read_once_per_domain(tiny_family, merged_copy, tmp_path, monkeypatch):
    import mergekit_darts.repair.capture.calibration as calibration

    calls = []
    original = calibration.load_calibration_texts
    monkeypatch.setattr(calibration, "load_calibration_texts",
                        lambda cal, seed, where="calibration": calls.append(where) or original(cal, seed, where))
    run_surgery(_config(tiny_family, tmp_path, steps=2), merged_copy, progress=False)
    assert calls == ["surgery.domains.math.calibration"]
