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
    linear reads them in the frozen blocks; garbage in padded positions changes nothing, and the head's
    is the final states'."""
    from transformers import AutoModelForCausalLM

    from mergekit_darts.repair.capture.block_inputs import FrozenTail
    from mergekit_darts.repair.train.activation_fit import activation_grams

    model = AutoModelForCausalLM.from_pretrained(tiny_family["merged"], torch_dtype=torch.float32)
    tail = FrozenTail.from_model(model, 2)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(5, 6, model.config.hidden_size, generator=generator)
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    positions = torch.arange(6).expand(5, 6)
    final = torch.randn(5, 6, model.config.hidden_size, generator=generator)
    rows = torch.tensor([0, 1, 3])

    seen = {}
    linear = tail.layers[1].get_submodule("mlp.down_proj")
    handle = linear.register_forward_pre_hook(lambda module, args: seen.setdefault("x", args[0].detach()))
    with torch.no_grad():
        tail.blocks(inputs[rows], positions[rows])
    handle.remove()
    valid = mask[rows].reshape(-1).bool()
    x = seen["x"].reshape(-1, seen["x"].shape[-1])[valid].double()
    grams, head, count = activation_grams(tail, inputs, final, positions, mask, rows, 2, torch.device("cpu"), head=True)
    assert count == int(valid.sum()) == 6 + 4 + 2
    torch.testing.assert_close(grams[(tail.first + 1, "mlp.down_proj")], x.T @ x / count, rtol=1e-5, atol=1e-6)
    states = final[rows].reshape(-1, final.shape[-1])[valid].double()
    torch.testing.assert_close(head, states.T @ states / count, rtol=1e-5, atol=1e-6)
    assert set(grams) == {(index, path) for index, paths in tail.targets.items() for path in paths}

    padded = inputs.clone()
    padded[1, 4:] = 1e3  # right padding: no unmasked position attends to it
    again, _, _ = activation_grams(tail, padded, final, positions, mask, rows, 2, torch.device("cpu"), head=False)
    for key, gram in grams.items():
        torch.testing.assert_close(again[key], gram, rtol=1e-5, atol=1e-6)
    # q/k/v read one tensor: one product shared, not three different ones
    torch.testing.assert_close(grams[(tail.first, "self_attn.q_proj")], grams[(tail.first, "self_attn.v_proj")])


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
