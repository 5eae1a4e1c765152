"""KL at scale: cached expert targets against the exact loss, and seeded positions-per-step training."""

import pytest
import torch

from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
from mergekit_darts.repair.train.kl import build_kl_target, kl_to_target
from mergekit_darts.repair.train.kl import kl_loss
from mergekit_darts.repair.train.loop import train_surgery

H, V, M = 16, 50, 40
# float32 sums over V = 50 terms reordered: the cached loss and its gradient match the exact one to this
TOL = dict(rtol=1e-5, atol=1e-6)


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    corrected = torch.randn(M, H, generator=g)
    expert = corrected + 0.5 * torch.randn(M, H, generator=g)
    expert_head, merged_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    return corrected, expert, expert_head, merged_head


def value_and_grad(fn, corrected):
    h = corrected.clone().requires_grad_(True)
    value = fn(h)
    value.backward()
    return value.detach(), h.grad


@pytest.mark.parametrize("chunk_size", [7, 1024])  # several checkpointed chunks, and one plain chunk
def test_topk_covering_all_mass_equals_exact_kl_and_gradient(chunk_size):
    corrected, expert, expert_head, merged_head = tensors()
    head_fix = torch.nn.Linear(H, V, bias=False)
    rows = torch.arange(M)
    target = build_kl_target("topk", expert, expert_head, top_k=V, chunk_size=chunk_size)
    assert torch.all(target.tail_mass < 1e-6)
    for correction in (None, head_fix):
        exact, exact_grad = value_and_grad(
            lambda h: kl_loss(h, expert, expert_head, merged_head, head_correction=correction), corrected)
        cached, cached_grad = value_and_grad(
            lambda h: kl_to_target(h, rows, target, merged_head, correction, chunk_size=chunk_size), corrected)
        assert exact > 0.1  # a real gap, not two zeros
        torch.testing.assert_close(cached, exact, **TOL)
        torch.testing.assert_close(cached_grad, exact_grad, **TOL)


def test_truncated_topk_is_a_lower_bound_and_bf16_is_close():
    corrected, expert, expert_head, merged_head = tensors(1)
    rows = torch.arange(M)
    exact = kl_loss(corrected, expert, expert_head, merged_head)
    previous = 0.0
    for k in (1, 5, 20, V):
        value = kl_to_target(corrected, rows, build_kl_target("topk", expert, expert_head, top_k=k), merged_head)
        assert previous - 1e-6 <= value <= exact + 1e-5  # coarsening never increases KL; more k, more KL
        previous = value
    dense = kl_to_target(corrected, rows, build_kl_target("bf16", expert, expert_head), merged_head)
    # bfloat16 keeps 8 significant bits: about 0.4% relative error per probability
    assert abs(float(dense) - float(exact)) <= 0.01 * float(exact)


def test_rows_select_positions_of_the_target():
    corrected, expert, expert_head, merged_head = tensors(2)
    target = build_kl_target("topk", expert, expert_head, top_k=V)
    rows = torch.tensor([5, 3, 17])
    torch.testing.assert_close(kl_to_target(corrected[rows], rows, target, merged_head),
                               kl_loss(corrected[rows], expert[rows], expert_head, merged_head), **TOL)


def training_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, t = 3, 12
    merged = torch.randn(n, t, H, generator=g)
    target = merged + 0.3 * torch.randn(n, t, H, generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 8:] = False
    mask[2, 5:] = False
    position_ids = torch.arange(t).expand(n, t).clone()
    heads = {"expert_head": torch.randn(V, H, generator=g), "merged_head": torch.randn(V, H, generator=g)}
    return (merged, target, mask, position_ids), heads


def train(seed, steps=6, **options):
    args, heads = training_inputs()
    torch.manual_seed(0)
    module = DomainSurgery.from_shape(SurgeryShape(method="darts", rank=4, head_rank=2, max_positions=16, content="relu"),
                                      hidden_size=H, vocab_size=V)
    history = train_surgery(module, *args, loss="kl", steps=steps, lr=1e-2, seed=seed, kl_chunk_size=8,
                            **heads, **options)
    return history, {name: p.detach().clone() for name, p in module.state_dict().items()}


