"""``depth: k``: adapters inside the last decoder blocks, trained from cached block inputs and applied
by the emitted model per row, with routing from the first adapted block (docs/quality.md)."""

import shutil

import pytest
import torch

from helpers import QUICK_TEXTS, merge_yaml

DEPTH_SURGERY = ("surgery:\n  rank: 2\n  max_positions: 16\n  steps: {steps}\n  lr: 0.01\n  device: cpu\n"
                 "  dtype: float32\n  loss: kl\n  depth: {depth}\n  depth_rank: 2\n  held_out: 0.34\n"
                 "  cache_dir: {cache}\n")


def depth_config(family, cache, depth=1, steps=20, extra=""):
    blocks = "".join(f"    {name}:\n      model: {family[name]}\n"
                     f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code"))
    return merge_yaml(family) + DEPTH_SURGERY.format(steps=steps, depth=depth, cache=cache) + extra + "  domains:\n" + blocks


@pytest.fixture(scope="module")
def depth_output(tiny_family, tmp_path_factory):
    """The tiny merge repaired with depth 1 (math and code, router on): (out dir, report)."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("depth")
    out = root / "out"
    shutil.copytree(tiny_family["merged"], out)
    report = run_surgery(depth_config(tiny_family, root / "cache"), str(out))
    return str(out), report


def test_block_adapters_start_as_identity_and_train_from_cached_inputs(tiny_family):
    """An untrained tail + surgery reproduces the merged final states; training moves the adapters."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.tail import TailSurgery, adapters_on
    from mergekit_darts.repair.train.loop import train_surgery

    model = AutoModelForCausalLM.from_pretrained(tiny_family["merged"], dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    seen = {}
    handle = model.model.layers[-2].register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state
    handle.remove()
    tail = FrozenTail.from_model(model, 2)
    shape = SurgeryShape("darts", rank=2, head_rank=0, max_positions=8, content="relu", depth=2, depth_rank=3)
    surgery = DomainSurgery.from_shape(shape, model.config.hidden_size, model.config.vocab_size, tail.targets)
    assert surgery.shape == shape and len(surgery.block_adapters()) == 2 * 7  # q k v o gate up down per block
    positions = torch.arange(7).expand(3, 7)
    module = TailSurgery(tail, surgery)
    with torch.no_grad():
        torch.testing.assert_close(module.final_states(seen["h"], positions), final, atol=1e-5, rtol=1e-5)
    assert set(module.state_dict()) == {f"surgery.{k}" for k in surgery.state_dict()}  # the tail is not saved
    target = final + 0.5 * torch.randn_like(final)
    train_surgery(module, seen["h"], target, torch.ones(3, 7, dtype=torch.bool), positions, loss="mse", steps=30, lr=0.01)
    moved = [float(adapter.up.weight.detach().abs().max()) for _, _, adapter in surgery.block_adapters()]
    assert all(value > 0 for value in moved)
    with torch.no_grad(), adapters_on(tail, surgery):
        assert not torch.allclose(tail(seen["h"], positions), final, atol=1e-4)


def test_pipeline_exports_depth_and_the_emitted_model_matches_training(depth_output):
    """The saved adapters load through the remote code and give exactly the trained computation."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.output import layout
    from mergekit_darts.output.export import read_darts_info

    out, report = depth_output
    meta = layout.read_darts_entry(out)
    assert meta["depth"] == 1 and meta["depth_rank"] == 2 and meta["format_version"] == 3
    assert meta["router"]["states"] == report["router"]["states"] == "final"  # the default: a plain pass
    assert report["surgery"]["depth"] == 1
    for name in ("math", "code"):
        kl = report["domains"][name]["held_out_kl"]
        assert kl["after"] < kl["before"], (name, kl)
    header = layout.safetensors_header(f"{out}/{layout.DARTS_SHARD}")
    assert "darts.math.blocks.1.self_attn.q_proj.down.weight" in header
    assert "darts.code.blocks.1.mlp.down_proj.up.weight" in header
    # Llama's linears have no bias: neither do their adapters
    assert not [key for key in header if ".blocks." in key and key.endswith(".bias")]
    assert read_darts_info(out)["depth"] == 1
    card = open(f"{out}/README.md").read()
    assert "rank-2 adapters on every linear of the last 1 decoder block(s)" in card
    assert "from the merged model's own final hidden states, without the correction" in card

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        corrected = model(ids, darts_domain="math").logits
        plain = model(ids, darts_domain="none").logits
        # the same computation by hand: block 1's linears + adapters, final norm, surgery, head
        surgery = model.darts["math"]
        handles = [model.model.layers[i].get_submodule(p).register_forward_hook(
            lambda m, a, o, ad=ad: o + ad(a[0])) for i, p, ad in surgery.block_adapters()]
        final = model.model(input_ids=ids).last_hidden_state
        for handle in handles:
            handle.remove()
        by_hand = model.lm_head(surgery(final, torch.arange(6).expand(2, 6)))
    torch.testing.assert_close(corrected, by_hand, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(corrected, plain, atol=1e-4)
    # loading twice hooks each linear once (the hooks are installed at the first forward)
    with torch.no_grad():
        again = model(ids, darts_domain="math").logits
    torch.testing.assert_close(again, corrected)
    hooked = model.model.layers[1].self_attn.q_proj
    assert len(hooked._forward_hooks) == 1


def test_depth_mixed_rows_cache_and_auto_routing(depth_output):
    """Per-row domains, the KV cache and "auto" (routed from block 1's input) with block adapters."""
    from transformers import AutoModelForCausalLM

    out, _ = depth_output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (3, 5))
    rows = ["math", "none", "code"]
    with torch.no_grad():
        mixed = model(ids, darts_domain=rows).logits
        for i, name in enumerate(rows):
            torch.testing.assert_close(mixed[i], model(ids[i:i + 1], darts_domain=name).logits[0], atol=1e-5, rtol=1e-5)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, darts_domain=rows)
        no_cache = model.generate(ids, max_new_tokens=4, do_sample=False, darts_domain=rows, use_cache=False)
    assert torch.equal(generated, no_cache)
    # A router that tells the two routing points apart: "math"'s centroid is the prompt's pooled state at
    # the first adapted block's input, "code"'s its pooled final-norm state of the plain model. The
    # default router (states "final", what the pipeline trains) reads the latter through a plain pass
    # and picks code; a "block_input" router reads the corrected forward's block input and picks math.
    from mergekit_darts.remote_code.routing import pool_prompt_states

    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    seen = {}
    handle = model.model.layers[1].register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        final = model.model(input_ids=prompt).last_hidden_state
    handle.remove()
    at_block, at_norm = pool_prompt_states(seen["h"])[0], pool_prompt_states(final)[0]
    assert float(at_block @ at_norm) < 0.99
    router = model.darts.router
    assert router.states == "final"
    order = [router.domains.index("math"), router.domains.index("code")]
    with torch.no_grad():
        for index, centroid in zip(order, (at_block, at_norm)):
            router.weight[index] = router.centroids[index] = centroid
        router.bias.zero_()
        router.similarity_mean.fill_(1.0)
        router.similarity_std.fill_(1.0)
    for states, picked, other in (("final", "code", "math"), ("block_input", "math", "code")):
        router.states = states
        assert model.route_domains(prompt) == [picked], states
        with torch.no_grad():
            auto = model(prompt, darts_domain="auto").logits
            generated = model.generate(prompt, max_new_tokens=3, do_sample=False, darts_domain="auto")
            torch.testing.assert_close(auto, model(prompt, darts_domain=picked).logits)
            assert not torch.allclose(auto, model(prompt, darts_domain=other).logits, atol=1e-4)
            assert torch.equal(generated, model.generate(prompt, max_new_tokens=3, do_sample=False,
                                                         darts_domain=picked)), states


def test_depth_bake_refuses_and_config_checks(depth_output, tiny_family, tmp_path):
    from mergekit_darts.config import SurgeryConfigError, parse_surgery_block
    from mergekit_darts.errors import FoldError
    from mergekit_darts.output.bake import bake
    from mergekit_darts.pipeline import run_surgery

    out, _ = depth_output
    with pytest.raises(FoldError, match="depth"):
        bake(out, "math", str(tmp_path / "baked"))
    assert not (tmp_path / "baked").exists()
    domains = {"math": {"model": "m", "calibration": {"texts": ["a"]}}}
    assert parse_surgery_block({"depth": 1, "device_map": "auto", "domains": domains}).depth == 1  # sharded capture
    with pytest.raises(SurgeryConfigError, match="depth"):
        parse_surgery_block({"depth": -1, "domains": domains})
    two = {**domains, "code": {"model": "c", "calibration": {"texts": ["b"]}}}
    assert parse_surgery_block({"depth": 1, "router_states": "block_input", "domains": two}).router_states == "block_input"
    with pytest.raises(SurgeryConfigError, match="router_states together with depth: router_states: block_input"):
        parse_surgery_block({"router_states": "block_input", "domains": two})
    with pytest.raises(SurgeryConfigError, match="router_states together with router"):
        parse_surgery_block({"depth": 1, "router_states": "final", "domains": domains})
    with pytest.raises(SurgeryConfigError, match="router_states"):
        parse_surgery_block({"depth": 1, "router_states": "embeddings", "domains": two})
    merged = tmp_path / "merged"
    shutil.copytree(tiny_family["merged"], merged)
    before = sorted(p.name for p in merged.iterdir())
    with pytest.raises(SurgeryConfigError, match="surgery.depth: 9 exceeds .* 2 decoder layers"):
        run_surgery(depth_config(tiny_family, tmp_path / "cache", depth=9, steps=1), str(merged))
    assert sorted(p.name for p in merged.iterdir()) == before


def test_export_peft_carries_block_adapters(tiny_family, tmp_path):
    """A depth output with a foldable final correction becomes one PEFT adapter per domain: lm_head
    plus every block linear, giving the remote-code model's logits on the plain merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.output.peft_export import export_peft
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    run_surgery(depth_config(tiny_family, tmp_path / "cache", steps=10,
                             extra="  content: linear\n  method: standard\n  head_rank: 2\n"), str(out))
    summary = export_peft(str(out), str(tmp_path / "adapters"))
    assert summary["math"]["block_modules"] == 7 and summary["math"]["rank"] == 2 + 2
    assert not summary["math"]["lora_bias"]  # no lora_bias key, no lora_B.bias: as before adapters had biases
    assert "lora_bias" not in (tmp_path / "adapters" / "math" / "adapter_config.json").read_text()
    remote = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, darts_domain="math").eval()
    plain = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(4, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = logits_of(plain, ids)
    model = PeftModel.from_pretrained(plain, str(tmp_path / "adapters" / "math"))
    assert_same_logits(logits_of(model, ids), logits_of(remote, ids))
    assert not torch.allclose(logits_of(model, ids), before, atol=1e-4)


def _by_hand(model, ids, domain):
    """Logits of ``domain`` computed outside the remote code's hooks: the block adapters hooked on
    by hand, then the final-state surgery and the head (head_rank is 0 here)."""
    surgery = model.darts[domain]
    handles = [model.model.layers[i].get_submodule(p).register_forward_hook(
        lambda m, a, o, ad=ad: o + ad(a[0]).to(o.dtype)) for i, p, ad in surgery.block_adapters()]
    try:
        with torch.no_grad():
            final = model.model(input_ids=ids).last_hidden_state
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return model.lm_head(surgery(final, positions).to(model.lm_head.weight.dtype)).float()
    finally:
        for handle in handles:
            handle.remove()


def test_depth_under_bitsandbytes_8bit(depth_output):
    """Quantizers replace the linears after the model is built: the adapters must still act, in
    float32, on the quantized linears (hooked at the first forward)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out, _ = depth_output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map="cpu",
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True)).eval()
    q_proj = model.model.layers[1].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear8bitLt"
    adapter = model.darts["math"].blocks["1"]["self_attn"]["q_proj"]
    assert adapter.down.weight.dtype == torch.float32 and type(adapter.down) is torch.nn.Linear
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids, darts_domain="math").logits.float()
        plain = model(ids, darts_domain="none").logits.float()
    assert len(q_proj._forward_hooks) == 1
    expected = _by_hand(model, ids, "math")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert (got - plain).abs().max() > 1e-3


