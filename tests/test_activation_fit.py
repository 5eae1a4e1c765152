"""``extract_fit: activations``: the extract's SVD fitted to the outputs on the merge's own inputs
(repair/train/activation_fit.py; docs/quality.md, "Fitting the extract to the activations")."""

import pytest
import torch

from test_delta_init import _extract_lora, _run


def _anisotropic(n=400, width=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, width)  # inputs far from isotropic, as a model's are
    mixing = torch.linalg.qr(torch.randn(width, width, generator=generator))[0]
    return (torch.randn(n, width, generator=generator) * scales) @ mixing, generator


def test_weighted_factors_minimize_the_output_error():
    """On anisotropic inputs the weighted rank-2 factors are within the damping of the best rank-2 output
    correction (the truncated SVD of ΔW·L, G = L Lᵀ), and the plain extract is well above it."""
    from mergekit_darts.repair.train.activation_fit import weighted_low_rank_factors
    from mergekit_darts.repair.train.delta_init import low_rank_factors

    inputs, generator = _anisotropic()
    delta = torch.randn(12, 10, generator=generator)
    gram = inputs.T @ inputs / inputs.shape[0]

    def output_error(down, up):
        return float(((delta - up @ down) @ inputs.T).norm())

    singular = torch.linalg.svdvals(delta.double() @ torch.linalg.cholesky(gram.double()))
    best = float(singular[2:].square().sum().sqrt()) * inputs.shape[0] ** 0.5
    weighted = output_error(*weighted_low_rank_factors(delta, 2, gram))
    plain = output_error(*low_rank_factors(delta, 2))
    assert best <= weighted <= 1.02 * best
    assert plain > 1.5 * best


def test_isotropic_inputs_give_the_plain_extract():
    """With G = I the weighting changes nothing: the product is the plain truncated SVD's."""
    from mergekit_darts.repair.train.activation_fit import weighted_low_rank_factors
    from mergekit_darts.repair.train.delta_init import low_rank_factors

    delta = torch.randn(9, 7, generator=torch.Generator().manual_seed(1))
    down, up = weighted_low_rank_factors(delta, 3, torch.eye(7))
    plain_down, plain_up = low_rank_factors(delta, 3)
    torch.testing.assert_close(up @ down, plain_up @ plain_down, atol=1e-5, rtol=1e-4)


