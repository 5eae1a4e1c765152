"""bake and export-peft hold no more than they need: bake folds each block linear (and the head) only as
its bytes are written, so one folded tensor is alive at a time; export-peft reads the merged LM head only
when some domain's fold changes it."""

import shutil
import weakref

import pytest
import torch

from helpers import assert_same_logits, logits_of
from mergekit_darts.errors import FormatError
from mergekit_darts.output import bake as bake_module
from mergekit_darts.output import peft_export
from mergekit_darts.output.bake import bake


def _depth_output(merged_dir, out, head_rank=0, seed=0):
    """``merged_dir`` copied to ``out`` with random linear-content modules that adapt every decoder block
    (no training: what a trained depth output exports)."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.output.layout import read_config
    from mergekit_darts.remote_code.blocks import block_linear_targets
    from mergekit_darts.remote_code.surgery import DomainSurgery

    shutil.copytree(merged_dir, out)
    config = read_config(str(out))
    layers = AutoModelForCausalLM.from_pretrained(str(out)).model.layers
    targets = block_linear_targets(layers, len(layers))
    torch.manual_seed(seed)
    modules = {}
    for name in ("math", "code"):
        module = DomainSurgery(config["hidden_size"], rank=3, max_positions=16, method="standard",
                               head_rank=head_rank, vocab_size=config["vocab_size"], content="linear")
        module.attach_blocks(targets, 2)
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0, 0.2)
        modules[name] = module
    export_surgery(str(out), modules, {name: f"experts/{name}" for name in modules}, "math", loss="kl")
    return str(out)


def _remote(out, domain, final_state=True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain=domain).eval()
    if not final_state:  # linear content, no position table: a zero up-projection is the identity
        with torch.no_grad():
            for surgery in model.darts.values():
                surgery.up.weight.zero_()
    return model


def _ids(vocab):
    return torch.randint(4, vocab, (2, 11), generator=torch.Generator().manual_seed(7))


def test_bake_folds_one_tensor_at_a_time_as_it_is_written(tiny_family, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = _depth_output(tiny_family["merged"], tmp_path / "out")
    fold = bake_module.load_domain_fold(out, "math")
    events, alive, most_alive = [], [], []
    real_tensor, real_head, real_write = bake_module.folded_tensor, bake_module.folded_head, bake_module.write_safetensors

    def track(kind, real):
        def spy(*args):
            most_alive.append(sum(ref() is not None for ref in alive))  # earlier folds still held
            tensor = real(*args)
            alive.append(weakref.ref(tensor))
            events.append(kind)
            return tensor
        return spy

    monkeypatch.setattr(bake_module, "folded_tensor", track("fold", real_tensor))
    monkeypatch.setattr(bake_module, "folded_head", track("head", real_head))
    monkeypatch.setattr(bake_module, "write_safetensors", lambda *a: events.append("write") or real_write(*a))

    replace = bake_module.folded_block_weights(out, fold)
    assert len(replace) == 14 and not events  # checked and described, nothing folded yet
    summary = bake(out, "math", str(tmp_path / "baked"))
    assert summary["block_linears"] == 14
    assert events[0] == "write" and events.count("fold") == 14 and events.count("head") == 1
    assert most_alive and max(most_alive) == 0  # each folded tensor was written and freed before the next

    baked = AutoModelForCausalLM.from_pretrained(str(tmp_path / "baked")).eval()
    ids = _ids(baked.config.vocab_size)
    assert_same_logits(logits_of(baked, ids), logits_of(_remote(out, "math"), ids))


def test_a_tensor_that_cannot_be_baked_is_named(tmp_path):
    key = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(FormatError, match=rf"{key} has dtype I8, not a floating-point type"):
        bake_module.replacement(str(tmp_path), key, {"dtype": "I8", "shape": [4, 4]}, lambda: None)


def test_export_peft_reads_the_head_only_when_a_fold_changes_it(tiny_family, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    requested = []
    real = peft_export.read_merged_tensor
    monkeypatch.setattr(peft_export, "read_merged_tensor", lambda d, name: requested.append(name) or real(d, name))

    out = _depth_output(tiny_family["merged"], tmp_path / "out", head_rank=0)
    summary = peft_export.export_peft(out, str(tmp_path / "adapters"), drop_final_state=True)
    assert requested == []  # head_rank 0 without the final-state correction: lm_head is unchanged
    assert summary["math"]["rank"] == 0 and summary["math"]["block_modules"] == 14
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters" / "base-model")).eval()
    ids = _ids(base.config.vocab_size)
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapters" / "code"))
    assert_same_logits(logits_of(model, ids), logits_of(_remote(out, "code", final_state=False), ids))

    with_head = _depth_output(tiny_family["merged"], tmp_path / "with_head", head_rank=2)
    peft_export.export_peft(with_head, str(tmp_path / "adapters2"), drop_final_state=True)
    assert requested == ["lm_head.weight"]  # H_u·H_d changes it: read once for every domain
