"""``adapter_init: delta`` beyond the extract itself (issue 45 asks 1 and 3): directions the weight
deltas leave empty start as a LoRA does and train (whatever dtype the checkpoints are stored in); a
re-run on an unchanged merge reads no expert tensor, only the safetensors headers the checks before
the run read (the extract's factors are cached by content); with ``adapter_init: zero`` an expert whose
tensors cannot be compared with the merge's leaves the baseline unmeasured, never fails the run."""

import json
import os
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


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11), (torch.float32, 2 ** -24)])
def test_the_empty_direction_threshold_follows_the_checkpoints_dtype(tmp_path, dtype, unit):
    """Issue 53 ask 6: a rank-3 LoRA-style delta on q_proj and a rank-2 one on the head, both models
    stored in ``dtype``. Past the delta's rank the stored difference is the checkpoints' rounding; with
    float32's rule alone (the threshold before) bfloat16 filled those directions with it (0 empty).
    Now they are empty whatever the dtype, start as a LoRA does, and the filled ones are the delta's."""
    from safetensors.torch import save_file

    from mergekit_darts.remote_code.blocks import BlockAdapter
    from mergekit_darts.repair.train.delta_init import (domain_deltas, low_rank_factors, start_from_deltas,
                                                        unit_roundoff)

    assert unit_roundoff(dtype) == unit
    generator = torch.Generator().manual_seed(0)

    def lora(out_features, in_features, rank, weight):  # a delta of 5% of the weight's norm
        delta = torch.randn(out_features, rank, generator=generator) @ torch.randn(rank, in_features, generator=generator)
        return delta * (0.05 * weight.norm() / delta.norm())

    q = torch.randn(64, 48, generator=generator) * 0.02
    head = torch.randn(96, 48, generator=generator) * 0.02
    q_delta, head_delta = lora(64, 48, 3, q), lora(96, 48, 2, head)
    for name, weights in (("merged", {"q": q, "head": head}), ("expert", {"q": q + q_delta, "head": head + head_delta})):
        (tmp_path / name).mkdir()
        save_file({"model.layers.0.self_attn.q_proj.weight": weights["q"].to(dtype).contiguous(),
                   "lm_head.weight": weights["head"].to(dtype).contiguous()},
                  str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    targets = {0: {"self_attn.q_proj": (48, 64)}}
    deltas = domain_deltas(str(tmp_path / "merged"), str(tmp_path / "expert"), targets, rank=8, head_rank=4)
    assert deltas.empty_directions() == (8 - 3) + (4 - 2)
    assert deltas.describe()["empty_directions"] == 7
    stored = (q + q_delta).to(dtype).float() - q.to(dtype).float()
    if dtype == torch.bfloat16:  # float32's rule alone: the rounding fills every direction
        down, up = low_rank_factors(stored, 8)
        assert bool(down.any(dim=1).all())
    down, up = deltas.blocks[(0, "self_attn.q_proj")]
    left, values, right = torch.linalg.svd(stored, full_matrices=False)  # the stored delta's best rank 3
    torch.testing.assert_close(up @ down, left[:, :3] * values[:3] @ right[:3], atol=1e-6, rtol=1e-4)

    class Blocks(torch.nn.Module):  # stands in for a DomainSurgery with one adapter and no head
        head_down = None

        def __init__(self):
            super().__init__()
            self.q = BlockAdapter(48, 64, 8)

        def block_adapters(self):
            return [(0, "self_attn.q_proj", self.q)]

    torch.manual_seed(0)
    module = Blocks()
    fresh = module.q.down.weight.clone()
    start_from_deltas(module, deltas)
    torch.testing.assert_close(module.q.down.weight[3:], fresh[3:])  # the LoRA start past the delta's rank
    assert not bool(module.q.up.weight[:, 3:].any()) and bool(module.q.up.weight[:, :3].any(dim=0).all())
    torch.testing.assert_close(module.q.up.weight @ module.q.down.weight, up @ down)


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


def test_rerun_on_an_unchanged_merge_reads_no_expert_tensor_only_headers(tiny_family, tmp_path, monkeypatch):
    """The first run reads the experts (capture and extract); the second, on the same merge and
    cache, reads none of their tensors and reports the same baseline. It still reads each expert's
    safetensors header, for the checks before the run (every file whole; with adapter_init: delta the
    adapted linears' shapes): docs/quality.md says so (issue 53 ask 6)."""
    from mergekit_darts import preflight_weights
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    opened = _spy_weight_reads(monkeypatch, [tiny_family["math"], tiny_family["code"]])
    headers = []
    header = preflight_weights.safetensors_header
    monkeypatch.setattr(preflight_weights, "safetensors_header",
                        lambda path: headers.append(os.path.relpath(path, os.path.dirname(tiny_family["math"])))
                        or header(path))
    config = depth_config(tiny_family, tmp_path / "cache", depth=1, steps=2,
                          extra="  adapter_init: delta\n  head_rank: 2\n")
    first = run_surgery(config, str(out), progress=False)
    assert any(path.startswith(tiny_family["math"]) for path in opened)  # the spy sees the reads
    opened.clear()
    headers.clear()
    second = run_surgery(config, str(out), progress=False)
    assert opened == []
    assert sorted(set(headers) & {"math/model.safetensors", "code/model.safetensors"}) == [
        "code/model.safetensors", "math/model.safetensors"], headers
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
