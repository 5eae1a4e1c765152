"""`mergekit-darts export-peft`: one PEFT LoRA adapter on lm_head per domain (issue 17)."""

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from helpers import assert_same_logits, linear_surgery_output, logits_of
from mergekit_darts.cli import main
from mergekit_darts.output.peft_export import LORA_A_KEY, LORA_B_KEY, export_peft


def _ids(vocab, seed=0):
    return torch.randint(4, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def _models(out):
    """(remote-code model, plain merge loaded from the same directory without remote code)."""
    from transformers import AutoModelForCausalLM

    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="none").eval()
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(plain).__name__ == "LlamaForCausalLM"
    return remote, plain


@pytest.mark.parametrize("tied,head_rank", [(False, 2), (False, 0), (True, 2), (True, 0)])
def test_adapters_give_each_domains_logits(tiny_family, tied_merged, tmp_path, tied, head_rank):
    from peft import PeftModel

    merged = tied_merged if tied else tiny_family["merged"]
    out = linear_surgery_output(merged, tmp_path / "out", head_rank=head_rank, rank=3)
    dest = tmp_path / "adapters"
    result = CliRunner().invoke(main, ["export-peft", out, str(dest)])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(dest)) == ["code", "math"]
    config = json.loads((dest / "math" / "adapter_config.json").read_text())
    assert config["r"] == 3 + head_rank and config["lora_alpha"] == config["r"]
    assert config["target_modules"] == ["lm_head"] and config["peft_type"] == "LORA"
    with safe_open(str(dest / "math" / "adapter_model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == {LORA_A_KEY, LORA_B_KEY}  # only the factors, not the whole head

    remote, plain = _models(out)
    ids = _ids(plain.config.vocab_size)
    merged_logits = logits_of(plain, ids)
    model = PeftModel.from_pretrained(plain, str(dest / "math"), adapter_name="math")
    model.load_adapter(str(dest / "code"), adapter_name="code")
    for domain in ("math", "code", "math"):  # switching back and forth, no remote code involved
        model.set_adapter(domain)
        remote.set_darts_domain(domain)
        assert_same_logits(logits_of(model, ids), logits_of(remote, ids))
    with model.disable_adapter():
        assert torch.equal(logits_of(model, ids), merged_logits)
    # a tied head stays tied to the unchanged input embeddings: the adapter only adds to the output
    assert torch.equal(model.base_model.model.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_one_domain_and_position_table(tiny_family, tmp_path):
    from peft import PeftModel

    out = linear_surgery_output(tiny_family["merged"], tmp_path / "out", method="darts")
    result = CliRunner().invoke(main, ["export-peft", out, str(tmp_path / "a")])
    assert result.exit_code == 2 and "method: 'darts'" in result.output and not (tmp_path / "a").exists()

    summaries = export_peft(out, str(tmp_path / "b"), ["code"], drop_position_bias=True)
    assert list(summaries) == ["code"] and sorted(os.listdir(tmp_path / "b")) == ["code"]
    remote, plain = _models(out)
    ids = _ids(plain.config.vocab_size, seed=3)
    # with the table dropped, the adapter is the remote model without its position correction
    for surgery in remote.darts.values():
        with torch.no_grad():
            surgery.position_bias.zero_()
    remote.set_darts_domain("code")
    model = PeftModel.from_pretrained(plain, str(tmp_path / "b" / "code"))
    assert_same_logits(logits_of(model, ids), logits_of(remote, ids))
