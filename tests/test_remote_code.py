"""The two files shipped into every output directory, and the format they read (config.json darts entry)."""

import ast
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergekit_darts import config as config_module
from mergekit_darts.output import export as export_module
from mergekit_darts.output import layout
from mergekit_darts.remote_code import modeling_darts, surgery
from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape

DATA = Path(__file__).parent / "data"


def test_modeling_files_import_only_torch_and_transformers():
    """What runs on every user's machine via trust_remote_code: torch/transformers and the shipped files'
    own relative imports only, no file, process or network access."""
    folder = export_module.PACKAGE_DIR
    shipped = {"surgery", "blocks", "routing", "hooks", "generation"}
    allowed = {"modeling_darts.py": {"torch", "transformers", "typing", *shipped},
               "surgery.py": {"dataclasses", "typing", "torch", "blocks"},
               "blocks.py": {"typing", "torch"},
               "routing.py": {"typing", "torch"},
               "hooks.py": {"threading", "dataclasses", "functools", "typing", "torch", "transformers", "routing",
                            "surgery"},
               "generation.py": {"threading", "typing", "torch", "hooks", "routing"}}
    assert sorted(allowed) == sorted(layout.MODELING_FILES)
    for name, modules in allowed.items():
        source = open(os.path.join(folder, name)).read()
        for pattern in (r"\bopen\(", r"\brequests\b", r"\burllib\b", r"\bos\.", r"\bsubprocess\b", r"\bsocket\b"):
            assert not re.search(pattern, source), (name, pattern)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
                if node.level:
                    assert node.module in shipped, (name, node.module)
            else:
                continue
            assert roots <= modules, (name, roots)


def test_shipped_constants_match_the_package():
    """The remote code repeats a few names it cannot import; they must agree with the package's."""
    assert set(layout.SUPPORTED_ARCHITECTURES) == set(modeling_darts.DARTS_CLASSES)
    for arch, cls in modeling_darts.DARTS_CLASSES.items():
        assert cls.__name__ == layout.ARCH_PREFIX + arch
    assert modeling_darts.NONE_DOMAIN == layout.NONE_DOMAIN
    assert surgery.METHODS == config_module.METHODS
    assert surgery.CONTENT_KINDS == config_module.CONTENTS


def test_shape_meta_round_trip_and_strictness():
    shape = SurgeryShape(method="darts", rank=4, head_rank=2, max_positions=8, content="linear")
    meta = shape.to_meta()
    assert meta["format_version"] == surgery.FORMAT_VERSION
    assert SurgeryShape.from_meta(meta) == shape
    module = DomainSurgery.from_shape(shape, hidden_size=16, vocab_size=10)
    assert module.shape == shape
    with pytest.raises(ValueError, match="missing rank"):
        SurgeryShape.from_meta({k: v for k, v in meta.items() if k != "rank"})
    with pytest.raises(ValueError, match="format_version 99.*upgrade"):
        SurgeryShape.from_meta({**meta, "format_version": 99})
    with pytest.raises(ValueError, match="content"):
        SurgeryShape.from_meta({**meta, "content": "tanh"})
    with pytest.raises(ValueError, match="rank"):
        SurgeryShape(method="darts", rank=True, head_rank=0, max_positions=8, content="relu")


def test_linear_content_has_no_relu():
    torch.manual_seed(0)
    relu = DomainSurgery(8, rank=3, max_positions=4, method="standard")
    linear = DomainSurgery(8, rank=3, max_positions=4, method="standard", content="linear")
    linear.load_state_dict(relu.state_dict())
    with torch.no_grad():
        for module in (relu, linear):
            module.up.weight.normal_()
    linear.up.weight.data.copy_(relu.up.weight)
    h = torch.randn(2, 5, 8)
    expected = h - (h @ relu.down.weight.T) @ relu.up.weight.T
    assert torch.allclose(linear(h), expected, atol=1e-5)
    assert not torch.allclose(relu(h), expected, atol=1e-3)


def test_directory_written_by_version_0_1_0_still_loads(tmp_path):
    """tests/data/v0_1_0_output was written by mergekit-darts 0.1.0 (format 1: no format_version, no
    content key); the logits beside it were computed by that version's classes."""
    out = tmp_path / "v010"
    shutil.copytree(DATA / "v0_1_0_output", out)
    expected = load_file(DATA / "v0_1_0_expected.safetensors")
    assert "format_version" not in layout.read_darts_entry(str(out))
    for domain in ("math", "code", "none"):
        model = modeling_darts.DartsLlamaForCausalLM.from_pretrained(str(out), darts_domain=domain).eval()
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits[0]
        assert torch.allclose(logits, expected[f"logits.{domain}"], atol=1e-5), domain
    info = export_module.read_darts_info(str(out))
    assert info["format_version"] == 1 and info["content"] == "relu" and info["head_rank"] == 2
    # a new export over it writes the current format
    modules = {"math": DomainSurgery(32, rank=4, max_positions=8)}
    export_module.export_surgery(str(out), modules, {"math": "experts/math"}, "math", loss="ewl1")
    assert layout.read_darts_entry(str(out))["format_version"] == surgery.FORMAT_VERSION


