"""`mergekit-darts bake`: a domain's linear correction folded into a plain model's LM head (issue 17)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from helpers import assert_same_logits, linear_surgery_output, logits_of, merge_yaml
from mergekit_darts.cli import main
from mergekit_darts.errors import FoldError
from mergekit_darts.output.bake import bake

BIN = Path(sys.executable).parent


def _ids(vocab, length=12, seed=0):
    return torch.randint(4, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _remote(path, domain):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, darts_domain=domain).eval()


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("tied,head_rank", [(False, 2), (False, 0), (True, 2), (True, 0)])
def test_baked_logits_equal_remote_code(tiny_family, tied_merged, tmp_path, tied, head_rank):
    merged = tied_merged if tied else tiny_family["merged"]
    out = linear_surgery_output(merged, tmp_path / "out", head_rank=head_rank)
    dest = tmp_path / "baked"
    summary = bake(out, "code", str(dest))
    assert summary["head_source"] == ("model.embed_tokens.weight" if tied else "lm_head.weight")

    config = json.loads((dest / "config.json").read_text())
    assert "auto_map" not in config and "darts" not in config and "darts_domain" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert not any((dest / name).exists() for name in ("modeling_darts.py", "surgery.py", "darts.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dest / name).is_file(), name
    card = (dest / "README.md").read_text()
    assert "folded into its LM head" in card and "`code`" in card
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".darts-staging-")]

    ids = _ids(config["vocab_size"])
    remote, baked = _remote(out, "code"), _plain(dest)
    assert type(baked).__name__ == "LlamaForCausalLM"
    assert_same_logits(logits_of(baked, ids), logits_of(remote, ids))
    # a different domain's logits are not what was baked: the fold is domain-specific
    remote.set_darts_domain("math")
    assert not torch.allclose(logits_of(baked, ids), logits_of(remote, ids), atol=1e-3)
    # input embeddings untouched, and no longer the same tensor as the head
    with safe_open(os.path.join(merged, "model.safetensors"), "pt") as handle:
        embed = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(baked.model.embed_tokens.weight.detach(), embed)
    assert baked.lm_head.weight.data_ptr() != baked.model.embed_tokens.weight.data_ptr()


def test_baked_directory_round_trips_and_loads_in_lm_eval(tiny_family, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    out = linear_surgery_output(tiny_family["merged"], tmp_path / "out")
    dest = tmp_path / "baked"
    bake(out, "math", str(dest))
    baked = _plain(dest)
    again = tmp_path / "saved"
    baked.save_pretrained(again)
    ids = _ids(baked.config.vocab_size, seed=1)
    assert_same_logits(logits_of(_plain(again), ids), logits_of(_remote(out, "math"), ids))

    lm = HFLM(pretrained=str(dest), device="cpu", batch_size=1)
    context, continuation = "how many apples are", " left"
    request = Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)
    [(loglikelihood, _)] = lm.loglikelihood([request])
    tokenizer = AutoTokenizer.from_pretrained(dest)
    ctx = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    remote_logits = logits_of(_remote(out, "math"), torch.tensor([whole]))
    logprobs = torch.log_softmax(remote_logits[0], dim=-1)
    expected = sum(logprobs[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
    assert loglikelihood == pytest.approx(expected, abs=1e-4)


def _invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def test_refusals_name_the_setting(tiny_family, tmp_path):
    darts_out = linear_surgery_output(tiny_family["merged"], tmp_path / "darts", method="darts")
    result = _invoke("bake", darts_out, tmp_path / "a", "--domain", "math")
    assert result.exit_code == 2 and "method: 'darts'" in result.output and "--drop-position-bias" in result.output
    assert not (tmp_path / "a").exists()

    result = _invoke("bake", darts_out, tmp_path / "a", "--domain", "physics")
    assert result.exit_code == 2 and "--domain: unknown domain 'physics'" in result.output

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    result = _invoke("bake", darts_out, tmp_path / "taken", "--domain", "math", "--drop-position-bias")
    assert result.exit_code == 2 and "DEST:" in result.output and "already exists" in result.output
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"

    # no darts_report.json here: the CLI says the effect of dropping the table was not measured
    result = _invoke("bake", darts_out, tmp_path / "b", "--domain", "math", "--drop-position-bias")
    assert result.exit_code == 0, result.output
    assert "not measured" in result.output and (tmp_path / "b" / "config.json").is_file()


def test_relu_content_is_refused(tiny_family, tmp_path):
    import shutil

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.surgery import DomainSurgery

    out = tmp_path / "relu"
    shutil.copytree(tiny_family["merged"], out)
    export_surgery(str(out), {"math": DomainSurgery(32, rank=2, method="standard")}, {"math": "m"}, "math", loss="l1")
    with pytest.raises(FoldError, match="content: 'relu'"):
        bake(str(out), "math", str(tmp_path / "dest"))
    result = _invoke("export-peft", out, tmp_path / "adapters")
    assert result.exit_code == 2 and "content: 'relu'" in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "dest").exists() and not (tmp_path / "adapters").exists()


def test_every_reason_is_named_at_once(tiny_family, tmp_path):
    """A ReLU DARTS output fails for two reasons; both are in the one message (issue 26 item 5)."""
    import shutil

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.surgery import DomainSurgery

    out = tmp_path / "relu_darts"
    shutil.copytree(tiny_family["merged"], out)
    export_surgery(str(out), {"math": DomainSurgery(32, rank=2, method="darts", max_positions=8)}, {"math": "m"},
                   "math", loss="l1")
    result = _invoke("bake", out, tmp_path / "dest", "--domain", "math")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "2 reasons" in result.output and "content: 'relu'" in result.output and "method: 'darts'" in result.output
    assert not (tmp_path / "dest").exists()


def _surgery_block(paths, tmp_path):
    lines = ["surgery:", "  method: darts", "  content: linear", "  loss: kl", "  head_rank: 2", "  rank: 4",
             "  max_positions: 32", "  steps: 30", "  lr: 0.01", "  held_out: 0.25", "  default_domain: math",
             f"  cache_dir: {tmp_path / 'cache'}", "  domains:", "    math:", f"      model: {paths['math']}",
             "      calibration:",
             "        texts: ['how many apples are left if we have 7 and give 2 ?', 'what is 3 plus 4 ?',",
             "                'how many pears are left if we have 9 and give 4 ?', 'what is 8 minus 5 ?',",
             "                'total of 2 and 6 is ?', 'each has 3 apples how many in total ?',",
             "                'take 5 from 12 then add 1', 'give 2 pears and take 3 apples']"]
    return "\n".join(lines) + "\n"


def test_mergekit_yaml_linear_run_then_bake(tiny_family, tmp_path):
    """The user story: `mergekit-yaml` with `content: linear` -> remote-code logits are the surgery's math;
    `bake --drop-position-bias` -> the same math without the table, through save_pretrained."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape

    cfg = tmp_path / "cfg.yml"
    cfg.write_text(merge_yaml(tiny_family) + _surgery_block(tiny_family, tmp_path))
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MERGEKIT_DARTS_DISABLE", None)
    result = subprocess.run([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["darts"]["content"] == "linear"
    kl = json.loads((out / "darts_report.json").read_text())["domains"]["math"]["held_out_kl"]
    assert {"before", "after", "after_without_position_bias"} <= set(kl)
    assert "content: linear" in _invoke("info", out).output
    assert "content=linear" in _invoke("report", out).output

    # remote-code logits == DomainSurgery math on the plain merge's final hidden states
    shape = SurgeryShape.from_meta(config["darts"])
    surgery = DomainSurgery.from_shape(shape, config["hidden_size"], config["vocab_size"])
    with safe_open(str(out / "darts.safetensors"), "pt") as handle:
        surgery.load_state_dict({k[len("darts.math."):]: handle.get_tensor(k) for k in handle.keys()
                                 if k.startswith("darts.math.")})
    ids = _ids(config["vocab_size"], length=10, seed=2)
    positions = torch.arange(10).expand(2, 10)
    remote = _remote(out, "math")
    with torch.no_grad():
        hidden = remote.model(input_ids=ids).last_hidden_state  # the model body: no correction
        d, u, b = surgery.down.weight, surgery.up.weight, surgery.position_bias
        corrected = hidden - hidden @ d.T @ u.T - b[positions]
        head = remote.lm_head.weight
        expected = corrected @ head.T + corrected @ surgery.head_down.weight.T @ surgery.head_up.weight.T
        unbiased = hidden - hidden @ d.T @ u.T
        expected_baked = unbiased @ head.T + unbiased @ surgery.head_down.weight.T @ surgery.head_up.weight.T
    assert_same_logits(logits_of(remote, ids), expected)

    dest = tmp_path / "baked"
    result = _invoke("bake", out, dest, "--domain", "math", "--drop-position-bias")
    assert result.exit_code == 0, result.output
    assert f"with position table {kl['after']:.4f}" in result.output
    assert f"without it (what was folded) {kl['after_without_position_bias']:.4f}" in result.output
    saved = tmp_path / "saved"
    _plain(dest).save_pretrained(saved)
    assert_same_logits(logits_of(_plain(saved), ids), expected_baked)
    assert "dropped" in (dest / "README.md").read_text()
