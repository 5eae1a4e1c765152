"""Capture: final-norm states and entropies against plain forwards, padding, caching, memory, errors."""

import gc
import logging
import os
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts.repair.capture import context, models
from mergekit_darts.repair.capture.calibration import apply_chat_template
from mergekit_darts.repair.capture.context import CaptureContext
from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains
from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_expert, make_random_model

TEXTS = ["how many apples are left ?", "what is 2 + 3", "def sum ( list ) : return total", "print"]


def run(merged, specs, tmp_path, max_positions=64, **kwargs):
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    ctx = CaptureContext.open(merged, max_positions, device="cpu", dtype="float32", progress=False, **kwargs)
    return capture_domains(ctx, specs)


def plain_forward(path, ids):
    """hidden_states[-1] and naive full-softmax entropies of one unpadded sequence."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    p = torch.softmax(out.logits[0].double(), dim=-1)
    return out.hidden_states[-1][0], -(p * p.log()).sum(-1).float()


def greedy(path, ids, n, eos=2):
    """Naive greedy continuation: a full forward per token, stopping before EOS."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == eos:
            break
        ids.append(token)
    return ids


@pytest.fixture
def loads(monkeypatch):
    """Record every model load and check that no earlier model is still alive when the next loads."""
    original = AutoModelForCausalLM.from_pretrained
    record = {"paths": [], "live": []}

    def tracked(path, *args, **kwargs):
        alive = [p for p, ref in record["live"] if ref() is not None]
        assert not alive, f"loading {path} while {alive} is still in memory"
        model = original(path, *args, **kwargs)
        record["paths"].append(os.path.basename(path))
        record["live"].append((os.path.basename(path), weakref.ref(model)))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", tracked)
    return record


def test_states_and_entropies_match_plain_forward(tiny_family, tmp_path):
    result = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], TEXTS)], tmp_path)
    domain = result.domains["math"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["merged"])
    lengths = domain.attention_mask.sum(1).tolist()
    assert domain.input_ids.shape == (len(TEXTS), max(lengths)) and domain.truncated == domain.skipped == 0
    assert torch.equal(domain.position_ids[0], torch.arange(max(lengths)))
    for i, text in enumerate(TEXTS):
        ids = tokenizer(text)["input_ids"]
        assert domain.input_ids[i, :lengths[i]].tolist() == ids
        merged, _ = plain_forward(tiny_family["merged"], ids)
        expert, entropy = plain_forward(tiny_family["math"], ids)
        torch.testing.assert_close(domain.merged_hidden[i, :lengths[i]], merged, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(domain.expert_hidden[i, :lengths[i]], expert, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(domain.expert_entropy[i, :lengths[i]], entropy, atol=1e-4, rtol=1e-4)
        assert not domain.expert_hidden[i, lengths[i]:].any()  # padding stays zero
    heads = [AutoModelForCausalLM.from_pretrained(p).lm_head.weight for p in (tiny_family["math"], tiny_family["merged"])]
    assert torch.equal(domain.expert_head, heads[0]) and torch.equal(result.merged_head, heads[1])
    assert not torch.equal(domain.expert_hidden, domain.merged_hidden)  # the merge did move the states


def test_padded_batch_equals_text_alone(tiny_family, tmp_path):
    alone = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], [TEXTS[1]])], tmp_path)
    batch = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], TEXTS)], tmp_path, batch_size=4)
    a, b = alone.domains["math"], batch.domains["math"]
    n = int(a.attention_mask.sum())
    for name in ("merged_hidden", "expert_hidden", "expert_entropy"):
        torch.testing.assert_close(getattr(b, name)[1, :n], getattr(a, name)[0, :n], atol=1e-5, rtol=1e-4)


