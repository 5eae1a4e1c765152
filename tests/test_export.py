"""export_surgery on mergekit output directories: layout, atomicity, reruns, sharded input (docs/design.md §5)."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from mergekit_darts.output import export as export_module
from mergekit_darts.output.export import export_surgery, read_darts_info
from mergekit_darts.remote_code.surgery import DomainSurgery

HIDDEN = 32


def modules_for(domains, rank=4, max_positions=6, seed=0, **kwargs):
    torch.manual_seed(seed)
    modules = {}
    for name in domains:
        module = DomainSurgery(HIDDEN, rank=rank, max_positions=max_positions, **kwargs)
        with torch.no_grad():
            module.up.weight.normal_(0, 0.3)
            if module.position_bias is not None:
                module.position_bias.normal_(0, 0.3)
        modules[name] = module
    return modules


def experts_for(modules):
    return {name: f"experts/{name}" for name in modules}


REPORT = {
    "domains": {
        "math": {"expert": "experts/math", "calibration": {"train": 40, "held_out": 10, "truncated": 1, "skipped": 0},
                 "final_loss": 0.125, "bias": {"mean_before": 0.9, "mean_after": 0.3}},
        "code": {"expert": "experts/code", "final_loss": 0.5},
    }
}


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def read_json(path):
    with open(path) as handle:
        return json.load(handle)


def weight_hashes(path):
    """File hash of every merged weight file, keyed by the tensors it holds (names move, bytes must not)."""
    hashes = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors") and name != "darts.safetensors":
            with safe_open(os.path.join(path, name), "pt") as handle:
                hashes[tuple(sorted(handle.keys()))] = sha256(os.path.join(path, name))
    return hashes


@torch.no_grad()
def plain_logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return type(model).__name__, model(torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])).logits


def test_export_layout(merged_copy, tmp_path):
    before = weight_hashes(merged_copy)
    assert os.path.exists(os.path.join(merged_copy, "model.safetensors"))
    card_before = open(os.path.join(merged_copy, "README.md")).read()
    plot = tmp_path / "darts_bias.png"
    plot.write_bytes(b"\x89PNG fake")
    modules = modules_for(["math", "code"])
    export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1", report=REPORT,
                   extra_files={"darts_bias.png": str(plot)})

    files = set(os.listdir(merged_copy))
    assert "model.safetensors" not in files and not any(f.startswith(".darts-staging") for f in files)
    assert {"darts.safetensors", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
            "modeling_darts.py", "surgery.py", "darts_report.json", "darts_bias.png"} <= files
    assert weight_hashes(merged_copy) == before  # renamed, not rewritten

    with safe_open(os.path.join(merged_copy, "darts.safetensors"), "pt") as handle:
        darts = {key: handle.get_tensor(key) for key in handle.keys()}
    assert set(darts) == {f"darts.{d}.{p}" for d in ("math", "code") for p in ("down.weight", "up.weight", "position_bias")}
    assert all(t.dtype == torch.float32 for t in darts.values())
    assert torch.equal(darts["darts.math.up.weight"], modules["math"].up.weight)

    index = read_json(os.path.join(merged_copy, "model.safetensors.index.json"))
    with safe_open(os.path.join(merged_copy, "model-00001-of-00001.safetensors"), "pt") as handle:
        merged_keys = set(handle.keys())
    assert index["weight_map"] == {**{k: "model-00001-of-00001.safetensors" for k in merged_keys},
                                   **{k: "darts.safetensors" for k in darts}}
    assert index["metadata"]["total_size"] > 0

    config = read_json(os.path.join(merged_copy, "config.json"))
    assert config["architectures"] == ["DartsLlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_darts.DartsLlamaForCausalLM"}
    assert config["darts_domain"] == "math" and config["darts"]["domains"] == {"math": "experts/math", "code": "experts/code"}
    assert config["darts"]["version"]
    for name in ("modeling_darts.py", "surgery.py"):
        assert sha256(os.path.join(merged_copy, name)) == sha256(os.path.join(export_module.PACKAGE_DIR, name))
    assert read_json(os.path.join(merged_copy, "darts_report.json")) == REPORT

    card = open(os.path.join(merged_copy, "README.md")).read()
    assert card.startswith(card_before.rstrip("\n")) and card.count("## Representation surgery") == 1
    for text in ("ewl1", "experts/math", "40 / 10", "0.9 → 0.3", "trust_remote_code=True", 'darts_domain="math"',
                 "darts_domain=math`",
                 "Added parameters: 896"):
        assert text in card, text


def test_rerun_replaces_darts_parts(merged_copy):
    before = weight_hashes(merged_copy)
    modules = modules_for(["math", "code"])
    export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1", report=REPORT)
    modules = modules_for(["physics"], method="standard", seed=1)
    export_surgery(merged_copy, modules, experts_for(modules), "physics", loss="l1")

    assert weight_hashes(merged_copy) == before
    with safe_open(os.path.join(merged_copy, "darts.safetensors"), "pt") as handle:
        assert set(handle.keys()) == {"darts.physics.down.weight", "darts.physics.up.weight"}
    index = read_json(os.path.join(merged_copy, "model.safetensors.index.json"))
    assert not any(k.startswith(("darts.math", "darts.code")) for k in index["weight_map"])
    assert not os.path.exists(os.path.join(merged_copy, "darts_report.json"))  # stale report removed
    config = read_json(os.path.join(merged_copy, "config.json"))
    assert config["darts"]["domains"] == {"physics": "experts/physics"} and config["darts_domain"] == "physics"
    card = open(os.path.join(merged_copy, "README.md")).read()
    assert card.count("## Representation surgery") == 1 and "experts/math" not in card and "`l1`" in card

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged_copy, trust_remote_code=True)
    assert list(model.darts) == ["physics"] and model.darts_domain == "physics"
    assert torch.equal(model.darts["physics"].up.weight, modules["physics"].up.weight)


def test_sharded_input(merged_copy, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(merged_copy).save_pretrained(sharded, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md"):
        if os.path.exists(os.path.join(merged_copy, name)):
            os.link(os.path.join(merged_copy, name), os.path.join(sharded, name))
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    before = weight_hashes(sharded)
    assert len(before) > 1
    old_index = read_json(os.path.join(sharded, "model.safetensors.index.json"))

    modules = modules_for(["math"])
    export_surgery(sharded, modules, experts_for(modules), "math", loss="ewl1")
    assert weight_hashes(sharded) == before
    index = read_json(os.path.join(sharded, "model.safetensors.index.json"))
    assert index["weight_map"] == {**old_index["weight_map"], **{f"darts.math.{p}": "darts.safetensors"
                                                                 for p in ("down.weight", "up.weight", "position_bias")}}

    export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(sharded, trust_remote_code=True)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(merged_copy, trust_remote_code=True)(ids).logits
    torch.testing.assert_close(got, want)


def failing_after(count):
    """os.replace that performs ``count`` renames and then fails, like an interruption."""
    real = os.replace
    calls = []

    def replace(src, dst):
        if len(calls) >= count:
            raise OSError("simulated interruption")
        calls.append(dst)
        real(src, dst)

    return replace, calls


def test_interrupted_export_leaves_a_plain_model(tiny_family, tmp_path, monkeypatch):
    plain_name, expected = plain_logits(tiny_family["merged"])
    modules = modules_for(["math", "code"])
    step = 0
    while True:
        path = str(tmp_path / f"step{step}")
        shutil.copytree(tiny_family["merged"], path)
        replace, calls = failing_after(step)
        monkeypatch.setattr(export_module.os, "replace", replace)
        try:
            export_surgery(path, modules, experts_for(modules), "math", loss="ewl1", report=REPORT)
            finished = True
        except OSError:
            finished = False
        finally:
            monkeypatch.undo()
        if finished:
            break
        config = read_json(os.path.join(path, "config.json"))
        assert "darts" not in config and config["architectures"] == ["LlamaForCausalLM"], calls
        name, logits = plain_logits(path)
        assert name == plain_name and torch.equal(logits, expected), calls
        assert not any(f.startswith(".darts-staging") for f in os.listdir(path))
        step += 1
    assert step >= 5 and calls[-1].endswith("config.json")  # config.json is the last switch


def test_interrupted_rerun_is_old_darts_or_plain(merged_copy, monkeypatch):
    from transformers import AutoModelForCausalLM

    modules = modules_for(["math", "code"])
    export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1")
    _, expected = plain_logits(merged_copy)
    new = modules_for(["physics"], seed=2)
    for step in range(3):  # the first switches of a rerun: config back to plain, plain index, shard
        replace, _ = failing_after(step)
        monkeypatch.setattr(export_module.os, "replace", replace)
        with pytest.raises(OSError):
            export_surgery(merged_copy, new, experts_for(new), "physics", loss="ewl1")
        monkeypatch.undo()
        config = read_json(os.path.join(merged_copy, "config.json"))
        if "darts" in config:  # untouched old export: loads with its own domains
            model = AutoModelForCausalLM.from_pretrained(merged_copy, trust_remote_code=True)
            assert sorted(model.darts) == ["code", "math"]
        _, logits = plain_logits(merged_copy)
        assert torch.equal(logits, expected)


def test_failure_while_staging_changes_nothing(merged_copy, monkeypatch):
    listing = sorted(os.listdir(merged_copy))
    hashes = {name: sha256(os.path.join(merged_copy, name)) for name in listing}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_module.shutil, "copyfile", broken)
    modules = modules_for(["math"])
    with pytest.raises(OSError, match="disk full"):
        export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1")
    assert sorted(os.listdir(merged_copy)) == listing
    assert {name: sha256(os.path.join(merged_copy, name)) for name in listing} == hashes


def test_unsupported_architecture(merged_copy):
    path = os.path.join(merged_copy, "config.json")
    config = read_json(path)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(path, "w") as handle:
        json.dump(config, handle)
    modules = modules_for(["math"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        export_surgery(merged_copy, modules, experts_for(modules), "math", loss="ewl1")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m, experts: experts.pop("code"), "does not match"),
        (lambda m, experts: m.update(code=DomainSurgery(HIDDEN, rank=8, max_positions=6)), "rank=8"),
        (lambda m, experts: m.update(code=DomainSurgery(HIDDEN, rank=4, max_positions=6, content="linear")),
         "content='linear'"),
        (lambda m, experts: m.update(code=DomainSurgery(16, rank=4, max_positions=6)), "hidden_size"),
    ],
)
def test_inconsistent_modules_are_rejected(merged_copy, change, message):
    modules = modules_for(["math", "code"])
    experts = experts_for(modules)
    change(modules, experts)
    with pytest.raises(ValueError, match=message):
        export_surgery(merged_copy, modules, experts, "math", loss="ewl1")
    with pytest.raises(ValueError, match="unknown domain 'physics'"):
        export_surgery(merged_copy, modules_for(["math"]), experts_for(modules_for(["math"])), "physics", loss="ewl1")


def test_read_darts_info(merged_copy):
    modules = modules_for(["math", "code"])
    export_surgery(merged_copy, modules, experts_for(modules), "code", loss="ewl1", report=REPORT)
    info = read_darts_info(merged_copy)
    assert info["architecture"] == "DartsLlamaForCausalLM" and info["default_domain"] == "code"
    assert set(info["domains"]) == {"math", "code"}
    assert info["domains"]["math"]["expert"] == "experts/math"
    assert info["domains"]["math"]["parameters"] == 2 * 4 * HIDDEN + 6 * HIDDEN
    assert info["domains"]["math"]["final_loss"] == 0.125 and info["domains"]["math"]["bias"]["mean_after"] == 0.3
    assert info["parameters"] == 2 * info["domains"]["math"]["parameters"]
    assert info["merged_parameters"] > info["parameters"] and 0 < info["share"] < 1
    with pytest.raises(ValueError, match="not a mergekit-darts"):
        with open(os.path.join(merged_copy, "config.json"), "w") as handle:
            json.dump({"architectures": ["LlamaForCausalLM"]}, handle)
        read_darts_info(merged_copy)
