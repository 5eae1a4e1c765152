"""``depth``'s frozen blocks under bfloat16 autocast on a GPU, float32 on a CPU (issue 45 ask 7,
docs/scale.md): the decision, the unchanged CPU path, and the autocast path itself, run on the CPU with
``torch.autocast("cpu", dtype=torch.bfloat16)``."""

import pytest
import torch


def _model_and_block_input(depth=2):
    """A 2-layer random Llama (in memory), a batch of ids, the input of its last ``depth`` blocks and
    its final states."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = {}
    handle = model.model.layers[2 - depth].register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state
    handle.remove()
    return model, seen["h"], final, torch.arange(9).expand(2, 9)


def _tail_surgery(model, depth=2):
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.tail import TailSurgery

    tail = FrozenTail.from_model(model, depth)
    shape = SurgeryShape("darts", rank=2, head_rank=0, max_positions=16, content="relu", depth=depth, depth_rank=2)
    torch.manual_seed(1)
    surgery = DomainSurgery.from_shape(shape, 32, 64, tail.targets)
    with torch.no_grad():
        for _, _, adapter in surgery.block_adapters():
            adapter.up.weight.normal_(0, 0.1)  # a trained-looking start: the adapters change the states
    return tail, TailSurgery(tail, surgery)


def test_the_blocks_autocast_to_bfloat16_only_on_a_cuda_device_that_has_it():
    from mergekit_darts.repair.capture.block_inputs import tail_compute_dtype

    assert tail_compute_dtype(torch.device("cpu")) is None
    assert tail_compute_dtype("cpu", bf16_supported=lambda: True) is None
    assert tail_compute_dtype(torch.device("cuda"), bf16_supported=lambda: True) is torch.bfloat16
    assert tail_compute_dtype("cuda:1", bf16_supported=lambda: True) is torch.bfloat16
    assert tail_compute_dtype("cuda", bf16_supported=lambda: False) is None  # e.g. a V100: float32 as before


def test_the_cpu_path_is_float32_and_unchanged():
    """On a CPU the tail (no compute dtype) reproduces the float32 model exactly as before, and a training
    step's loss, states and gradients are float32 and identical to the same step with autocast forced off."""
    from mergekit_darts.repair.train.kl import kl_loss

    model, block_input, final, positions = _model_and_block_input()
    tail, module = _tail_surgery(model)
    assert tail.compute_dtype is None
    outputs = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: outputs.update(q=out.dtype))
             for layer in tail.layers]
    with torch.no_grad():
        torch.testing.assert_close(tail(block_input, positions), final, atol=1e-5, rtol=1e-5)
    for hook in hooks:
        hook.remove()
    assert outputs["q"] == torch.float32

    def step():
        module.zero_grad(set_to_none=True)
        corrected = module(block_input, positions)
        loss = kl_loss(corrected.reshape(-1, 32), final.reshape(-1, 32), model.lm_head.weight.detach(),
                       model.lm_head.weight.detach() * 1.1)
        loss.backward()
        return corrected.detach(), loss.detach(), [p.grad.clone() for p in module.parameters() if p.grad is not None]

    corrected, loss, grads = step()
    assert corrected.dtype == loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert any(bool(g.any()) for g in grads)  # the float32 path trains (the zero-start up factors get gradients)


def test_the_autocast_path_runs_the_blocks_in_bfloat16_and_trains_float32_adapters():
    """With ``compute_dtype`` bfloat16 (what a GPU gets) the frozen linears compute in bfloat16, the
    adapters in float32 on float32 parameters, the final states and the loss are float32, close to the
    float32 path but not equal to it (the autocast was taken), and training moves the adapters."""
    from mergekit_darts.repair.train.loop import train_surgery

    model, block_input, final, positions = _model_and_block_input()
    tail, module = _tail_surgery(model)
    with torch.no_grad():
        reference = module.final_states(block_input, positions)
    tail.compute_dtype = torch.bfloat16
    seen = {}
    layer = tail.layers[0]
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.update(frozen=out.dtype))]
    adapter = next(a for i, path, a in module.surgery.block_adapters() if path == "self_attn.q_proj")
    hooks.append(adapter.register_forward_hook(lambda m, a, out: seen.update(adapter=(a[0].dtype, out.dtype))))
    with torch.no_grad():
        states = module.final_states(block_input, positions)
    for hook in hooks:
        hook.remove()
    # the hook on q_proj sees the frozen output before the adapter's is added: bfloat16 under autocast
    assert seen == {"frozen": torch.bfloat16, "adapter": (torch.float32, torch.float32)}
    assert states.dtype == torch.float32
    error = float((states - reference).abs().mean() / reference.abs().mean())
    assert 0 < error < 2e-2, error
    before = [a.up.weight.detach().clone() for _, _, a in module.surgery.block_adapters()]
    target = reference + 0.3 * torch.randn_like(reference)
    history = train_surgery(module, block_input, target, torch.ones(2, 9, dtype=torch.bool), positions, loss="mse",
                            steps=5, lr=0.01)
    assert history[-1] < history[0] and all(torch.isfinite(torch.tensor(history)))
    after = [a.up.weight for _, _, a in module.surgery.block_adapters()]
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_the_replay_check_accepts_both_paths(compute_dtype):
    """The capture's replay check (a float32 capture) passes for the float32 tail and, within the
    low-precision tolerance, for the bfloat16-autocast tail a GPU runs."""
    from types import SimpleNamespace

    from mergekit_darts.repair.capture.block_inputs import FrozenTail, check_replay

    model, block_input, final, positions = _model_and_block_input()
    tail = FrozenTail.from_model(model, 2)
    tail.compute_dtype = compute_dtype
    data = SimpleNamespace(attention_mask=torch.ones(2, 9, dtype=torch.bool), block_inputs=block_input,
                           position_ids=positions, merged_hidden=final)
    check_replay("math", tail, data, batch_size=2, dtype=torch.float32)