def test_second_capture_hits_cache_without_loading(tiny_family, tmp_path, monkeypatch, loads):
    specs = [DomainCaptureSpec("math", tiny_family["math"], TEXTS), DomainCaptureSpec("code", tiny_family["code"], TEXTS[:2])]
    first = run(tiny_family["merged"], specs, tmp_path)
    assert sorted(loads["paths"]) == ["code", "math", "merged"]  # each model exactly once

    def refuse(*args, **kwargs):
        raise AssertionError("a cached capture must not load a model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    second = run(tiny_family["merged"], specs, tmp_path)
    for name in ("math", "code"):
        for field in ("input_ids", "merged_hidden", "expert_hidden", "expert_entropy", "expert_head"):
            assert torch.equal(getattr(first.domains[name], field), getattr(second.domains[name], field))
    assert torch.equal(first.merged_head, second.merged_head)
    assert not [f for f in os.listdir(tmp_path / "cache") if f.startswith(".tmp")]  # no leftover temp files


@pytest.mark.parametrize("damage", ["garbage", "wrong_shape"])
def test_corrupt_cache_entry_is_recomputed(tiny_family, tmp_path, loads, caplog, damage):
    from safetensors.torch import save_file

    specs = [DomainCaptureSpec("math", tiny_family["math"], TEXTS)]
    first = run(tiny_family["merged"], specs, tmp_path)
    cache = tmp_path / "cache"
    entry = next(cache / f for f in os.listdir(cache) if f.startswith("merged.math."))
    if damage == "garbage":
        entry.write_bytes(b"not a safetensors file")
    else:  # a readable file with the right key but a truncated tensor
        key = entry.name.split(".")[2]
        save_file({"hidden": torch.zeros(1, 2, 32)}, str(entry), metadata={"key": key})
    loads["paths"].clear()
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture"):
        second = run(tiny_family["merged"], specs, tmp_path)
    assert "corrupt entry" in caplog.text and loads["paths"] == ["merged"]  # only the damaged entry's model
    torch.testing.assert_close(second.domains["math"].merged_hidden, first.domains["math"].merged_hidden)
    loads["paths"].clear()
    run(tiny_family["merged"], specs, tmp_path)  # the rewritten entry is trusted again
    assert loads["paths"] == []


def test_continue_tokens_extend_with_expert_greedy_tokens(tiny_family, tmp_path, loads):
    specs = [DomainCaptureSpec("math", tiny_family["math"], TEXTS, continue_tokens=3),
             DomainCaptureSpec("code", tiny_family["code"], TEXTS[:2])]
    result = run(tiny_family["merged"], specs, tmp_path, batch_size=3)
    assert loads["paths"] == ["math", "code", "merged"]  # experts generate first, one model at a time
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["merged"])
    domain = result.domains["math"]
    for i, text in enumerate(TEXTS):
        ids = domain.input_ids[i, : int(domain.attention_mask[i].sum())].tolist()
        assert ids == greedy(tiny_family["math"], tokenizer(text)["input_ids"], 3)
        merged, _ = plain_forward(tiny_family["merged"], ids)  # merged captured on the continued ids
        torch.testing.assert_close(domain.merged_hidden[i, :len(ids)], merged, atol=1e-5, rtol=1e-4)
    assert domain.attention_mask.sum() > sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    code = result.domains["code"]  # continue_tokens=0 keeps the prompt as is
    assert code.input_ids[0, : int(code.attention_mask[0].sum())].tolist() == tokenizer(TEXTS[0])["input_ids"]
    gc.collect()
    assert all(ref() is None for _, ref in loads["live"])  # nothing kept alive after capture


def test_continuation_respects_max_positions(tiny_family, tmp_path):
    result = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], TEXTS[:2], continue_tokens=8)],
                 tmp_path, max_positions=8)
    domain = result.domains["math"]
    assert domain.input_ids.shape[1] <= 8 and domain.truncated == 0


