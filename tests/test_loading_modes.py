"""The emitted model under the ways it is really loaded (issue 13): bitsandbytes 8/4-bit, accelerate
disk and cpu offload, torch.autocast, replicas, and a directory that lost its darts.* tensors.

Each mode: logits equal an independent computation within the mode's tolerance, and the correction is
visibly active (differs from darts_domain="none" by more than VISIBLE)."""

import json
import logging
import os

import pytest
import torch

from loading_helpers import VISIBLE, make_tiny_darts_dir, manual_rows, padded_batch
from test_modeling import PAD, load


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("modes") / "darts")
    modules = make_tiny_darts_dir(path)
    batch = padded_batch(path)
    reference = load(path, trust_remote_code=True)  # full precision, default domain "math"
    with torch.no_grad():
        full = reference(**batch).logits
        none = logits_without_correction(reference, batch)
    assert (full - none).abs().max() > VISIBLE
    return {"path": path, "modules": modules, "batch": batch, "full": full, "reference": reference}


def logits_without_correction(model, batch):
    """Through the default domain (set_darts_domain), not a per-call argument: these modes are
    independent of test_domains_per_row's feature."""
    default = model.darts_domain
    model.set_darts_domain("none")
    try:
        with torch.no_grad():
            return model(**batch).logits
    finally:
        model.set_darts_domain(default)


def assert_corrected(model, tiny, atol_vs_full, plain=None, atol_vs_plain=1e-5):
    """Logits of ``model`` (default domain math): equal to ``plain``'s hidden states + the float32
    surgery within atol_vs_plain, to the full-precision model within atol_vs_full, and visibly
    different from the same model with darts_domain="none"."""
    batch = tiny["batch"]
    with torch.no_grad():
        got = model(**batch).logits.float()
        uncorrected = logits_without_correction(model, batch).float()
    if plain is not None:
        expected = manual_rows(plain, [tiny["modules"]["math"]] * batch.input_ids.shape[0], batch)
        torch.testing.assert_close(got, expected, rtol=0, atol=atol_vs_plain)
    torch.testing.assert_close(got, tiny["full"], rtol=0, atol=atol_vs_full)
    assert (got - uncorrected).abs().max() > VISIBLE


def assert_darts_float32_unquantized(model):
    for name, module in model.darts.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert type(module) in (torch.nn.Linear, type(model.darts["math"])), name
            assert all(p.dtype == torch.float32 for p in module.parameters(recurse=False)), name


# ------------------------------------------------------------------------------------- bitsandbytes

@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_keeps_darts_float32_and_unquantized(tiny, bits):
    """Quantization error of the merged model's own layers is the only difference: the correction on
    the quantized model's hidden states equals the float32 surgery (1e-5); against full precision the
    tolerance is the quantization error of this random model (measured 0.09 for 8-bit, 0.66 for 4-bit
    at logit scale ~6), well below the correction itself (~5.6)."""
    from transformers import BitsAndBytesConfig

    quantization = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8
                    else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    kwargs = dict(quantization_config=quantization, device_map="cpu")
    model = load(tiny["path"], trust_remote_code=True, **kwargs)
    quantized_layer = type(model.model.layers[0].mlp.down_proj).__name__
    assert quantized_layer == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    assert_darts_float32_unquantized(model)
    plain = load(tiny["path"], **kwargs)
    assert_corrected(model, tiny, atol_vs_full=0.3 if bits == 8 else 1.5, plain=plain)


