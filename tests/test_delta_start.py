"""``adapter_init: delta`` beyond the extract itself (issue 45 asks 1 and 3): directions the weight
deltas leave empty start as a LoRA does and train; a re-run on an unchanged merge reads no expert
weight file (the extract's factors are cached by content); with ``adapter_init: zero`` an expert whose
tensors cannot be compared with the merge's leaves the baseline unmeasured, never fails the run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import QUICK_TEXTS, merge_yaml
from test_depth import depth_config


@pytest.fixture(scope="module")
def low_rank_family(tiny_family, tmp_path_factory):
    """The tiny base with two experts that changed only q_proj / v_proj, by a rank-2 delta (a PEFT LoRA
    on q/v merged into the weights)."""
    from mergekit_darts.tiny import make_low_rank_expert

    root = tmp_path_factory.mktemp("low_rank")
    family = {"base": tiny_family["base"]}
    for seed, name in enumerate(("math", "code"), start=1):
        family[name] = make_low_rank_expert(tiny_family["base"], str(root / name), seed=seed)
    return family


def test_empty_directions_start_as_lora_and_the_product_is_the_extract():
    """A linear without a delta gets the module's own random ``down`` and a zero ``up``; a rank-1 delta
    fills one direction of a rank-3 adapter; the product is the extract either way."""
    from mergekit_darts.remote_code.blocks import BlockAdapter
    from mergekit_darts.repair.train.delta_init import DomainDeltas, low_rank_factors, start_from_deltas

    class Blocks(torch.nn.Module):  # stands in for a DomainSurgery with two adapters and no head
        head_down = None

        def __init__(self):
            super().__init__()
            self.unchanged, self.changed = BlockAdapter(6, 5, 3), BlockAdapter(6, 5, 3)

        def block_adapters(self):
            return [(0, "unchanged", self.unchanged), (0, "changed", self.changed)]

    torch.manual_seed(0)
    module = Blocks()
    fresh = {name: adapter.down.weight.clone() for _, name, adapter in module.block_adapters()}
    rank_one = torch.randn(5, 1) @ torch.randn(1, 6)
    deltas = DomainDeltas(rank=3, blocks={(0, "unchanged"): low_rank_factors(torch.zeros(5, 6), 3),
                                          (0, "changed"): low_rank_factors(rank_one, 3)})
    assert deltas.empty_directions() == 3 + 2
    start_from_deltas(module, deltas)
    torch.testing.assert_close(module.unchanged.down.weight, fresh["unchanged"])  # a LoRA's start, not zeros
    assert bool(module.unchanged.down.weight.abs().sum() > 0) and not bool(module.unchanged.up.weight.any())
    torch.testing.assert_close(module.changed.down.weight[1:], fresh["changed"][1:])
    torch.testing.assert_close(module.changed.up.weight @ module.changed.down.weight, rank_one)
    # with a gradient through the output, both adapters' up factors now move
    inputs = torch.randn(4, 6)
    (module.unchanged(inputs).sum() + module.changed(inputs).sum()).backward()
    assert bool(module.unchanged.up.weight.grad.abs().sum() > 0)
    assert bool(module.changed.up.weight.grad[:, 1:].abs().sum() > 0)


def test_mergekit_yaml_trains_every_adapter_of_q_v_experts(low_rank_family, tmp_path):
    """Experts that changed only q/v: after training through mergekit-yaml with adapter_init: delta,
    the k_proj and mlp.down_proj adapters and the head correction (no delta at all) moved, and so did
    the q_proj directions past the delta's rank. (The extract is exact here, so the no-regret choice
    would ship it untrained: it is turned off to see what training did.)"""
    from safetensors.torch import load_file

    domains = "".join(f"    {name}:\n      model: {low_rank_family[name]}\n"
                      f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code"))
    config = tmp_path / "cfg.yml"
    config.write_text(merge_yaml(low_rank_family) + (
        "surgery:\n  loss: kl\n  adapter_init: delta\n  depth: all\n  depth_rank: 6\n  head_rank: 2\n  rank: 2\n"
        "  no_regret: false\n  max_positions: 16\n  steps: 5\n  lr: 0.01\n  device: cpu\n  dtype: float32\n  held_out: 0.34\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n") + domains)
    out = tmp_path / "out"
    result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "darts_report.json").read_text())
    darts = load_file(str(out / "darts.safetensors"))
    for name in ("math", "code"):
        # expert − merge is rank 4 on q/v (half of each expert's rank-2 delta), zero elsewhere
        assert report["domains"][name]["baseline"]["empty_directions"] == 2 * (5 * 6 + 2 * 2) + 2
        for layer in (0, 1):
            for path in ("self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj"):
                prefix = f"darts.{name}.blocks.{layer}.{path}."
                assert bool(darts[prefix + "up.weight"].any()) and bool(darts[prefix + "down.weight"].any()), prefix
            assert bool(darts[f"darts.{name}.blocks.{layer}.self_attn.q_proj.up.weight"][:, 4:].any())
        assert bool(darts[f"darts.{name}.head_up.weight"].any())


def _spy_weight_reads(monkeypatch, expert_dirs):
    """Record every safetensors file of ``expert_dirs`` opened for its tensors (safe_open, load_file,
    or read whole to hash it); header-only reads are not recorded."""
    import safetensors
    import safetensors.torch
    import transformers.modeling_utils as modeling_utils

    from mergekit_darts.repair.capture import cache

    opened = []

    def recorded(path):
        if any(str(path).startswith(expert) for expert in expert_dirs):
            opened.append(str(path))

    def spy(original):
        def wrapper(path, *args, **kwargs):
            recorded(path)
            return original(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(safetensors, "safe_open", spy(safetensors.safe_open))
    monkeypatch.setattr(safetensors.torch, "load_file", spy(safetensors.torch.load_file))
    if hasattr(modeling_utils, "safe_open"):
        monkeypatch.setattr(modeling_utils, "safe_open", spy(modeling_utils.safe_open))
    digest = cache.FileHashes.digest
    monkeypatch.setattr(cache.FileHashes, "digest", lambda self, path: (
        recorded(path) if self._load().get(_stamp(path)) is None else None) or digest(self, path))
    return opened


def _stamp(path):
    import os

    stat = os.stat(path)
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


def test_rerun_on_an_unchanged_merge_opens_no_expert_weight_file(tiny_family, tmp_path, monkeypatch):
    """The first run reads the experts (capture and extract); the second, on the same merge and
    cache, reads none of their weight files and reports the same baseline."""
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    opened = _spy_weight_reads(monkeypatch, [tiny_family["math"], tiny_family["code"]])
    config = depth_config(tiny_family, tmp_path / "cache", depth=1, steps=2,
                          extra="  adapter_init: delta\n  head_rank: 2\n")
    first = run_surgery(config, str(out), progress=False)
    assert any(path.startswith(tiny_family["math"]) for path in opened)  # the spy sees the reads
    opened.clear()
    second = run_surgery(config, str(out), progress=False)
    assert opened == []
    for name in ("math", "code"):
        assert second["domains"][name]["baseline"]["held_out_kl"] == first["domains"][name]["baseline"]["held_out_kl"]


def test_zero_init_with_an_expert_unlike_the_merge_leaves_the_baseline_unmeasured(tiny_family, tmp_path):
    """A one-layer expert beside a two-layer merge (depth 1 adapts layer 1, which the expert lacks):
    with adapter_init: zero the capture, training and export complete, the baseline says why it was not
    measured. (Run from after the pre-merge checks: ``repair_directory``, what every run calls.)"""
    from mergekit_darts.pipeline import parse_config_source, repair_directory
    from mergekit_darts.settings import RunSettings
    from mergekit_darts.tiny import make_random_model

    shallow = tmp_path / "shallow"
    make_random_model(str(shallow), seed=7, layers=1)
    family = {**tiny_family, "math": str(shallow)}
    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    _, surgery = parse_config_source(depth_config(family, tmp_path / "cache", depth=1, steps=2))
    report = repair_directory(str(out), surgery, RunSettings.resolve(surgery, None, False))
    assert "could not be read" in report["domains"]["math"]["baseline"]["not_measured"]
    assert "layers.1." in report["domains"]["math"]["baseline"]["not_measured"]
    assert "held_out_kl" in report["domains"]["code"]["baseline"]  # the comparable expert is measured
