"""``micro_batch_size``: a step's rows run a few at a time and their gradients are summed, weighted by
their share of the step's loss, so training is the same as with the whole batch at once in less memory
(what lets the full-batch preset run at 7B on one GPU; docs/scale.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_depth import _tiny_model
from test_preset_fit import _offline_example

BLOCK_PREFIX = "blocks."
DOMAINS = {"math": {"model": "m", "calibration": {"texts": ["a b"]}}}


def _trained(loss, micro, batch_size=None, steps=4, depth=False, **kl_options):
    """A tiny correction (with ``depth``: adapters in both blocks of a random Llama) trained on rows of
    uneven length, one of them padding only; its parameters after ``steps`` steps."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.loop import train_surgery
    from mergekit_darts.repair.train.tail import TailSurgery

    generator = torch.Generator().manual_seed(0)
    n, t, hidden, vocab = 7, 6, 32, 64
    merged = torch.randn(n, t, hidden, generator=generator)
    target = merged + 0.3 * torch.randn(n, t, hidden, generator=generator)
    lengths = torch.tensor([6, 2, 5, 0, 3, 6, 1])
    mask = torch.arange(t).expand(n, t) < lengths[:, None]
    positions = torch.arange(t).expand(n, t).contiguous()
    entropy = torch.rand(n, t, generator=generator) + 0.1
    heads = {"expert_head": torch.randn(vocab, hidden, generator=generator),
             "merged_head": torch.randn(vocab, hidden, generator=generator)} if loss == "kl" else {}
    torch.manual_seed(0)
    tail = FrozenTail.from_model(_tiny_model("Llama"), 2) if depth else None
    shape = SurgeryShape("darts", rank=4, head_rank=2 if loss == "kl" else 0, max_positions=t, content="relu",
                         depth=2 if depth else 0, depth_rank=2 if depth else 0)
    module = DomainSurgery.from_shape(shape, hidden, vocab, tail.targets if depth else None)
    for parameter in module.parameters():  # a non-zero start, so every factor has a gradient
        parameter.data.normal_(0, 0.05, generator=generator)
    trained = TailSurgery(tail, module) if depth else module
    gradients = []  # each step's gradient, as Adam receives it
    adam_step = torch.optim.Adam.step

    def recording_step(optimizer, *args, **kwargs):
        gradients.append({name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None})
        return adam_step(optimizer, *args, **kwargs)

    torch.optim.Adam.step = recording_step
    try:
        history = train_surgery(trained, merged, target, mask, positions, entropy=entropy, loss=loss, steps=steps,
                                lr=1e-2, batch_size=batch_size, seed=3, micro_batch_size=micro, **heads,
                                **kl_options)
    finally:
        torch.optim.Adam.step = adam_step
    return gradients, history


def _assert_same_training(whole, parts, what):
    """The same gradient at the first step (later ones differ by Adam's amplified rounding where a
    gradient cancels to about 0: an L1 sign sum), and the same losses along the way."""
    (whole_gradients, whole_history), (gradients, history) = whole, parts
    assert set(gradients[0]) == set(whole_gradients[0]) and len(gradients) == len(whole_gradients)
    for name, gradient in whole_gradients[0].items():
        torch.testing.assert_close(gradients[0][name], gradient, rtol=1e-5, atol=1e-6, msg=f"{what} {name}")
    assert history == pytest.approx(whole_history, rel=1e-4)


@pytest.mark.parametrize("loss", ["l1", "ewl1", "mse", "cosine", "kl"])
def test_micro_batches_train_what_the_whole_batch_trains(loss):
    whole = _trained(loss, None)
    for micro in (1, 2, 3):
        _assert_same_training(whole, _trained(loss, micro), f"{loss} micro {micro}")


def test_micro_batches_of_minibatches_of_the_blocks_adapters_and_of_cached_kl_targets():
    for kwargs in ({"batch_size": 4}, {"depth": True}, {"depth": True, "batch_size": 5},
                   {"kl_target": "bf16"}, {"kl_target": "topk", "kl_top_k": 8, "batch_size": 5}):
        whole = _trained("kl", None, **kwargs)
        assert ("depth" in kwargs) == any(k.startswith(BLOCK_PREFIX) for k in whole[0][0])
        _assert_same_training(whole, _trained("kl", 2, **kwargs), str(kwargs))