def test_depth_from_several_threads(depth_output):
    """Concurrent calls with different domains each get their own block adapters."""
    from transformers import AutoModelForCausalLM

    from loading_helpers import run_concurrently

    out, _ = depth_output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    expected = {name: _by_hand(model, ids, name) for name in ("math", "code")}
    with torch.no_grad():
        expected["none"] = model(ids, darts_domain="none").logits

    def check(name):
        def run(step):
            got = model(ids, darts_domain=name).logits
            return [] if torch.allclose(got, expected[name], atol=1e-5, rtol=0) else [name]
        return run

    errors, mismatches = run_concurrently({name: check(name) for name in expected}, steps=8)
    assert not errors and not mismatches, (errors, mismatches)


def test_depth_replica_applies_its_own_adapters(depth_output, monkeypatch):
    """torch.nn.parallel.replicate (nn.DataParallel) copies the adapted layers (their class included) and
    the adapters: a replica whose math adapters and correction are zeroed runs math rows as the plain
    merge and leaves the code rows and the original model alone (device broadcast replaced by a CPU
    copy, as in test_loading_modes)."""
    import importlib

    from transformers import AutoModelForCausalLM

    replicate_module = importlib.import_module("torch.nn.parallel.replicate")
    monkeypatch.setattr(replicate_module, "_get_device_index", lambda device, optional=False: 0)
    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t.detach().clone() for t in tensors] for _ in devices])
    out, _ = depth_output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    rows = ["math", "code"]
    with torch.no_grad():
        expected, plain = model(ids, darts_domain=rows).logits, model(ids, darts_domain="none").logits
        replica = replicate_module.replicate(model, ["cpu"], detach=True)[0]
        torch.testing.assert_close(replica(ids, darts_domain=rows).logits, expected, rtol=0, atol=1e-6)
        math = replica.darts["math"]  # replicas hold plain tensors: assignment replaces them
        for _, _, adapter in math.block_adapters():
            adapter.up.weight = torch.zeros_like(adapter.up.weight)
        math.up.weight, math.position_bias = torch.zeros_like(math.up.weight), torch.zeros_like(math.position_bias)
        got = replica(ids, darts_domain=rows).logits
        torch.testing.assert_close(got[0], plain[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-6)
        assert torch.equal(model(ids, darts_domain=rows).logits, expected)
        assert (expected[0] - plain[0]).abs().max() > 1e-3


def test_depth_with_disk_offload(depth_output, tmp_path):
    """accelerate sends the adapters (and the blocks they act on) to disk: their weights sit on meta
    until the module hooks load them; the logits equal the in-memory model's."""
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    out, _ = depth_output
    reference = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    budget = compute_module_sizes(reference)[""] // 2
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                                 device_map="auto", max_memory={"cpu": budget},
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert model.hf_device_map["darts"] == "disk", model.hf_device_map
    assert model.darts["math"].blocks["1"]["mlp"]["up_proj"].down.weight.device.type == "meta"
    ids = torch.randint(3, reference.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(3))
    rows = ["code", "math", "none"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, darts_domain=rows).logits, reference(ids, darts_domain=rows).logits,
                                   atol=1e-5, rtol=0)


