"""Issue 46 items 6 and 7: what the run reads from the experts' weight files is checked from their
safetensors headers before the merge. An expert whose adapted linears have other shapes than the merge's
(a raw RuntimeError after the merge and the capture) and a damaged expert file (one line without its name,
after the merge) are one line naming the expert, the file or tensor, and what to do; a layer-stacking
merge is compared layer by layer with the slice that produces it, not with the base's layer of that number.
"""

import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import merge_yaml
from mergekit_darts.errors import DartsError

BIN = Path(sys.executable).parent


def _model_like(base: str, path: Path, **changes) -> str:
    """A random model of ``base``'s config with ``changes`` (and its tokenizer), saved to ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    for name in os.listdir(base):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(base, name), path / name)
    return str(path)


@pytest.fixture(scope="module")
def odd_shapes(tiny_family, tmp_path_factory):
    """Experts of the family's hidden size and tokenizer whose linears differ, and a 3-layer one."""
    root = tmp_path_factory.mktemp("odd-shapes")
    base = tiny_family["base"]
    return {"intermediate_size": _model_like(base, root / "narrow-mlp", intermediate_size=48),
            "num_key_value_heads": _model_like(base, root / "one-kv-head", num_key_value_heads=1),
            "three layers": _model_like(base, root / "three-layers", num_hidden_layers=3),
            "attention bias": _model_like(base, root / "attention-bias", attention_bias=True)}


def _config(paths, expert, tmp_path, merge=None, **settings):
    settings = {"rank": 4, "max_positions": 32, "steps": 2, "depth": 1, "adapter_init": "delta",
                "cache_dir": str(tmp_path / "cache"), **settings}
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in settings.items()] + [
        "  domains:", "    math:", f"      model: {expert}",
        "      calibration: {texts: ['what is 3 plus 4 ?', 'how many apples are left ?'], samples: 2}"]
    return (merge or merge_yaml(paths)) + "\n".join(lines) + "\n"


def _refused_before_merge(source: str, out) -> str:
    from mergekit_darts.pipeline import merge_and_repair

    calls = []
    with pytest.raises(DartsError) as info:
        merge_and_repair(source, str(out), lambda *args: calls.append(args))
    assert calls == [], "run_merge was called before the check"
    assert "\n" not in str(info.value) and not Path(out).exists()
    return str(info.value)


def _passes_the_checks(source: str):
    from mergekit.config import MergeConfiguration

    from mergekit_darts.config import parse_surgery_block, split_yaml
    from mergekit_darts.preflight import check_before_merge
    from mergekit_darts.settings import RunSettings

    merge_part, raw = split_yaml(source)
    surgery = parse_surgery_block(raw)
    check_before_merge(surgery, MergeConfiguration.model_validate(merge_part), RunSettings.resolve(surgery))


@pytest.mark.parametrize("changed, tensor, expert_shape, merged_shape", [
    ("intermediate_size", "model.layers.1.mlp.down_proj.weight", [32, 48], [32, 64]),
    ("num_key_value_heads", "model.layers.1.self_attn.k_proj.weight", [8, 32], [16, 32]),
])
def test_expert_with_other_linear_shapes_is_refused_before_the_merge(tiny_family, odd_shapes, tmp_path, changed,
                                                                     tensor, expert_shape, merged_shape):
    expert = odd_shapes[changed]
    message = _refused_before_merge(_config(tiny_family, expert, tmp_path), tmp_path / "out")
    assert message.startswith(f"surgery.domains.math.model: expert {expert!r} has {tensor} of shape {expert_shape}, "
                              f"but the merge's is {merged_shape} (layer 1 of {tiny_family['base']}); adapter_init: "
                              "delta starts each block adapter from expert − merge of its linear"), message
    assert message.endswith("use a fine-tune of the merge's base model, or adapter_init: zero")
    # from zero the deltas only measure the report's baseline, which then says why it is not measured
    # (delta_init.extract_start): the run is not refused, nor without block adapters
    _passes_the_checks(_config(tiny_family, expert, tmp_path, adapter_init="zero"))
    _passes_the_checks(_config(tiny_family, expert, tmp_path, depth=0, adapter_init="zero"))


def test_surgery_in_place_compares_with_the_merged_directory(tiny_family, odd_shapes, merged_copy, tmp_path):
    from mergekit_darts.pipeline import run_surgery

    source = _config(tiny_family, odd_shapes["intermediate_size"], tmp_path)
    with pytest.raises(DartsError, match=r"but the merged model's is \[32, 64\] \(layer 1 of "):
        run_surgery(source, merged_copy)


def test_a_bias_the_merge_has_and_the_expert_lacks_is_refused(tiny_family, odd_shapes, tmp_path):
    """The run reads each adapted linear's bias from the expert too, where the merge has one."""
    from mergekit_darts.pipeline import run_surgery

    merged = shutil.copytree(odd_shapes["attention bias"], tmp_path / "merged")
    with pytest.raises(DartsError, match=r"has no tensor '\*layers\.1\.self_attn\.k_proj\.bias' \(the merged model's "
                                         r"decoder layer 1, depth 1\); adapter_init: delta"):
        run_surgery(_config(tiny_family, tiny_family["math"], tmp_path), str(merged))


STACKED = """merge_method: passthrough
dtype: float32
slices:
  - sources: [{{model: {base}, layer_range: [0, 2]}}]
  - sources: [{{model: {base}, layer_range: [1, 2]}}]
"""