def test_truncation_and_empty_records_are_counted(tiny_family, tmp_path, caplog):
    texts = ["", "   ", " ".join(["apples"] * 20), "what is 2 + 3"]
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture"):
        result = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], texts)], tmp_path, max_positions=10)
    domain = result.domains["math"]
    assert (domain.skipped, domain.truncated) == (2, 1)
    assert domain.input_ids.shape == (2, 10) and domain.attention_mask[0].all()
    assert "skipped" in caplog.text and "truncated" in caplog.text


def test_chat_templated_texts_get_no_second_bos(tiny_family, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["merged"])
    texts = apply_chat_template(["what is 2 + 3"], tokenizer)
    result = run(tiny_family["merged"], [DomainCaptureSpec("math", tiny_family["math"], texts)], tmp_path)
    ids = result.domains["math"].input_ids[0].tolist()
    assert ids == tokenizer(texts[0], add_special_tokens=False)["input_ids"] and ids[:2].count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_architectures(arch, tmp_path):
    base, expert = str(tmp_path / "base"), str(tmp_path / "expert")
    make_random_model(base, arch=arch, seed=1)
    make_expert(base, expert, seed=2, scale=0.3)
    domain = run(base, [DomainCaptureSpec("d", expert, TEXTS[:2])], tmp_path).domains["d"]
    ids = domain.input_ids[0, : int(domain.attention_mask[0].sum())].tolist()
    for states, path in ((domain.merged_hidden, base), (domain.expert_hidden, expert)):
        torch.testing.assert_close(states[0, :len(ids)], plain_forward(path, ids)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("what,kwargs,sizes", [
    ("hidden size", {"hidden_size": 48}, ("48", "32")),
    ("vocabulary size", {"vocab_size": 300}, ("300",)),
])
def test_expert_size_mismatch(tiny_family, tmp_path, loads, what, kwargs, sizes):
    expert = str(tmp_path / "odd")
    make_random_model(expert, **kwargs)
    with pytest.raises(SurgeryConfigError) as info:
        run(tiny_family["merged"], [DomainCaptureSpec("math", expert, TEXTS)], tmp_path)
    message = str(info.value)
    assert what in message and expert in message and all(s in message for s in sizes)
    assert loads["paths"] == []  # checked before any model is loaded


def test_expert_tokenizer_mismatch(tiny_family, tmp_path):
    expert = str(tmp_path / "other_tok")
    make_random_model(expert, tokenizer=build_tokenizer(words=list(reversed(DEFAULT_WORDS))))
    with pytest.raises(SurgeryConfigError, match="tokenizer of expert .*other_tok.* encodes the calibration text"):
        run(tiny_family["merged"], [DomainCaptureSpec("math", expert, TEXTS)], tmp_path)


def test_model_without_final_norm_is_named():
    class Headless(torch.nn.Module):
        pass

    with pytest.raises(SurgeryConfigError, match="Headless: cannot find the final norm"):
        models.final_norm(Headless())


def test_resolve_device_and_dtype():
    assert context.resolve_device("cpu") == torch.device("cpu")
    assert context.resolve_dtype("auto", "cpu") == torch.float32
    assert context.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert context.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(SurgeryConfigError):
        context.resolve_dtype("int8", "cpu")


def test_bfloat16_capture_and_default_cache_dir(tiny_family, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the default cache dir is ~/.cache/mergekit_darts
    specs = [DomainCaptureSpec("math", tiny_family["math"], TEXTS[:2])]
    half = capture_domains(CaptureContext.open(tiny_family["merged"], 64, device="cpu", dtype="bfloat16",
                                               progress=False), specs)
    full = run(tiny_family["merged"], specs, tmp_path)
    assert os.listdir(tmp_path / ".cache" / "mergekit_darts")
    a, b = half.domains["math"], full.domains["math"]
    assert a.merged_hidden.dtype == a.expert_head.dtype == half.merged_head.dtype == torch.bfloat16
    assert a.expert_entropy.dtype == torch.float32
    torch.testing.assert_close(a.expert_hidden.float(), b.expert_hidden, atol=0.1, rtol=0.05)
