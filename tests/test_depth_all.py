"""``depth`` up to every decoder block: adapters trained from the cached embeddings (the first block's
input) with minibatches, exported and applied by the emitted model; the 7B share counts all 32 blocks."""

import shutil

import pytest
import torch

from helpers import QUICK_TEXTS, merge_yaml


def test_all_blocks_train_from_the_embeddings_in_minibatches(tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM

    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.budget import describe_share, share_of_7b
    from mergekit_darts.repair.report.table import render_report

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    layers = AutoModelForCausalLM.from_pretrained(tiny_family["merged"]).config.num_hidden_layers
    texts = QUICK_TEXTS["math"] + QUICK_TEXTS["code"]
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 12\n  lr: 0.01\n  loss: kl\n  depth: all\n"
        "  depth_rank: 2\n  batch_size: 2\n  held_out: 0.34\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n    math:\n      model: {tiny_family['math']}\n"
        f"      calibration: {{texts: {texts}, samples: 6, continue_tokens: 2}}\n")
    report = run_surgery(config, str(out))
    entry = report["domains"]["math"]
    assert entry["calibration"]["train"] == 4  # > batch_size: the steps ran on minibatches
    assert entry["held_out_kl"]["after"] < entry["held_out_kl"]["before"]
    assert report["surgery"]["layers"] == layers and report["surgery"]["depth"] == layers  # "all" resolved

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    surgery = model.darts["math"]
    assert {index for index, _, _ in surgery.block_adapters()} == set(range(layers))
    ids = torch.randint(4, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        corrected = model(ids, darts_domain="math").logits
        handles = [model.model.layers[i].get_submodule(p).register_forward_hook(
            lambda m, a, o, ad=ad: o + ad(a[0])) for i, p, ad in surgery.block_adapters()]
        final = model.model(input_ids=ids).last_hidden_state
        for handle in handles:
            handle.remove()
        by_hand = model.lm_head(surgery(final, torch.arange(5).expand(2, 5)))
    torch.testing.assert_close(corrected, by_hand, atol=1e-5, rtol=1e-5)
    moved = [float(adapter.up.weight.detach().abs().max()) for index, _, adapter in surgery.block_adapters() if index == 0]
    assert max(moved) > 0  # the first block's adapters trained too

    # every block of the tiny model adapted: on the 7B shape that is all 32 blocks
    budget = share_of_7b(report["surgery"])
    assert budget["parameters"] == 2 * 2 * 4096 + 16 * 4096 + 32 * 2 * 78080
    assert "32 (all)·2·78080" in budget["formula"]
    table = render_report(str(out), plot=False)
    assert "32 (all)·2·78080" in table and describe_share(budget).split(":")[0] in table


def test_share_counts_only_the_adapted_blocks_when_some_are_left():
    from mergekit_darts.repair.budget import share_of_7b

    settings = {"method": "darts", "rank": 64, "head_rank": 0, "max_positions": 512, "depth": 1, "depth_rank": 8}
    assert share_of_7b({**settings, "layers": 4})["parameters"] == share_of_7b(settings)["parameters"]
    every = share_of_7b({**settings, "depth": 4, "layers": 4})
    assert every["parameters"] == 2 * 64 * 4096 + 512 * 4096 + 32 * 8 * 78080 and not every["within_budget"]
    # rank-1 adapters on all 32 blocks stay within the 0.1 % budget
    assert share_of_7b({**settings, "depth": 4, "depth_rank": 1, "layers": 4})["share"] == pytest.approx(
        (2 * 64 * 4096 + 512 * 4096 + 32 * 78080) / every["model_parameters"])
    assert share_of_7b({**settings, "depth": 4, "depth_rank": 1, "layers": 4})["within_budget"]


def test_depth_all_is_the_only_word():
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.errors import SurgeryConfigError

    block = {"domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}}
    assert parse_surgery_block({**block, "depth": "all"}).depth == "all"
    with pytest.raises(SurgeryConfigError, match="surgery.depth"):
        parse_surgery_block({**block, "depth": "most"})