def test_equal_parts_with_unequal_padding_are_weighted_by_their_positions():
    """Weighting each part by its rows' count would be a different step: the test above could not tell
    a wrong weighting apart when every part had the same share, so this shows they differ here."""
    from mergekit_darts.repair.train.loop import _micro_batches

    weights = torch.tensor([6.0, 2.0, 5.0, 0.0, 3.0, 6.0, 1.0])
    parts = list(_micro_batches(None, 7, 2, weights))
    assert [p.tolist() for p, _ in parts] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [round(share, 6) for _, share in parts] == [round(w / 23, 6) for w in (8.0, 5.0, 9.0, 1.0)]
    assert list(_micro_batches(None, 7, None, weights)) == [(None, None)]
    assert [(p.tolist(), s) for p, s in _micro_batches(torch.tensor([3]), 7, 1, weights)] == [([3], None)]


def test_micro_batch_size_with_drawn_positions_is_refused_by_name():
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.errors import SurgeryConfigError

    domains = DOMAINS
    with pytest.raises(SurgeryConfigError, match="micro_batch_size together with kl_positions_per_step"):
        parse_surgery_block({"loss": "kl", "kl_positions_per_step": 64, "micro_batch_size": 2, "domains": domains})
    with pytest.raises(SurgeryConfigError, match="micro_batch_size"):
        parse_surgery_block({"micro_batch_size": 0, "domains": domains})
    assert parse_surgery_block({"preset": "best", "micro_batch_size": 2, "domains": domains}).micro_batch_size == 2


def test_mergekit_yaml_with_micro_batches_ships_the_same_preset(tmp_path):
    """The offline example under ``preset: best`` (its minibatch steps, no-regret, block adapters), once
    with the whole batch per step and once one sequence at a time: the same modules and held-out KL."""
    from transformers import AutoModelForCausalLM

    config, text = _offline_example(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    outputs = {}
    for name, extra in (("whole", ""), ("micro", "  micro_batch_size: 1\n")):
        config.write_text(text.replace("  preset: best\n", "  preset: best\n" + extra))
        result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), name],
                                cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[name] = tmp_path / name
    reports = {n: json.loads((p / "darts_report.json").read_text()) for n, p in outputs.items()}
    assert reports["micro"]["surgery"]["micro_batch_size"] == 1 and reports["whole"]["surgery"]["micro_batch_size"] is None
    for domain in ("math", "code"):
        whole, micro = (reports[n]["domains"][domain] for n in ("whole", "micro"))
        assert micro["selection"].get("steps") == whole["selection"].get("steps")
        # float32 sums in another order over hundreds of Adam steps: 1.04e-4 apart on an AVX512 machine
        assert micro["held_out_kl"]["after"] == pytest.approx(whole["held_out_kl"]["after"], rel=1e-3)
    models = {n: AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True) for n, p in outputs.items()}
    for domain in ("math", "code"):
        whole, micro = (models[n].darts[domain].state_dict() for n in ("whole", "micro"))
        assert set(whole) == set(micro) and any(k.startswith(BLOCK_PREFIX) for k in whole)
        for key in whole:
            torch.testing.assert_close(micro[key], whole[key], rtol=1e-4, atol=1e-6, msg=f"{domain} {key}")


@pytest.mark.parametrize("micro, says", [(None, "set surgery.micro_batch_size (e.g. 4"),
                                         (8, "lower surgery.micro_batch_size (now 8)"),
                                         (1, "micro_batch_size is already 1")])
def test_a_gpu_out_of_memory_while_training_says_which_setting_to_change(micro, says):
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.errors import DeviceError, first_line
    from mergekit_darts.repair.train.domain import memory_advice

    written = {} if micro is None else {"micro_batch_size": micro}
    surgery = parse_surgery_block({**written, "domains": DOMAINS})
    with pytest.raises(DeviceError) as raised:
        with memory_advice("math", surgery):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    line = first_line(raised.value)
    assert line.startswith("surgery.domains.math: the GPU ran out of memory while training;") and says in line
    with pytest.raises(ValueError, match="not a memory error"):  # other errors pass through unchanged
        with memory_advice("math", surgery):
            raise ValueError("not a memory error")