# ------------------------------------------------------------------------- clear errors when loading

@pytest.fixture(scope="module")
def small_darts(tmp_path_factory):
    from loading_helpers import make_tiny_darts_dir

    path = tmp_path_factory.mktemp("errors") / "darts"
    make_tiny_darts_dir(str(path), head_rank=0)
    return path


def broken_copy(source, target, tensors=None, config=None):
    """A copy of ``source`` with some darts tensors replaced and/or config.json's darts entry edited."""
    import json

    from safetensors.torch import save_file

    shutil.copytree(source, target)
    if tensors:
        shard = target / layout.DARTS_SHARD
        save_file({**load_file(shard), **tensors}, shard, metadata={"format": "pt"})
    if config:
        with open(target / "config.json") as handle:
            data = json.load(handle)
        config(data)
        with open(target / "config.json", "w") as handle:
            json.dump(data, handle)
    return str(target)


def load_remote(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs)


def test_damaged_darts_tensors_are_refused_naming_tensor_and_file(small_darts, tmp_path):
    up = load_file(small_darts / layout.DARTS_SHARD)["darts.math.up.weight"]
    for value in (float("nan"), float("inf")):
        damaged = up.clone()
        damaged[1, 0] = value
        path = broken_copy(small_darts, tmp_path / f"bad_{value}", tensors={"darts.math.up.weight": damaged})
        with pytest.raises(ValueError, match=r"darts\.math\.up\.weight in .*darts\.safetensors: 1 of \d+ values are "
                                             r"NaN or infinite"):
            load_remote(path)
    path = broken_copy(small_darts, tmp_path / "shape", tensors={"darts.code.position_bias": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match=r"darts\.code\.position_bias in .*darts\.safetensors: shape \(3, 64\) in "
                                         r"the file, but config\.darts describes \(6, 64\)"):
        load_remote(path)


def test_config_problems_are_clear_value_errors(small_darts, tmp_path):
    cases = {
        "string_version": (lambda c: c["darts"].update(format_version="3"),
                           r"config\.darts\.format_version: must be an integer, got '3' \(str\)"),
        "no_darts_entry": (lambda c: c.pop("darts"), r"config\.darts: config\.json has no darts entry"),
        "no_domains": (lambda c: c["darts"].pop("domains"), r"config\.darts\.domains: missing"),
        "empty_domain_name": (lambda c: c.update(darts_domain=""), r"darts_domain: unknown domain ''"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_remote(broken_copy(small_darts, tmp_path / name, config=edit))
    with pytest.raises(ValueError, match=r"darts_domain: unknown domain ''"):
        load_remote(str(small_darts), darts_domain="")
    with pytest.raises(ValueError, match="format_version 99.*upgrade"):
        load_remote(broken_copy(small_darts, tmp_path / "future", config=lambda c: c["darts"].update(format_version=99)))


def test_null_domain_truncated_file_and_integer_tensor_are_named(small_darts, tmp_path):
    """Issue 34 item 8: a truncated darts.safetensors names the file when loading; ``"darts_domain": null``
    and an int32 darts tensor (transformers casts it to float32: 0.3 -> 0) are named with their file by the
    directory check every command runs before loading (from_pretrained cannot tell them from a
    darts_domain=None keyword, what lm-eval makes of darts_domain=none, or see a stored dtype)."""
    from mergekit_darts.errors import FormatError
    from mergekit_darts.output.check import check_output_dir

    null = broken_copy(small_darts, tmp_path / "null", config=lambda c: c.update(darts_domain=None))
    with pytest.raises(FormatError, match=r"null/config\.json: darts_domain is null, not a domain name"):
        check_output_dir(null)
    truncated = Path(broken_copy(small_darts, tmp_path / "truncated"))
    shard = truncated / layout.DARTS_SHARD
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: damaged or truncated safetensors file \(.*\); "
                                         r"copy it again"):
        load_remote(str(truncated))
    with pytest.raises(FormatError, match=rf"{re.escape(str(shard))}: it is truncated"):
        check_output_dir(str(truncated))
    up = load_file(small_darts / layout.DARTS_SHARD)["darts.math.up.weight"]
    integer = broken_copy(small_darts, tmp_path / "int32", tensors={"darts.math.up.weight": up.to(torch.int32)})
    with pytest.raises(FormatError, match=r"darts\.safetensors: darts\.math\.up\.weight is stored as I32, but every "
                                          r"darts tensor is float32 \(F32\)"):
        check_output_dir(integer)
    check_output_dir(str(small_darts))  # the intact directory passes
    # an explicit darts_domain=None (what lm-eval makes of darts_domain=none) stays "none"
    assert load_remote(str(small_darts), darts_domain=None).darts_domain == "none"