def _tiny_model(arch):
    """A 2-layer random model of each architecture the emitted classes support (in memory)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    extra = {"Mistral": {"sliding_window": 3}, "Qwen2": {"sliding_window": 3, "use_sliding_window": True,
                                                          "max_window_layers": 0},
             "Mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1}, "Gemma": {"head_dim": 8},
             "Qwen3": {"head_dim": 8}}.get(arch, {})
    config = getattr(transformers, f"{arch}Config")(**common, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(config).float().eval()


@pytest.mark.parametrize("arch", ["Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Gemma", "Phi3"])
def test_replaying_the_last_blocks_matches_every_architecture(arch):
    """FrozenTail (mask, rotary, sliding window) reproduces each architecture's own final states from
    the cached block input, and adapters move them; otherwise training would not see the model."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.tail import adapters_on

    model = _tiny_model(arch)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    for depth in (1, 2):
        seen = {}
        first = model.model.layers[2 - depth]
        handle = first.register_forward_pre_hook(
            lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        with torch.no_grad():
            final = model.model(input_ids=ids).last_hidden_state
        handle.remove()
        tail = FrozenTail.from_model(model, depth)
        positions = torch.arange(9).expand(2, 9)
        with torch.no_grad():
            torch.testing.assert_close(tail(seen["h"], positions), final, atol=1e-5, rtol=1e-5)
        shape = SurgeryShape("darts", rank=2, head_rank=0, max_positions=16, content="relu", depth=depth, depth_rank=2)
        surgery = DomainSurgery.from_shape(shape, 32, 64, tail.targets)
        assert all(len(linears) >= 2 for linears in tail.targets.values())  # attention projections at least
        with torch.no_grad():
            for _, _, adapter in surgery.block_adapters():
                adapter.up.weight.normal_(0, 0.5)
            with adapters_on(tail, surgery):
                assert not torch.allclose(tail(seen["h"], positions), final, atol=1e-3)


@pytest.mark.parametrize("arch", ["Mistral", "Mixtral", "Qwen2", "Phi3", "Gemma"])
def test_emitted_classes_apply_block_adapters(arch):
    """Each Darts class builds the adapters from its own blocks and applies them like the by-hand
    computation (per-row domains included). Adapters on linears with a bias (Qwen2's q/k/v) have one,
    added to their own domain's rows only."""
    from mergekit_darts.remote_code.modeling_darts import DARTS_CLASSES
    from mergekit_darts.remote_code.surgery import SurgeryShape

    plain = _tiny_model(arch)
    config = plain.config
    shape = SurgeryShape("darts", rank=2, head_rank=0, max_positions=16, content="relu", depth=1, depth_rank=2)
    config.darts = {**shape.to_meta(), "domains": {"math": "m", "code": "c"}, "loss": "kl"}
    model = DARTS_CLASSES[f"{arch}ForCausalLM"](config)
    model.load_state_dict(plain.state_dict(), strict=False)
    model.float().eval()
    torch.manual_seed(1)
    biased = {path for _, path, adapter in model.darts["math"].block_adapters() if adapter.up.bias is not None}
    assert biased == ({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} if arch == "Qwen2" else set())
    with torch.no_grad():
        for surgery in model.darts.values():
            for _, _, adapter in surgery.block_adapters():
                adapter.up.weight.normal_(0, 0.5)
                if adapter.up.bias is not None:
                    adapter.up.bias.normal_(0, 0.5)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mixed = model(ids, darts_domain=["code", "math"]).logits.float()
        none = model(ids, darts_domain="none").logits.float()
    torch.testing.assert_close(none, plain(ids).logits.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[0], _by_hand(model, ids[:1], "code")[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], _by_hand(model, ids[1:], "math")[0], atol=1e-5, rtol=0)
    assert (mixed - none).abs().max() > 1e-3


def test_depth_with_a_bfloat16_capture(tiny_family, tmp_path):
    """The merged model is loaded in the capture dtype (bf16 here, as on a GPU); the float32 tail still
    reproduces its final states within the low-precision tolerance, and training improves on them."""
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = depth_config(tiny_family, tmp_path / "cache", steps=10).replace("dtype: float32", "dtype: bfloat16")
    report = run_surgery(config, str(out))
    assert report["surgery"]["dtype"] == "bfloat16"
    for name in ("math", "code"):
        kl = report["domains"][name]["held_out_kl"]
        assert kl["after"] < kl["before"], (name, kl)


def test_moe_experts_and_router_are_left_alone_and_named():
    """Mixtral under transformers 5 keeps its experts as fused parameters and routes with its own
    module: depth adapts the attention linears only, names what it leaves alone, and never adapts a
    router even where it is an nn.Linear (which would change which experts run)."""
    from torch import nn

    from mergekit_darts.remote_code.blocks import block_linear_targets
    from mergekit_darts.repair.capture.block_inputs import FrozenTail

    tail = FrozenTail.from_model(_tiny_model("Mixtral"), 1)
    coverage = tail.coverage()
    assert coverage["adapted"] == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"} <= set(coverage["not_adapted"])

    class Block(nn.Module):  # a MoE block whose router is a plain nn.Linear (as in other MoE families)
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.mlp = nn.Module()
            self.mlp.gate = nn.Linear(4, 2)
            self.mlp.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    targets = block_linear_targets(nn.ModuleList([Block()]), 1)[0]
    assert "mlp.gate" not in targets and {"proj", "mlp.experts.0", "mlp.experts.1"} <= set(targets)
