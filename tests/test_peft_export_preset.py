"""`preset: best` leaves transformers whole (issue 52): its linear final-state correction folds into lm_head, its
block adapters into their linears, no flag. The ReLU recipe it had before (`content: relu`, `method: darts`,
still a setting) leaves transformers as in issue 46 item 4: its block adapters (and head correction) export
as a standard PEFT LoRA and bake into the linears, exactly; the final-state correction (ReLU content,
position table), which has no weight form, is dropped only with `--drop-final-state-correction`, and the
command, the adapter's README and the baked card say so."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import QUICK_TEXTS, assert_same_logits, linear_surgery_output, logits_of, merge_yaml
from mergekit_darts.cli import main

FLAG = "--drop-final-state-correction"
# the preset's rank 64 does not fit the tiny model's hidden size 32: ranks written explicitly
RELU = "  content: relu\n  method: darts\n"  # the final-state correction preset: best had before 2026-12-06
PRESET = ("surgery:\n  preset: best\n  rank: 2\n  depth_rank: 2\n  max_positions: 16\n  steps: {steps}\n"
          "  lr: 0.01\n  device: cpu\n  held_out: 0.34\n  cache_dir: {cache}\n{extra}  domains:\n")


def _config(family, cache, steps, extra=""):
    domains = "".join(f"    {name}:\n      model: {family[name]}\n"
                      f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code"))
    return merge_yaml(family) + PRESET.format(steps=steps, cache=cache, extra=extra) + domains


def _mergekit_yaml(family, root, extra):
    config = root / "cfg.yml"
    config.write_text(_config(family, root / "cache", steps=5, extra=extra))
    result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), str(root / "out")],
                            cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "out"


@pytest.fixture(scope="module")
def preset_output(tiny_family, tmp_path_factory):
    """The unchanged ``mergekit-yaml`` with ``preset: best`` and the ReLU final-state correction (ReLU content,
    position table; every block, adapters from the weight deltas), trained a few steps: the output directory."""
    return _mergekit_yaml(tiny_family, tmp_path_factory.mktemp("preset_relu"), RELU)


def test_preset_best_folds_whole_without_a_flag(tiny_family, tmp_path):
    """``preset: best`` as shipped: ``export-peft`` and ``bake`` need no flag, drop nothing, and PEFT on the
    plain base and the baked model give the remote-code model's logits (the final-state correction included)."""
    from peft import PeftModel

    out = _mergekit_yaml(tiny_family, tmp_path, "")
    surgery = json.loads((out / "darts_report.json").read_text())["surgery"]
    assert (surgery["content"], surgery["method"], surgery["preset"]) == ("linear", "standard", "best")
    exported = CliRunner().invoke(main, ["export-peft", str(out), str(tmp_path / "adapters")])
    baked = CliRunner().invoke(main, ["bake", str(out), str(tmp_path / "baked"), "--domain", "math"])
    for result in (exported, baked):
        assert result.exit_code == 0, result.output
        assert "DROPPED" not in result.output
    base = _plain(tmp_path / "adapters" / "base-model")
    ids = _ids(base.config.vocab_size)
    plain_logits = logits_of(base, ids)
    for domain in ("math", "code"):
        expected = logits_of(_remote(out, domain), ids)
        # the final-state correction was trained and is part of what folds: switching it off changes the logits
        assert not torch.allclose(expected, logits_of(_remote(out, domain, final_state=False), ids), atol=1e-4)
        adapter = PeftModel.from_pretrained(_plain(tmp_path / "adapters" / "base-model"), str(tmp_path / "adapters" / domain))
        assert_same_logits(logits_of(adapter, ids), expected)
    assert_same_logits(logits_of(_plain(tmp_path / "baked"), ids), logits_of(_remote(out, "math"), ids))
    assert not torch.allclose(plain_logits, logits_of(_remote(out, "math"), ids), atol=1e-3)