def test_positions_per_step_training_is_seeded_and_deterministic():
    first, first_state = train(seed=4, kl_positions_per_step=5, kl_target="topk", kl_top_k=8)
    again, again_state = train(seed=4, kl_positions_per_step=5, kl_target="topk", kl_top_k=8)
    other, _ = train(seed=5, kl_positions_per_step=5, kl_target="topk", kl_top_k=8)
    assert first == again
    for name in first_state:
        assert torch.equal(first_state[name], again_state[name]), name
    assert first != other  # another seed draws other positions
    full, _ = train(seed=4, kl_target="topk", kl_top_k=8)
    assert first != full


def test_cached_target_training_follows_the_exact_loss():
    exact, exact_state = train(seed=0)  # default options: today's exact path
    cached, cached_state = train(seed=0, kl_target="topk", kl_top_k=V)
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(exact), rtol=1e-4, atol=1e-6)
    assert exact[-1] < exact[0]
    for name in exact_state:
        torch.testing.assert_close(cached_state[name], exact_state[name], rtol=1e-4, atol=1e-5)


def test_bad_options_are_named():
    args, heads = training_inputs()
    module = DomainSurgery.from_shape(SurgeryShape(method="darts", rank=4, head_rank=0, max_positions=16, content="relu"),
                                      hidden_size=H,
                                      vocab_size=V)
    with pytest.raises(ValueError, match="kl_target"):
        train_surgery(module, *args, loss="kl", steps=1, kl_target="top", **heads)
    with pytest.raises(ValueError, match="kl_positions_per_step"):
        train_surgery(module, *args, loss="kl", steps=1, kl_positions_per_step=0, **heads)
    with pytest.raises(ValueError, match="kl_precision"):
        train_surgery(module, *args, loss="kl", steps=1, kl_precision="fp8", **heads)


def test_surgery_block_scale_options_default_to_the_exact_single_device_path():
    from mergekit_darts.config import SurgeryConfigError, parse_surgery_block

    base = {"loss": "kl", "domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}}
    surgery = parse_surgery_block(base)
    assert (surgery.kl_target, surgery.kl_precision, surgery.kl_positions_per_step) == ("exact", "float32", None)
    assert surgery.device_map is None and surgery.max_memory is None
    surgery = parse_surgery_block({**base, "kl_target": "bf16", "kl_positions_per_step": 4096,
                                   "device_map": "auto", "max_memory": {0: "20GiB", "cpu": "60GiB"}})
    assert surgery.max_memory == {0: "20GiB", "cpu": "60GiB"}
    for bad, field in [({"kl_positions_per_step": 0}, "surgery.kl_positions_per_step"),
                       ({"device_map": {"lm_head": "gpu"}}, "surgery.device_map"),
                       ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, "surgery.max_memory"),
                       ({"max_memory": {"cpu": "1GiB"}}, "max_memory needs device_map")]:
        with pytest.raises(SurgeryConfigError, match=field):
            parse_surgery_block({**base, **bad})


def test_yaml_with_offloaded_capture_and_scaled_kl_end_to_end(tiny_family, merged_copy, tmp_path, caplog):
    """The surgery block's scale options reach the capture and the training loop through the pipeline."""
    import os

    from helpers import merge_yaml
    from mergekit_darts.pipeline import run_surgery

    half = sum(os.path.getsize(os.path.join(merged_copy, f)) for f in os.listdir(merged_copy)
               if f.endswith(".safetensors")) // 2
    texts = ["how many apples are left if we have 7 and give 2 ?", "what is 3 plus 4 ?",
             "how many pears are left if we have 9 and give 4 ?", "what is 8 minus 5 ?"]
    config = merge_yaml(tiny_family) + "\n".join([
        "surgery:", "  loss: kl", "  rank: 4", "  head_rank: 2", "  max_positions: 32", "  steps: 30",
        "  lr: 0.01", "  held_out: 0.25", f"  cache_dir: {tmp_path / 'cache'}",
        "  device_map: auto", f"  max_memory: {{cpu: {half}}}",
        "  kl_target: bf16", "  kl_positions_per_step: 16",
        "  domains:", "    math:", f"      model: {tiny_family['math']}", "      calibration:",
        f"        texts: {texts}"]) + "\n"
    import logging

    with caplog.at_level(logging.INFO, logger="mergekit_darts.repair.capture.models"):
        report = run_surgery(config, merged_copy, progress=False)
    placed = [r.getMessage() for r in caplog.records if "placed as" in r.getMessage()]
    assert len(placed) == 2 and all("'disk'" in message for message in placed)  # merged + expert, offloaded
    kl = report["domains"]["math"]["held_out_kl"]
    assert kl["after"] < kl["before"]  # the held-out KL is the exact one, whatever the training target
