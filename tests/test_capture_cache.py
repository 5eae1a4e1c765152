"""The capture cache by content and one capture context for every load (issue 24): reruns with depth
and router_eval load no model, hard-linked and copied merges share one capture, the generation
settings used are the ones keyed, a tampered entry is caught, and depth/router_eval honour device_map."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import QUICK_TEXTS, merge_yaml
from mergekit_darts.repair.capture.context import CaptureContext
from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains

ROUTER_EVAL = ["the weather is nice today", "tell me a story about a cat", "who wrote this book ?"]


def surgery_config(family, cache, extra=""):
    blocks = "".join(f"    {name}:\n      model: {family[name]}\n"
                     f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3, continue_tokens: 3}}\n"
                     for name in ("math", "code"))
    return merge_yaml(family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 15\n  lr: 0.01\n  device: cpu\n  dtype: float32\n"
        f"  loss: kl\n  depth: 1\n  depth_rank: 2\n  held_out: 0.34\n  cache_dir: {cache}\n"
        f"  router_eval: {{texts: {ROUTER_EVAL}}}\n" + extra + "  domains:\n" + blocks)


@pytest.fixture
def refuse_loads(monkeypatch):
    """Calling it makes every model load an error (configs, tokenizers and meta skeletons stay allowed)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError(f"a model was loaded: {args[:1]}")

    return lambda: monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def darts_tensors(out):
    with safe_open(os.path.join(out, "darts.safetensors"), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def test_second_run_with_depth_and_router_eval_loads_no_model(tiny_family, tmp_path, refuse_loads):
    from mergekit_darts.pipeline import run_surgery

    first_out, second_out = tmp_path / "first", tmp_path / "second"
    for out in (first_out, second_out):
        shutil.copytree(tiny_family["merged"], out)
    config = surgery_config(tiny_family, tmp_path / "cache")
    first = run_surgery(config, str(first_out), progress=False)
    assert first["router"]["out_of_domain"]["source"] == "router_eval"
    refuse_loads()
    second = run_surgery(config, str(second_out), progress=False)
    assert second["router"] == first["router"]
    for name in ("math", "code"):
        assert second["domains"][name]["held_out_kl"] == first["domains"][name]["held_out_kl"]
    one, two = darts_tensors(first_out), darts_tensors(second_out)
    assert one.keys() == two.keys() and any(".blocks." in key for key in one)
    assert all(torch.equal(one[key], two[key]) for key in one)


def capture(merged, cache, specs, depth=0, **kwargs):
    ctx = CaptureContext.open(merged, 32, device="cpu", dtype="float32", progress=False, batch_size=2,
                              cache_dir=str(cache), **kwargs)
    return capture_domains(ctx, specs, depth=depth)


def test_hard_linked_and_copied_merges_share_one_capture(tiny_family, tmp_path, refuse_loads):
    """Sweep cells are hard links of one merge; a moved or copied merge has the same content: none of
    them is captured again (the key has no path in it)."""
    from mergekit_darts.sweep.runner import link_tree

    specs = [DomainCaptureSpec("math", tiny_family["math"], QUICK_TEXTS["math"], continue_tokens=3)]
    cells = [tmp_path / "cell-a", tmp_path / "cell-b"]
    for cell in cells:
        link_tree(tiny_family["merged"], str(cell))
    weights = [f for f in os.listdir(cells[0]) if f.endswith(".safetensors")]
    assert os.stat(cells[0] / weights[0]).st_ino == os.stat(cells[1] / weights[0]).st_ino  # really linked
    first = capture(str(cells[0]), tmp_path / "cache", specs)
    copied = tmp_path / "copied"
    shutil.copytree(tiny_family["merged"], copied)  # new inodes, same bytes
    refuse_loads()
    for other in (cells[1], copied):
        again = capture(str(other), tmp_path / "cache", specs)
        assert torch.equal(again.domains["math"].merged_hidden, first.domains["math"].merged_hidden)
    hashes = json.loads((tmp_path / "cache" / "file_hashes.json").read_text())
    # the merge's weights hashed once for both links, once more for the copy (plus the expert's)
    assert len(hashes) == len(weights) * 2 + 1 and len(set(hashes.values())) == len(weights) + 1


def test_expert_generation_config_is_not_applied_and_what_is_used_is_keyed(tiny_family, tmp_path, refuse_loads,
                                                                          monkeypatch):
    """Continuations are plain greedy whatever the expert's generation_config.json says about sampling
    or penalties (so editing those changes nothing and needs no re-capture); editing what is used (its
    EOS ids) invalidates the continuation."""
    from transformers import AutoModelForCausalLM

    expert = tmp_path / "expert"
    shutil.copytree(tiny_family["math"], expert)
    spec = [DomainCaptureSpec("math", str(expert), QUICK_TEXTS["math"], continue_tokens=6)]
    captured = capture(tiny_family["merged"], tmp_path / "cache", spec).domains["math"]
    greedy = captured.input_ids
    prompt_length, length = int(captured.prompt_lengths[0]), int(captured.attention_mask[0].sum())
    assert length > prompt_length  # the first prompt was continued
    path = expert / "generation_config.json"
    settings = json.loads(path.read_text())
    settings.update(repetition_penalty=50.0, no_repeat_ngram_size=1, do_sample=True, top_k=1, temperature=0.1,
                    suppress_tokens=[int(greedy[0, prompt_length])])  # the greedy next token, banned
    path.write_text(json.dumps(settings))
    # the edit matters to transformers' own generate: it continues the first prompt differently
    model = AutoModelForCausalLM.from_pretrained(str(expert))
    own = model.generate(greedy[:1, :prompt_length], max_new_tokens=length - prompt_length, pad_token_id=0)
    assert own[0, prompt_length:length].tolist() != greedy[0, prompt_length:length].tolist()
    del model
    fresh = capture(tiny_family["merged"], tmp_path / "fresh", spec).domains["math"].input_ids
    assert torch.equal(fresh, greedy)  # a new capture ignores the edited sampling / penalty settings
    monkeypatch.undo()
    refuse_loads()
    assert torch.equal(capture(tiny_family["merged"], tmp_path / "cache", spec).domains["math"].input_ids, greedy)
    monkeypatch.undo()
    settings["eos_token_id"] = [settings.get("eos_token_id", 2), 7]  # a setting that is used: stop at 7 too
    path.write_text(json.dumps(settings))
    loads = []
    original = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a[0]) or original(cls, *a, **k)))
    capture(tiny_family["merged"], tmp_path / "cache", spec)
    assert os.path.realpath(expert) in [os.path.realpath(p) for p in loads]  # the expert continues again


