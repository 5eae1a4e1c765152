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
    assert sorted(os.listdir(dest)) == ["base-model", "code", "math"]
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
    assert list(summaries) == ["code", "base-model"] and sorted(os.listdir(tmp_path / "b")) == ["base-model", "code"]
    remote, plain = _models(out)
    ids = _ids(plain.config.vocab_size, seed=3)
    # with the table dropped, the adapter is the remote model without its position correction
    for surgery in remote.darts.values():
        with torch.no_grad():
            surgery.position_bias.zero_()
    remote.set_darts_domain("code")
    model = PeftModel.from_pretrained(plain, str(tmp_path / "b" / "code"))
    assert_same_logits(logits_of(model, ids), logits_of(remote, ids))


def _snapshot(directory):
    """Every file of ``directory`` with its bytes: what 'OUT is not modified' is checked against."""
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))
            if (directory / name).is_file()}


def _with_stale_head(tied_merged, path):
    """The tied merge with a different ``lm_head.weight`` in the checkpoint, which transformers 5 then
    loads as the head (it does not tie unequal tensors): the base must keep that head."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tied_merged, path)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("merge", ["untied", "tied", "tied_stale_head"])
def test_plain_base_beside_the_adapters_merges_exactly(tiny_family, tied_merged, tmp_path, merge):
    """DEST/base-model: the plain architecture, weights hard-linked from OUT (OUT unchanged), an untied
    lm_head for a tied merge; AutoPeftModel finds it through base_model_name_or_path, and
    merge_and_unload on it gives every domain's remote-code logits with the embeddings untouched."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    merged = {"untied": tiny_family["merged"], "tied": tied_merged,
              "tied_stale_head": _with_stale_head(tied_merged, tmp_path / "stale") if merge != "untied" else None}[merge]
    out = linear_surgery_output(merged, tmp_path / "out", head_rank=2, rank=3)
    before = _snapshot(tmp_path / "out")
    dest = tmp_path / "adapters"
    result = CliRunner().invoke(main, ["export-peft", out, str(dest)])
    assert result.exit_code == 0, result.output
    assert _snapshot(tmp_path / "out") == before  # OUT: not a byte changed, nothing added or removed

    base = dest / "base-model"
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert not {"auto_map", "darts", "darts_domain"} & set(config)
    assert not [name for name in os.listdir(base) if name.endswith(".py") or name.startswith("darts")]
    source_shard = os.stat(os.path.join(out, "model-00001-of-00001.safetensors"))
    embed = load_tensor(os.path.join(out, "model-00001-of-00001.safetensors"), "model.embed_tokens.weight")
    if merge != "tied":  # the checkpoint has its head: every file is a hard link, not a copy
        assert sorted(n for n in os.listdir(base) if "safetensors" in n) == ["model.safetensors"]
        assert os.stat(base / "model.safetensors").st_ino == source_shard.st_ino
    else:
        index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
        head_file = index.pop("lm_head.weight")
        assert set(index.values()) == {"model-00001-of-00002.safetensors"} and head_file == "model-00002-of-00002.safetensors"
        assert os.stat(base / "model-00001-of-00002.safetensors").st_ino == source_shard.st_ino
        assert load_keys(str(base / head_file)) == {"lm_head.weight"}
        assert torch.equal(load_tensor(str(base / head_file), "lm_head.weight"), embed)  # the tied head, now its own
    for domain in ("math", "code"):
        adapter = json.loads((dest / domain / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(base)

    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="none").eval()
    ids = _ids(config["vocab_size"], seed=4)
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert plain.lm_head.weight.data_ptr() != plain.model.embed_tokens.weight.data_ptr()
    assert_same_logits(logits_of(plain, ids), logits_of(remote, ids))
    for domain in ("math", "code"):
        remote.set_darts_domain(domain)
        expected = logits_of(remote, ids)
        auto = AutoPeftModelForCausalLM.from_pretrained(str(dest / domain)).eval()  # base found by its config
        assert_same_logits(logits_of(auto, ids), expected)
        fresh = AutoModelForCausalLM.from_pretrained(str(base)).eval()
        unloaded = PeftModel.from_pretrained(fresh, str(dest / domain)).merge_and_unload()
        assert type(unloaded).__name__ == "LlamaForCausalLM"
        assert_same_logits(logits_of(unloaded, ids), expected)
        assert torch.equal(unloaded.model.embed_tokens.weight.detach(), embed)  # only the output matrix moved


def test_copy_base_copies_instead_of_linking(tiny_family, tmp_path):
    out = linear_surgery_output(tiny_family["merged"], tmp_path / "out")
    summaries = export_peft(out, str(tmp_path / "adapters"), ["math"], copy_base=True)
    assert summaries["base-model"]["copied"] == ["model.safetensors"] and not summaries["base-model"]["linked"]
    copied = tmp_path / "adapters" / "base-model" / "model.safetensors"
    source = os.path.join(out, "model-00001-of-00001.safetensors")
    assert os.stat(copied).st_ino != os.stat(source).st_ino
    assert copied.read_bytes() == open(source, "rb").read()


def load_tensor(path, name):
    with safe_open(path, "pt") as handle:
        return handle.get_tensor(name)


def load_keys(path):
    with safe_open(path, "pt") as handle:
        return set(handle.keys())


def test_lm_eval_hf_with_peft_on_the_plain_base(tiny_family, tmp_path):
    """lm-eval's hf model: pretrained=DEST/base-model, peft=DEST/<domain> gives the domain's loglikelihood."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    out = linear_surgery_output(tiny_family["merged"], tmp_path / "out")
    dest = tmp_path / "adapters"
    export_peft(out, str(dest))
    request = Instance("loglikelihood", {}, ("how many apples are", " left"), 0)
    with_adapter = HFLM(pretrained=str(dest / "base-model"), peft=str(dest / "math"), device="cpu")
    remote = HFLM(pretrained=out, trust_remote_code=True, darts_domain="math", device="cpu")
    plain = HFLM(pretrained=str(dest / "base-model"), device="cpu")
    [(expected, _)] = remote.loglikelihood([request])
    [(score, _)] = with_adapter.loglikelihood([request])
    [(unadapted, _)] = plain.loglikelihood([request])
    assert score == pytest.approx(expected, abs=1e-4) and abs(unadapted - expected) > 1e-2


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_merge_gets_a_linked_sharded_base(tmp_path, tied):
    """A merge in several shards: every shard hard-linked into the base under an index of its own."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.tiny import make_random_model

    merged = tmp_path / "merged"
    model = make_random_model(str(tmp_path / "single"), seed=2, tie_word_embeddings=tied)
    model.save_pretrained(merged, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (merged / name).write_bytes((tmp_path / "single" / name).read_bytes())
    shards = sorted(n for n in os.listdir(merged) if n.endswith(".safetensors"))
    assert len(shards) > 1
    out = linear_surgery_output(str(merged), tmp_path / "out")
    summary = export_peft(out, str(tmp_path / "adapters"))["base-model"]
    base = tmp_path / "adapters" / "base-model"
    assert len(summary["linked"]) == len(shards)
    assert len(summary["written"]) == (1 if tied else 0)
    inodes = {os.stat(os.path.join(out, n)).st_ino for n in shards}
    assert {os.stat(base / n).st_ino for n in summary["linked"]} == inodes
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {*summary["linked"], *summary["written"]}
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="none").eval()
    ids = _ids(remote.config.vocab_size, seed=6)
    assert_same_logits(logits_of(AutoModelForCausalLM.from_pretrained(str(base)).eval(), ids), logits_of(remote, ids))


def _peft_warnings(base, adapters):
    """(category, message) of every Python warning PEFT raises while putting ``adapters`` on ``base``."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapters / "math"), adapter_name="math")
        model.load_adapter(str(adapters / "code"), adapter_name="code")
    return {(w.category.__name__, str(w.message)) for w in caught}


def test_peft_warns_about_our_adapters_no_more_than_about_any_model(tied_merged, tmp_path):
    """Loading the exported adapters on ``adapters/base-model`` raises exactly the warnings PEFT raises for
    a LlamaForCausalLM built in memory from transformers' own config (none of our files involved): PEFT
    0.21's ``is_gradient_checkpointing`` FutureWarning is upstream noise (docs/serving.md), not ours."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    out = linear_surgery_output(tied_merged, tmp_path / "out")
    export_peft(out, str(tmp_path / "adapters"))
    exported = json.loads((tmp_path / "adapters" / "base-model" / "config.json").read_text())
    ours = _peft_warnings(AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters" / "base-model")),
                          tmp_path / "adapters")
    stranger = LlamaForCausalLM(LlamaConfig(vocab_size=exported["vocab_size"], hidden_size=exported["hidden_size"],
                                            intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=2))
    assert ours == _peft_warnings(stranger, tmp_path / "adapters")
    assert not [message for _, message in ours if "darts" in message.lower() or str(tmp_path) in message]