def test_bitsandbytes_skip_modules_still_keep_darts(tiny):
    """A user's own llm_int8_skip_modules replaces transformers' default skips; darts stays out anyway."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
    model = load(tiny["path"], trust_remote_code=True, quantization_config=quantization, device_map="cpu")
    assert_darts_float32_unquantized(model)


# ------------------------------------------------------------------------------------------ offload

def test_device_map_auto_with_disk_offload(tiny, tmp_path):
    """max_memory fits about half the model: accelerate keeps the first blocks on cpu and sends the
    rest, darts (the last child) included, to disk; its weights sit on meta until its hooks load them."""
    from accelerate.utils import compute_module_sizes

    budget = compute_module_sizes(tiny["reference"])[""] // 2
    model = load(tiny["path"], trust_remote_code=True, device_map="auto", max_memory={"cpu": budget},
                 offload_folder=str(tmp_path / "offload"))
    placed = model.hf_device_map
    assert placed["darts"] == "disk" and "cpu" in placed.values(), placed
    assert model.darts["math"].down.weight.device.type == "meta"
    # same float32 math on the same device: only summation order could differ
    assert_corrected(model, tiny, atol_vs_full=1e-5)
    generated = model.generate(**tiny["batch"], max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    expected = tiny["reference"].generate(**tiny["batch"], max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(generated, expected)


def test_accelerate_cpu_offload(tiny):
    """accelerate.cpu_offload: every weight on meta, loaded from a cpu state dict by module hooks."""
    import accelerate

    model = load(tiny["path"], trust_remote_code=True)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.darts["math"].position_bias.device.type == "meta"
    assert model.darts["math"].head_up.weight.device.type == "meta"
    assert_corrected(model, tiny, atol_vs_full=1e-5)


# ----------------------------------------------------------------------------------------- autocast

def test_autocast_keeps_the_correction_float32(tiny):
    """Inside torch.autocast(cpu, bfloat16) the merged model runs in bf16 (tolerance 0.1 at logit scale
    ~6: measured 0.03) but the surgery computes in float32: its output equals the float32 surgery on
    the very same input (1e-6) and its linears return float32."""
    model = tiny["reference"]
    surgery = model.darts["math"]
    seen = {}
    handles = [
        surgery.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out)),
        surgery.down.register_forward_hook(lambda m, args, out: seen.update(down=out.dtype)),
        surgery.head_up.register_forward_hook(lambda m, args, out: seen.update(head=out.dtype)),
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(**tiny["batch"]).logits.float()
            uncorrected = logits_without_correction(model, tiny["batch"]).float()
    finally:
        for handle in handles:
            handle.remove()
    assert seen["down"] == torch.float32 and seen["head"] == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(seen["out"], surgery(*seen["args"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(got, tiny["full"], rtol=0, atol=0.1)
    assert (got - uncorrected).abs().max() > VISIBLE


# ----------------------------------------------------------------------------------------- replicas

def test_replica_applies_its_own_correction(tiny, monkeypatch):
    """torch.nn.parallel.replicate (what nn.DataParallel runs) copies every module and shares the hook
    tables. replicate() refuses CPU devices, so its device broadcast is replaced by a CPU copy; the
    module copying, which is what hooks depend on, is torch's own."""
    import importlib

    replicate_module = importlib.import_module("torch.nn.parallel.replicate")
    monkeypatch.setattr(replicate_module, "_get_device_index", lambda device, optional=False: 0)
    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t.detach().clone() for t in tensors] for _ in devices])
    model = tiny["reference"]
    replica, other = replicate_module.replicate(model, ["cpu", "cpu"], detach=True)
    assert replica is not model and replica.darts["math"] is not model.darts["math"]
    with torch.no_grad():
        torch.testing.assert_close(replica(**tiny["batch"]).logits, tiny["full"], rtol=0, atol=1e-6)
        # the replica reads its own modules, not the original's: zeroing its copy makes it the plain model
        copy = other.darts["math"]  # replicas hold plain tensors, so plain assignment replaces them
        copy.up.weight = torch.zeros_like(copy.up.weight)
        copy.head_up.weight = torch.zeros_like(copy.head_up.weight)
        copy.position_bias = torch.zeros_like(copy.position_bias)
        uncorrected = logits_without_correction(model, tiny["batch"])
        torch.testing.assert_close(other(**tiny["batch"]).logits, uncorrected, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(**tiny["batch"]).logits, tiny["full"], rtol=0, atol=0)


def test_data_parallel_wrapper(tiny):
    """nn.DataParallel on a CPU-only machine calls the module itself: the correction must be applied."""
    wrapped = torch.nn.DataParallel(tiny["reference"])
    with torch.no_grad():
        torch.testing.assert_close(wrapped(**tiny["batch"]).logits, tiny["full"], rtol=0, atol=0)


# ---------------------------------------------------------------------------- missing darts tensors

def load_with_info(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True)


def test_missing_darts_tensors_warn_that_the_correction_is_identity(tiny, tmp_path, caplog):
    import shutil

    path = str(tmp_path / "stripped")
    shutil.copytree(tiny["path"], path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as handle:
        index = json.load(handle)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("darts.")}
    with open(index_path, "w") as handle:
        json.dump(index, handle)
    os.remove(os.path.join(path, "darts.safetensors"))
    with caplog.at_level(logging.WARNING):
        model = load(path, trust_remote_code=True)
    messages = [r.getMessage() for r in caplog.records if "darts.*" in r.getMessage()]
    assert len(messages) == 1 and "code, math" in messages[0] and "identity" in messages[0], messages
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model, info = load_with_info(tiny["path"])
    assert isinstance(info, dict) and not [k for k in info["missing_keys"] if k.startswith("darts.")]
    assert not [r for r in caplog.records if "darts.*" in r.getMessage()]