def test_an_expert_edited_in_place_with_its_times_restored_is_captured_again(tiny_family, tmp_path):
    """Same size, same inode, mtime set back (what ``touch -d`` / ``rsync -t --inplace`` do): the
    weights' hash memo must not serve the old expert's states (issue 34: it was keyed on mtime only)."""
    expert = tmp_path / "expert"
    shutil.copytree(tiny_family["math"], expert)
    spec = [DomainCaptureSpec("math", str(expert), QUICK_TEXTS["math"])]
    first = capture(tiny_family["merged"], tmp_path / "cache", spec).domains["math"].expert_hidden
    weights = expert / "model.safetensors"
    before = os.stat(weights)
    with safe_open(str(weights), "pt") as handle:
        metadata, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] * 2
    save_file(tensors, str(tmp_path / "edited.safetensors"), metadata=metadata)
    edited = (tmp_path / "edited.safetensors").read_bytes()
    assert len(edited) == before.st_size
    with open(weights, "r+b") as handle:  # in place: same inode
        handle.write(edited)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(weights)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    again = capture(tiny_family["merged"], tmp_path / "cache", spec).domains["math"].expert_hidden
    fresh = capture(tiny_family["merged"], tmp_path / "fresh", spec).domains["math"].expert_hidden
    assert not torch.equal(again, first) and torch.equal(again, fresh)


def test_tampered_cache_entry_with_finite_values_is_recaptured(tiny_family, tmp_path, caplog):
    spec = [DomainCaptureSpec("math", tiny_family["math"], QUICK_TEXTS["math"])]
    first = capture(tiny_family["merged"], tmp_path / "cache", spec)
    entry = next((tmp_path / "cache").glob("expert.math.*.safetensors"))
    with safe_open(str(entry), "pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    hidden = tensors["hidden"].reshape(-1)
    hidden[torch.nonzero(hidden)[:122, 0]] *= 1000  # 122 values, still finite, same shape and dtype
    save_file(tensors, str(entry), metadata=metadata)
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture"):
        again = capture(tiny_family["merged"], tmp_path / "cache", spec)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("mergekit_darts")]
    assert len(warnings) == 1 and "checksum" in warnings[0] and str(entry) in warnings[0]
    assert torch.equal(again.domains["math"].expert_hidden, first.domains["math"].expert_hidden)


def test_depth_and_router_eval_honour_device_map(tiny_family, tmp_path, caplog):
    """cpu+disk offload of every load (domains, router_eval, depth's tail) gives the single-device run."""
    from mergekit_darts.pipeline import run_surgery

    half = sum(os.path.getsize(os.path.join(tiny_family["merged"], f)) for f in os.listdir(tiny_family["merged"])
               if f.endswith(".safetensors")) // 2
    outs = {}
    for label, extra in (("plain", ""), ("offload", f"  device_map: auto\n  max_memory: {{cpu: {half}}}\n")):
        outs[label] = tmp_path / label
        shutil.copytree(tiny_family["merged"], outs[label])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mergekit_darts.repair.capture.models"):
            report = run_surgery(surgery_config(tiny_family, tmp_path / f"cache-{label}", extra), str(outs[label]),
                                 progress=False)
        placed = [r.getMessage() for r in caplog.records if "placed as" in r.getMessage()]
        # merged (domains + tail), the two experts, merged again for router_eval: all through the map
        assert len(placed) == (4 if label == "offload" else 0)
        assert all("'disk'" in message for message in placed)
        outs[label + "_report"] = report
    plain, offload = darts_tensors(outs["plain"]), darts_tensors(outs["offload"])
    assert plain.keys() == offload.keys()
    for key in plain:
        torch.testing.assert_close(offload[key], plain[key], atol=1e-5, rtol=1e-4)
    for name in ("math", "code"):
        torch.testing.assert_close(outs["offload_report"]["domains"][name]["held_out_kl"]["after"],
                                   outs["plain_report"]["domains"][name]["held_out_kl"]["after"], rtol=1e-4, atol=1e-6)
    assert outs["offload_report"]["router"]["confusion"] == outs["plain_report"]["router"]["confusion"]
    assert (outs["offload_report"]["router"]["out_of_domain"]["none_share"]
            == outs["plain_report"]["router"]["out_of_domain"]["none_share"])