def _remote(out, domain, final_state=True):
    """The emitted model for ``domain``; ``final_state=False``: its final-state correction switched off
    (content up-projection and position table zeroed), the block adapters and head correction left on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, darts_domain=domain).eval()
    if not final_state:
        with torch.no_grad():
            for surgery in model.darts.values():
                surgery.up.weight.zero_()
                if surgery.position_bias is not None:
                    surgery.position_bias.zero_()
    return model


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _ids(vocab):
    return torch.randint(4, vocab, (2, 13), generator=torch.Generator().manual_seed(3))


def test_preset_output_is_refused_without_the_flag(preset_output, tmp_path):
    for command in (["export-peft", preset_output, tmp_path / "adapters"],
                    ["bake", preset_output, tmp_path / "baked", "--domain", "math"]):
        result = CliRunner().invoke(main, [*map(str, command)])
        assert result.exit_code == 2, result.output
        assert "content: 'relu'" in result.output and "method: 'darts'" in result.output
        assert FLAG in result.output and "the block adapters (depth: 2)" in result.output
        assert not (tmp_path / "adapters").exists() and not (tmp_path / "baked").exists()


def test_preset_exports_as_a_peft_lora_without_its_final_state_correction(preset_output, tmp_path):
    from peft import PeftModel

    dest = tmp_path / "adapters"
    result = CliRunner().invoke(main, ["export-peft", str(preset_output), str(dest), FLAG])
    assert result.exit_code == 0, result.output
    report = json.loads((preset_output / "darts_report.json").read_text())
    for domain in ("math", "code"):
        kl = report["domains"][domain]["held_out_kl"]
        # the command states what was dropped, exactly, and what it cost on the held-out records
        assert (f"{domain}: DROPPED the final-state correction `ĥ = h − U·relu(D·h) − b[position]`: content `relu` "
                f"of rank 2 (128 parameters) and position table 16 × 32 (512 parameters)") in result.output
        assert f"without the final-state correction (what was exported) {kl['after_without_final_state']:.4g}" in result.output
        assert f"{domain}: LoRA rank 2 on 14 block linears" in result.output
        readme = (dest / domain / "README.md").read_text()
        assert "**Dropped** (`--drop-final-state-correction`)" in readme and "U·relu(D·h)" in readme
        config = json.loads((dest / domain / "adapter_config.json").read_text())
        assert "lm_head" not in config["target_modules"] and len(config["target_modules"]) == 14  # head_rank 0
        assert config["r"] == config["lora_alpha"] == 2
    assert json.loads((preset_output / "config.json").read_text())["darts"]["depth"] == 2  # every block

    base = _plain(dest / "base-model")
    ids = _ids(base.config.vocab_size)
    plain_logits = logits_of(base, ids)
    model = PeftModel.from_pretrained(base, str(dest / "math"), adapter_name="math")
    model.load_adapter(str(dest / "code"), adapter_name="code")
    for domain in ("math", "code"):
        model.set_adapter(domain)
        switched_off = logits_of(_remote(preset_output, domain, final_state=False), ids)
        assert_same_logits(logits_of(model, ids), switched_off)
        # something real was dropped, and the adapter is not the plain merge either
        assert not torch.allclose(switched_off, logits_of(_remote(preset_output, domain), ids), atol=1e-3)
        assert not torch.allclose(switched_off, plain_logits, atol=1e-3)
    merged = PeftModel.from_pretrained(_plain(dest / "base-model"), str(dest / "code")).merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert_same_logits(logits_of(merged, ids), logits_of(_remote(preset_output, "code", final_state=False), ids))


def test_preset_bakes_its_block_adapters_into_the_linears(preset_output, tmp_path):
    dest = tmp_path / "baked"
    result = CliRunner().invoke(main, ["bake", str(preset_output), str(dest), "--domain", "math", FLAG])
    assert result.exit_code == 0, result.output
    assert "math: DROPPED the final-state correction" in result.output
    assert "(lm_head unchanged, 14 block linears)" in result.output
    card = (dest / "README.md").read_text()
    assert "**Dropped** (`--drop-final-state-correction`)" in card and "14 linears" in card
    config = json.loads((dest / "config.json").read_text())
    assert "darts" not in config and "auto_map" not in config
    baked = _plain(dest)
    ids = _ids(baked.config.vocab_size)
    assert_same_logits(logits_of(baked, ids), logits_of(_remote(preset_output, "math", final_state=False), ids))
    plain = _plain(preset_output)  # lm_head and the embeddings stay the merge's
    assert torch.equal(baked.lm_head.weight, plain.lm_head.weight)
    assert not torch.equal(baked.model.layers[0].mlp.down_proj.weight, plain.model.layers[0].mlp.down_proj.weight)


def test_untrained_preset_with_a_head_correction_exports_exactly(tiny_family, tmp_path):
    """At ``steps: 0`` the final-state correction is still the identity: dropping it loses nothing, and the
    adapter (block linears + ``H_u·H_d`` on lm_head) and the baked model give the emitted model's logits."""
    from peft import PeftModel

    from mergekit_darts.output.bake import bake
    from mergekit_darts.output.peft_export import export_peft
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    report = run_surgery(_config(tiny_family, tmp_path / "cache", steps=0, extra=RELU + "  head_rank: 2\n"), str(out))
    kl = report["domains"]["math"]["held_out_kl"]
    assert kl["after_without_final_state"] == pytest.approx(kl["after"], rel=1e-5)
    summary = export_peft(str(out), str(tmp_path / "adapters"), drop_final_state=True)
    assert summary["math"]["rank"] == 2 and summary["math"]["block_modules"] == 14
    config = json.loads((tmp_path / "adapters" / "math" / "adapter_config.json").read_text())
    assert config["target_modules"][0] == "lm_head" and config["rank_pattern"] == {"lm_head": 2}
    remote = _remote(out, "math")
    base = _plain(tmp_path / "adapters" / "base-model")
    ids = _ids(base.config.vocab_size)
    expected = logits_of(remote, ids)
    assert not torch.allclose(expected, logits_of(base, ids), atol=1e-3)
    assert_same_logits(logits_of(PeftModel.from_pretrained(base, str(tmp_path / "adapters" / "math")), ids), expected)
    baked = bake(str(out), "math", str(tmp_path / "baked"), drop_final_state=True)
    assert baked["head_source"] == "lm_head.weight" and baked["block_linears"] == 14
    assert_same_logits(logits_of(_plain(tmp_path / "baked"), ids), expected)


def test_nothing_left_to_export_is_an_error(tiny_family, tmp_path):
    out = linear_surgery_output(tiny_family["merged"], tmp_path / "out", head_rank=0)
    result = CliRunner().invoke(main, ["export-peft", out, str(tmp_path / "adapters"), FLAG])
    assert result.exit_code == 2 and f"{FLAG}: this output has no block adapters" in result.output
    assert not (tmp_path / "adapters").exists()
