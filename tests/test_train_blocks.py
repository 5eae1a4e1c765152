"""``train_blocks: k`` (issue 52 ask 1): every adapted block starts from the data-free extract, only the
last k train and the blocks below keep their extract; the first trained block's input is computed once
per record with the extract below it, and a step runs only the k trained blocks."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import QUICK_TEXTS, assert_same_logits, logits_of, merge_tiny, merge_yaml

LAYERS = 3


@pytest.fixture(scope="module")
def deep_family(tmp_path_factory):
    """The tiny family with three decoder layers (two frozen below one trained, or one between)."""
    from mergekit_darts.tiny import make_family

    root = tmp_path_factory.mktemp("deep")
    paths = make_family(str(root), layers=LAYERS)
    paths["merged"] = str(root / "merged")
    merge_tiny(paths, paths["merged"])
    return paths


def _config(family, cache, depth="all", train_blocks=1, extra="", calibration=""):
    texts = QUICK_TEXTS["math"] + QUICK_TEXTS["code"]
    return merge_yaml(family) + (
        f"surgery:\n  rank: 2\n  max_positions: 16\n  steps: 5\n  lr: 0.01\n  loss: kl\n  depth: {depth}\n"
        f"  depth_rank: 2\n  adapter_init: delta\n  train_blocks: {train_blocks}\n  held_out: 0.34\n  device: cpu\n"
        f"  dtype: float32\n  cache_dir: {cache}\n{extra}  domains:\n    math:\n      model: {family['math']}\n"
        f"      calibration: {{texts: {texts}, samples: 6{calibration}}}\n")


def _shipped(out, domain="math"):
    from safetensors.torch import load_file

    prefix = f"darts.{domain}."
    return {k[len(prefix):]: v for k, v in load_file(os.path.join(out, "darts.safetensors")).items()
            if k.startswith(prefix)}


def test_mergekit_yaml_ships_the_extract_below_the_trained_block(deep_family, tmp_path):
    """Through mergekit-yaml: blocks 0-1 ship exactly the extract the run started from, block 2
    trained; the report, the console and the card say which is which; bake and export-peft fold both."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.output.bake import bake
    from mergekit_darts.output.peft_export import export_peft
    from mergekit_darts.remote_code.blocks import block_linear_targets
    from mergekit_darts.repair.train.delta_init import cached_domain_deltas, domain_deltas, empty_rows

    config = tmp_path / "cfg.yml"
    # a linear final-state correction, so that bake folds the whole correction and the logits can be compared
    config.write_text(_config(deep_family, tmp_path / "cache", extra="  method: standard\n  content: linear\n"
                              "  no_regret: false\n"))
    out = tmp_path / "out"
    result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert "block 2 trained with the final-state correction" in console and "blocks 0–1 keep the data-free extract" in console
    entry = json.loads((out / "darts_report.json").read_text())["domains"]["math"]
    assert entry["blocks"]["trained"] == [2] and entry["blocks"]["extract"] == [0, 1]
    assert 0 < entry["blocks"]["trained_parameters"] < entry["parameters"]
    card = (out / "README.md").read_text()
    assert "`math`: block 2 trained" in card and "blocks 0–1 keep the data-free extract" in card

    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    targets = block_linear_targets(plain.model.layers, LAYERS)
    started = cached_domain_deltas(str(tmp_path / "cache"), str(out), deep_family["math"], targets, 2, 0)
    from_files = domain_deltas(str(out), deep_family["math"], targets, 2, 0)
    shipped = _shipped(out)
    moved = []
    for (index, path), (down, up) in started.blocks.items():
        ship_down, ship_up = shipped[f"blocks.{index}.{path}.down.weight"], shipped[f"blocks.{index}.{path}.up.weight"]
        if index < 2:  # exactly the extract: the factors the run started from (its cache), bit for bit
            filled = ~empty_rows(down, up)
            assert torch.equal(ship_up, up) and torch.equal(ship_down[filled], down[filled]), (index, path)
            file_down, file_up = from_files.blocks[(index, path)]
            torch.testing.assert_close(ship_up @ ship_down, file_up @ file_down, atol=1e-6, rtol=1e-5)
        else:
            moved.append(not torch.equal(ship_up, up))
    assert len(moved) == len(targets[2]) and all(moved)  # every linear of the top block trained

    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math").eval()
    ids = torch.randint(4, remote.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    baked = tmp_path / "baked"
    bake(str(out), "math", str(baked))  # both kinds of block adapters folded into their linears
    assert_same_logits(logits_of(AutoModelForCausalLM.from_pretrained(baked).eval(), ids), logits_of(remote, ids))
    peft = tmp_path / "peft"
    export_peft(str(out), str(peft), ["math"])
    from safetensors.torch import load_file

    lora = load_file(str(peft / "math" / "adapter_model.safetensors"))
    for index, linears in targets.items():
        for path in linears:
            module = f"base_model.model.model.layers.{index}.{path}"
            assert torch.equal(lora[f"{module}.lora_A.weight"], shipped[f"blocks.{index}.{path}.down.weight"])
            assert torch.equal(lora[f"{module}.lora_B.weight"], shipped[f"blocks.{index}.{path}.up.weight"])


@pytest.mark.parametrize("depth,train_blocks", [("all", 0), (2, 1)])
def test_the_cached_input_is_what_the_corrected_model_computes(deep_family, tmp_path, monkeypatch, depth,
                                                               train_blocks):
    """The input of the first trained block, computed once (with the extract below it), equals what the
    emitted model with the domain active computes there; with train_blocks: 0 that is the final norm's
    input (no block runs in a step). ``depth: 2`` of three layers: the adapted blocks start at layer 1."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts import pipeline
    from mergekit_darts.repair.report.table import blocks_text
    from mergekit_darts.repair.train import top_blocks

    cached, captured = [], {}
    original_inputs, original_train = top_blocks.first_trained_inputs, pipeline.train_domain

    def spy_inputs(lower, module, *args, **kwargs):
        result = original_inputs(lower, module, *args, **kwargs)
        cached.append((lower.first + len(lower.layers), result))
        return result

    def spy_train(name, data, *args, **kwargs):
        captured[name] = data
        return original_train(name, data, *args, **kwargs)

    monkeypatch.setattr(top_blocks, "first_trained_inputs", spy_inputs)
    monkeypatch.setattr(pipeline, "train_domain", spy_train)
    out = tmp_path / "out"
    shutil.copytree(deep_family["merged"], out)
    # continuations of 12 tokens leave 4 positions of 16 for a prompt: the longer held-out records are
    # measured on prefixes (capture/prefixes.py), whose first trained block's input is computed once too
    report = pipeline.run_surgery(_config(deep_family, tmp_path / "cache", depth, train_blocks,
                                          calibration=", continue_tokens: 12"), str(out))
    first = LAYERS - train_blocks
    assert [layer for layer, _ in cached] == [first, first]  # once for the records, once for the prefixes
    blocks = report["domains"]["math"]["blocks"]
    adapted = range(LAYERS - (LAYERS if depth == "all" else depth), LAYERS)
    assert blocks["trained"] == [i for i in adapted if i >= first] and blocks["extract"] == [i for i in adapted if i < first]
    words = blocks_text(report["domains"]["math"])
    assert words.startswith("only the final-state correction trained" if train_blocks == 0 else "block 2 trained")
    assert (" blocks 0–2 keep the" if train_blocks == 0 else " block 1 keeps the") in words

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math",
                                                 dtype=torch.float32).eval()
    seen = []
    where = model.model.norm if first == LAYERS else model.model.layers[first]
    handle = where.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    for data, (_, inputs) in zip((captured["math"], captured["math"].prefixes), cached):
        seen.clear()
        with torch.no_grad():
            model(input_ids=data.input_ids, attention_mask=data.attention_mask.long())
        mask = data.attention_mask.bool()
        torch.testing.assert_close(inputs[mask], seen[0].float()[mask], atol=2e-5, rtol=1e-4)
    handle.remove()


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_step_equals_the_whole_model_path(arch, k):
    """Loss and gradients of a step from the cached input through the last k blocks equal those of the
    whole tail run from the first adapted block's input with the lower adapters frozen (Qwen2: adapters
    with biases); two Adam steps give the same parameters, and the frozen adapters stay their start."""
    import transformers

    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train import top_blocks
    from mergekit_darts.repair.train.loop import train_surgery
    from mergekit_darts.repair.train.losses import surgery_loss
    from mergekit_darts.repair.train.tail import TailSurgery

    config = getattr(transformers, f"{arch}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    tail = FrozenTail.from_model(getattr(transformers, f"{arch}ForCausalLM")(config).float().eval(), LAYERS)
    generator = torch.Generator().manual_seed(1)
    n, t, hidden, vocab = 5, 7, 32, 64
    inputs = torch.randn(n, t, hidden, generator=generator)
    target = torch.randn(n, t, hidden, generator=generator)
    mask = torch.arange(t).expand(n, t) < torch.tensor([7, 3, 5, 1, 6])[:, None]
    positions = torch.arange(t).expand(n, t).contiguous()
    heads = {"expert_head": torch.randn(vocab, hidden, generator=generator),
             "merged_head": torch.randn(vocab, hidden, generator=generator)}
    shape = SurgeryShape("darts", rank=4, head_rank=2, max_positions=t, content="relu", depth=LAYERS, depth_rank=2)
    start = DomainSurgery.from_shape(shape, hidden, vocab, tail.targets)
    for parameter in start.parameters():  # a non-zero start (as an extract is), so every factor has a gradient
        parameter.data.normal_(0, 0.1, generator=generator)
    assert any(adapter.up.bias is not None for _, _, adapter in start.block_adapters()) == (arch == "Qwen2")
    first = LAYERS - k
    whole, top = (top_blocks.freeze_below(copy.deepcopy(start), first) for _ in range(2))
    lower, upper = top_blocks.split_tail(tail, k)
    assert (lower.first, len(lower.layers), upper.first, len(upper.layers)) == (0, first, first, k)
    assert upper.norm is tail.norm and all(a is b for a, b in zip(upper.layers, tail.layers[first:]))
    cached = top_blocks.first_trained_inputs(lower, top, inputs, positions, batch_size=2, device="cpu")

    def step_loss(module, block_input):
        corrected = module(block_input, positions)
        return surgery_loss("kl", corrected, target, mask, head_correction=module.surgery.head_correction, **heads)

    loss_whole, loss_top = step_loss(TailSurgery(tail, whole), inputs), step_loss(TailSurgery(upper, top), cached)
    loss_whole.backward()
    loss_top.backward()
    torch.testing.assert_close(loss_top, loss_whole, atol=1e-6, rtol=1e-5)
    for (name, a), (_, b) in zip(whole.named_parameters(), top.named_parameters()):
        frozen = name.startswith("blocks.") and int(name.split(".")[1]) < first
        assert (a.grad is None and b.grad is None) if frozen else (a.grad is not None), name
        if not frozen:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)
    whole.zero_grad(set_to_none=True)
    top.zero_grad(set_to_none=True)

    for module, block_input, blocks in ((whole, inputs, tail), (top, cached, upper)):
        train_surgery(TailSurgery(blocks, module), block_input, target, mask, positions, loss="kl", steps=2, lr=1e-2,
                      **heads)
    for (name, a), (_, b), (_, s) in zip(whole.state_dict().items(), top.state_dict().items(),
                                         start.state_dict().items()):
        # a key's bias shifts all of a query's scores alike, which softmax ignores: its gradient is zero but
        # for rounding, and Adam's normalised step turns rounding into steps of lr (compared as gradients above)
        if not name.endswith("k_proj.up.bias"):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4, msg=name)
        if name.startswith("blocks.") and int(name.split(".")[1]) < first:
            assert torch.equal(b, s), name  # never moved: still the start
        elif name.startswith("blocks."):
            assert not torch.equal(b, s), name


def test_a_bad_train_blocks_is_refused_before_the_merge(deep_family, tmp_path):
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.errors import SurgeryConfigError
    from mergekit_darts.pipeline import merge_and_repair

    def no_merge(*args, **kwargs):
        pytest.fail("the merge ran")

    out = tmp_path / "out"
    with pytest.raises(SurgeryConfigError, match=r"surgery\.train_blocks: 4 exceeds the 3 adapted decoder blocks"):
        merge_and_repair(_config(deep_family, tmp_path / "cache", "all", 4), str(out), no_merge)
    assert not out.exists()
    block = {"domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}}
    delta = {**block, "depth": 2, "adapter_init": "delta"}
    assert parse_surgery_block({**delta, "train_blocks": "all"}).train_blocks == "all"
    assert parse_surgery_block({**delta, "train_blocks": 0}).train_blocks == 0
    for bad, words in (({**block, "depth": 2, "train_blocks": 1}, "adapter_init: delta"),
                       ({**block, "head_rank": 2, "loss": "kl", "adapter_init": "delta", "train_blocks": 1}, "depth > 0"),
                       ({**delta, "train_blocks": 3}, r"train_blocks \(3\) exceeds the 2 adapted"),
                       ({**delta, "train_blocks": -1}, "surgery.train_blocks"),
                       ({**delta, "train_blocks": "most"}, "surgery.train_blocks"),
                       ({**delta, "train_blocks": True}, "surgery.train_blocks")):
        with pytest.raises(SurgeryConfigError, match=words):
            parse_surgery_block(bad)
