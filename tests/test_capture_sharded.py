"""Capture through accelerate's device map: cpu/disk offload and an explicit split give the same states."""

import os

import pytest
import torch

from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.repair.capture import models
from mergekit_darts.repair.capture.context import CaptureContext
from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains
from mergekit_darts.tiny import make_family

TEXTS = ["how many apples are left ?", "what is 2 + 3", "def sum ( list ) : return total", "print"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Four layers, so a map can split them; the base stands in for the merged model."""
    root = tmp_path_factory.mktemp("sharded")
    return make_family(str(root), domains=["math", "code"], seed=3, layers=4, hidden_size=64)


@pytest.fixture(scope="module")
def plain(family, tmp_path_factory):
    """The single-device capture every sharded one must reproduce."""
    return capture(family, tmp_path_factory.mktemp("plain"), "plain")


@pytest.fixture
def placements(monkeypatch):
    """Records each loaded model's hf_device_map and offload folder."""
    seen = []
    original = models.ModelSlot.get

    def spy(slot):
        model = original(slot)
        if not seen or seen[-1][0] is not slot:
            seen.append((slot, dict(getattr(model, "hf_device_map", None) or {}),
                         slot.placement.offload_dir if slot.placement else None))
        return model

    monkeypatch.setattr(models.ModelSlot, "get", spy)
    return seen


def specs(family):
    return [DomainCaptureSpec("math", family["math"], TEXTS[:2], continue_tokens=3),
            DomainCaptureSpec("code", family["code"], TEXTS[2:])]


def capture(family, tmp_path, label, **kwargs):
    # a fresh cache per variant: every variant must run its models
    ctx = CaptureContext.open(family["base"], 32, device="cpu", dtype="float32", progress=False, batch_size=2,
                              cache_dir=str(tmp_path / label), **kwargs)
    return capture_domains(ctx, specs(family))


def assert_same(plain, sharded):
    assert torch.equal(plain.merged_head, sharded.merged_head)
    for name, domain in plain.domains.items():
        other = sharded.domains[name]
        assert torch.equal(domain.input_ids, other.input_ids)  # includes the greedy continuation
        for field in ("merged_hidden", "expert_hidden", "expert_entropy", "expert_head"):
            expected, got = getattr(domain, field), getattr(other, field)
            assert expected.shape == got.shape, field
            assert torch.allclose(expected, got, atol=1e-5, rtol=0), (field, (expected - got).abs().max())


def model_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def test_max_memory_forces_cpu_and_disk_offload(family, plain, placements, tmp_path):
    # about half the model fits the "cpu" budget: the rest goes to disk
    budget = model_bytes(family["base"]) // 2
    sharded = capture(family, tmp_path, "auto", device_map="auto", max_memory={"cpu": budget})
    assert_same(plain, sharded)
    sharded_loads = [entry for entry in placements if entry[2] is not None]
    assert len(sharded_loads) == 3  # merged + two experts, one at a time
    for _, device_map, offload_dir in sharded_loads:
        assert {"cpu", "disk"} <= set(device_map.values()), device_map
        assert not os.path.exists(offload_dir)  # cleaned when the model was freed


def test_explicit_map_splits_layers_and_offloads_the_head(family, plain, placements, tmp_path):
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk",
                  "model.norm": "disk", "lm_head": "disk"}
    sharded = capture(family, tmp_path, "map", device_map=device_map)
    assert_same(plain, sharded)
    assert placements[-1][1] == device_map


def test_explicit_map_is_checked_against_the_model(family, tmp_path):
    with pytest.raises(SurgeryConfigError, match=r"surgery.device_map: \['model.layerz.0'\] are not module names"):
        capture(family, tmp_path, "bad", device_map={"model.layerz.0": "cpu", "": "cpu"})
    with pytest.raises(SurgeryConfigError, match=r"surgery.device_map: .*weights .* are on no device.*lm_head"):
        capture(family, tmp_path, "partial", device_map={"model": "cpu"})