def test_grams_are_the_merges_inputs_at_unmasked_positions_of_the_given_rows(tiny_family):
    """Each adapted linear's Gram is Σ x xᵀ / n over the unmasked positions of the given rows only, as the
    linear reads them in the frozen blocks (run one block at a time); garbage in padded positions changes
    nothing; siblings reading one tensor share one; the head's is the final states'."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.activation_fit import LayerInputs, head_whitening, whitening

    model = AutoModelForCausalLM.from_pretrained(tiny_family["merged"], torch_dtype=torch.float32)
    tail = FrozenTail.from_model(model, 2)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(5, 6, model.config.hidden_size, generator=generator)
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    positions = torch.arange(6).expand(5, 6)
    rows = torch.tensor([0, 1, 3])

    seen = {}
    for path in ("mlp.down_proj", "self_attn.o_proj"):
        tail.layers[1].get_submodule(path).register_forward_pre_hook(
            lambda module, args, path=path: seen.setdefault(path, args[0].detach()))
    with torch.no_grad():
        tail.blocks(inputs[rows], positions[rows])
    for layer in tail.layers:
        for module in layer.modules():
            module._forward_pre_hooks.clear()
    valid = mask[rows].reshape(-1).bool()

    def gram_of(x):
        x = x.reshape(-1, x.shape[-1])[valid].double()
        return x.T @ x / int(valid.sum())

    layers = LayerInputs(tail, inputs, positions, mask, rows, 2, torch.device("cpu"))
    assert layers.positions == 6 + 4 + 2
    first = tail.first
    layers((first, "self_attn.q_proj"))
    assert layers.layer == first
    assert layers.grams[(first, "self_attn.q_proj")] is layers.grams[(first, "self_attn.v_proj")]
    assert layers.grams[(first, "mlp.gate_proj")] is layers.grams[(first, "mlp.up_proj")]
    assert layers.grams[(first, "self_attn.q_proj")] is not layers.grams[(first, "self_attn.o_proj")]
    white = layers((first + 1, "mlp.down_proj"))
    for path in ("mlp.down_proj", "self_attn.o_proj"):
        torch.testing.assert_close(layers.grams[(first + 1, path)], gram_of(seen[path]), rtol=1e-5, atol=1e-6)
    expected = whitening(gram_of(seen["mlp.down_proj"]))
    torch.testing.assert_close(white.factor, expected.factor, rtol=1e-4, atol=1e-6)
    assert white.scale == pytest.approx(float(torch.linalg.matrix_norm(expected.factor, ord=2)), rel=1e-3)
    with pytest.raises(ValueError, match="layer"):
        layers((first, "self_attn.q_proj"))  # the blocks ran past it

    padded = inputs.clone()
    padded[1, 4:] = 1e3  # right padding: no unmasked position attends to it
    again = LayerInputs(tail, padded, positions, mask, rows, 2, torch.device("cpu"))
    again((first + 1, "mlp.down_proj"))
    for key, gram in layers.grams.items():
        torch.testing.assert_close(again.grams[key], gram, rtol=1e-5, atol=1e-6)

    final = torch.randn(5, 6, model.config.hidden_size, generator=generator)
    states = final[rows].reshape(-1, final.shape[-1])[valid].double()
    torch.testing.assert_close(head_whitening(final, mask, rows).factor,
                               whitening(states.T @ states / int(valid.sum())).factor, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def activation_extract(tiny_family, tmp_path_factory):
    return _run(tiny_family, tmp_path_factory.mktemp("activations"), steps=0, adapter_init="delta", head_rank=2,
                content="linear", method="standard", extract_fit="activations")


def test_mergekit_yaml_with_extract_fit_activations(activation_extract, tiny_family, tmp_path):
    """Through a real run: the report says how the extract was fitted, the exported adapters are not the
    weights' truncated SVD (mergekit-extract-lora's), and the untrained extract still moves the held-out KL
    towards the expert's."""
    from safetensors.torch import load_file

    out, report = activation_extract
    assert report["surgery"]["extract_fit"] == "activations"
    card = open(f"{out}/README.md").read()
    assert "fitted to their outputs on the merge's inputs" in card  # not called mergekit-extract-lora's
    darts = load_file(f"{out}/darts.safetensors")
    for name, entry in report["domains"].items():
        baseline = entry["baseline"]
        assert baseline["fit"] == "activations" and baseline["rank"] == 2 and baseline["linears"] == 14
        assert entry["held_out_kl"]["after"] < entry["held_out_kl"]["before"]
        lora = _extract_lora(tiny_family[name], tiny_family["merged"], str(tmp_path / name), rank=2)
        lora_a = lora["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].float()
        lora_b = lora["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].float()
        prefix = f"darts.{name}.blocks.0.mlp.down_proj."
        product = darts[prefix + "up.weight"] @ darts[prefix + "down.weight"]
        assert float((product - lora_b @ lora_a).norm()) > 1e-3 * float(product.norm())


def test_extract_fit_needs_the_delta_start(tiny_family, tmp_path):
    from mergekit_darts.config import SurgeryConfigError
    from mergekit_darts.pipeline import parse_config_source
    from test_depth import depth_config

    config = depth_config(tiny_family, tmp_path / "cache", depth="all")
    with pytest.raises(SurgeryConfigError, match="extract_fit.*adapter_init: delta"):
        parse_config_source(config.replace("  domains:\n", "  extract_fit: activations\n  domains:\n"))
    with pytest.raises(SurgeryConfigError, match="extract_fit"):
        parse_config_source(config.replace("  domains:\n", "  adapter_init: delta\n  extract_fit: outputs\n  domains:\n"))
