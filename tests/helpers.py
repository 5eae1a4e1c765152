"""Helpers shared by several test modules (fixtures live in conftest.py)."""

import os
import shutil


def merge_yaml(paths, domains=("math", "code"), dtype="float32"):
    lines = ["merge_method: task_arithmetic", f"base_model: {paths['base']}", "models:"]
    for domain in domains:
        lines += [f"  - model: {paths[domain]}", "    parameters: {weight: 0.5}"]
    lines.append(f"dtype: {dtype}")
    return "\n".join(lines) + "\n"


def merge_tiny(paths, out, domains=("math", "code")):
    """Merge with mergekit's own run_merge, the hook disabled (a plain merged directory)."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    text = merge_yaml(paths, domains)
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    if os.path.exists(out):
        shutil.rmtree(out)
    run_merge(config, out, options=MergeOptions(quiet=True), config_source=text)
    return out


QUICK_TEXTS = {"math": ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4"],
               "code": ["def sum list", "write code to reverse a list", "print the sum"]}


def quick_surgery_output(family, out, cache_dir, domains=("math",)):
    """Copy the tiny family's plain merge to ``out`` and run a real 2-step surgery (rank 2, three
    inline calibration texts per domain) on it: a small but complete repaired directory. Returns ``out``."""
    from mergekit_darts.pipeline import run_surgery

    shutil.copytree(family["merged"], out)
    blocks = "".join(f"    {name}:\n      model: {family[name]}\n"
                     f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in domains)
    cfg = merge_yaml(family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {cache_dir}\n  domains:\n" + blocks)
    run_surgery(cfg, str(out))
    return str(out)


def linear_surgery_output(merged_dir, out, domains=("math", "code"), method="standard", head_rank=2, rank=3,
                          max_positions=16, seed=0):
    """Copy ``merged_dir`` to ``out`` and export random linear-content modules into it (no training:
    every tensor is drawn large enough that a wrong fold shows in the logits). Returns ``out``."""
    import torch

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.output.layout import read_config
    from mergekit_darts.remote_code.surgery import DomainSurgery

    shutil.copytree(merged_dir, out)
    config = read_config(str(out))
    torch.manual_seed(seed)
    modules = {}
    for name in domains:
        module = DomainSurgery(config["hidden_size"], rank=rank, max_positions=max_positions, method=method,
                               head_rank=head_rank, vocab_size=config["vocab_size"], content="linear")
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0, 0.3)
        modules[name] = module
    export_surgery(str(out), modules, {name: f"experts/{name}" for name in domains}, domains[0], loss="kl")
    return str(out)


def logits_of(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def assert_same_logits(actual, expected, rel=1e-4):
    """The issue's bar: max |difference| <= rel * max |logit| (float32)."""
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel} * max |logit| {scale:.3g}"


def realistic_padding(path):
    """Make the model directory ``path`` pad the way Llama-style releases do: pad = eos (config,
    generation config, tokenizer) and the pad token's embedding row is a real, non-zero one (the tiny
    models' own <pad> row is zero: padding_idx), so states at padded positions are not zero and code
    that forgets the mask gives visibly wrong answers. Returns the pad (= eos) token id."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config_path = os.path.join(path, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    pad = config["pad_token_id"] = config["eos_token_id"]
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path) as handle:
            generation = json.load(handle)
        generation["pad_token_id"] = pad
        with open(generation_path, "w") as handle:
            json.dump(generation, handle, indent=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    weights = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(path, name)))
    row = weights["model.embed_tokens.weight"][pad]
    assert float(row.abs().max()) > 0.1 * float(weights["model.embed_tokens.weight"].abs().max()), "pad row is ~zero"
    return pad