def test_a_layer_stacking_merge_is_compared_with_the_slice_that_makes_each_layer(tiny_family, odd_shapes, tmp_path):
    """The stacked merge has 3 layers; its layer 2 is the base's layer 1 (the base has no layer 2)."""
    stacked = STACKED.format(base=tiny_family["base"])
    _passes_the_checks(_config(tiny_family, odd_shapes["three layers"], tmp_path, merge=stacked, depth=1))
    message = _refused_before_merge(_config(tiny_family, tiny_family["math"], tmp_path, merge=stacked, depth=1),
                                    tmp_path / "out")
    assert "has no tensor '*layers.2.mlp.down_proj.weight' (the merge's decoder layer 2, depth 1)" in message, message


def _damage(path: Path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "bad length field":
        data[:8] = struct.pack("<Q", 1 << 60)
    elif kind == "bad JSON header":
        data[8] = ord("x")  # the header's opening brace
    else:  # truncated: the last tensor's data cut short
        del data[-100:]
    path.write_bytes(bytes(data))


def test_a_damaged_expert_file_is_one_line_naming_it_before_the_merge(tiny_family, tmp_path):
    """Through the real mergekit-yaml, side by side: exit non-zero, one Error line with the file's path, the
    output folder (an earlier result) untouched, no staging folder left."""
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    expected = {"bad length field": "header length field says 1152921504606846976 bytes, past the end of the file",
                "bad JSON header": "its header is not valid JSON", "truncated": "it is truncated"}
    running = {}
    for kind in expected:
        name = kind.replace(" ", "-")
        expert = Path(shutil.copytree(tiny_family["math"], tmp_path / f"expert-{name}"))
        _damage(expert / "model.safetensors", kind)
        cfg = tmp_path / f"{name}.yml"
        cfg.write_text(_config(tiny_family, expert, tmp_path, depth=0, adapter_init="zero"))
        out = tmp_path / "runs" / name / "out"
        out.mkdir(parents=True)
        (out / "earlier.txt").write_text("an earlier result")
        running[kind] = (expert / "model.safetensors", out, subprocess.Popen(
            [str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}))
    for kind, (damaged, out, process) in running.items():
        _, stderr = process.communicate(timeout=600)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert process.returncode != 0 and len(errors) == 1, (kind, stderr[-2000:])
        assert errors[0].startswith(f"Error: surgery.domains.math.model: expert '{damaged.parent}': weight file "
                                    f"{damaged} is damaged: ") and expected[kind] in errors[0], (kind, errors)
        assert "Traceback" not in stderr and "merge written" not in stderr, kind
        assert os.listdir(out) == ["earlier.txt"] and (out / "earlier.txt").read_text() == "an earlier result"
        assert os.listdir(out.parent) == ["out"], kind  # no .darts-staging-* folder beside it



@pytest.mark.parametrize("kind", ["bad length field", "bad JSON header", "truncated"])
def test_bake_and_info_read_a_damaged_merged_file_through_the_same_guarded_header_reader(tiny_family, tmp_path, kind):
    """``weight_files.safetensors_header`` is the one header reader (preflight, bake, info, the output checks):
    a damaged file is one FormatError naming it, and one Error line for ``bake`` and ``info``."""
    from click.testing import CliRunner

    from helpers import linear_surgery_output
    from mergekit_darts.cli import main
    from mergekit_darts.errors import FormatError
    from mergekit_darts.weight_files import merged_weight_map, safetensors_header

    out = Path(linear_surgery_output(tiny_family["merged"], tmp_path / "out"))
    [shard] = [p for p in out.glob("*.safetensors") if p.name != "darts.safetensors"]
    _damage(shard, kind)
    reason = {"bad length field": "header length field says 1152921504606846976 bytes, past the end of the file",
              "bad JSON header": "its header is not valid JSON", "truncated": "it is truncated"}[kind]
    with pytest.raises(FormatError, match=rf"^weight file {re.escape(str(shard))} is damaged: .*{reason}"):
        safetensors_header(str(shard))
    single = Path(shutil.copytree(tiny_family["merged"], tmp_path / "plain"))
    _damage(single / "model.safetensors", kind)
    with pytest.raises(FormatError, match=rf"weight file {re.escape(str(single / 'model.safetensors'))} is damaged"):
        merged_weight_map(str(single))
    for args in (["bake", str(out), str(tmp_path / "baked"), "--domain", "math"], ["info", str(out)]):
        result = CliRunner().invoke(main, args)
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.exit_code != 0 and len(errors) == 1, (args[0], result.output)
        assert str(shard) in errors[0] and reason in errors[0], (args[0], errors)
    assert not (tmp_path / "baked").exists()


def test_layer_linears_leaves_out_a_moe_router_as_the_emitted_blocks_do():
    """The rule is ``remote_code.blocks.is_moe_router``: a ``gate``/``router`` beside ``experts`` is a router;
    a ``gate`` without experts beside it is an ordinary linear."""
    from mergekit_darts.preflight_weights import layer_linears

    shapes = {"model.layers.0.mlp.gate.weight": (4, 8), "model.layers.0.mlp.experts.0.up_proj.weight": (16, 8),
              "model.layers.0.router.weight": (4, 8), "model.layers.0.experts.0.down_proj.weight": (8, 16),
              "model.layers.0.attn.gate.weight": (8, 8), "model.layers.0.input_layernorm.weight": (8,),
              "model.layers.1.mlp.gate.weight": (4, 8)}
    assert layer_linears(shapes, 0) == {"mlp.experts.0.up_proj": (16, 8), "experts.0.down_proj": (8, 16),
                                        "attn.gate": (8, 8)}
    assert layer_linears(shapes, 1) == {"mlp.gate": (4, 8)}
