"""``adapter_init: delta``: block adapters and the head correction started from the truncated SVD of
(expert − merge), equal to what ``mergekit-extract-lora`` extracts, and the data-free extract as the
report's ``baseline`` (docs/quality.md, "Starting from the weight deltas")."""

import shutil

import pytest
import torch

from test_depth import depth_config


def _run(family, root, **keys):
    from mergekit_darts.pipeline import run_surgery

    out = root / "out"
    shutil.copytree(family["merged"], out)
    extra = "".join(f"  {key}: {value}\n" for key, value in keys.items() if key not in ("steps", "dtype"))
    config = depth_config(family, root / "cache", depth="all", steps=keys.get("steps", 20), extra=extra)
    report = run_surgery(config.replace("  dtype: float32\n", f"  dtype: {keys.get('dtype', 'float32')}\n"), str(out))
    return str(out), report


@pytest.fixture(scope="module")
def extract_output(tiny_family, tmp_path_factory):
    """The tiny merge with ``adapter_init: delta`` and ``steps: 0``: the data-free extract itself
    (linear content, no position table: a plain LoRA that ``export-peft`` writes as it is)."""
    return _run(tiny_family, tmp_path_factory.mktemp("extract"), steps=0, adapter_init="delta", head_rank=2,
                content="linear", method="standard")


def _extract_lora(expert, merged, out, rank):
    """The real ``mergekit-extract-lora`` (in process), the LM head decomposed too (``--embed-lora``)."""
    from click.testing import CliRunner
    from mergekit.scripts.extract_lora import main
    from safetensors.torch import load_file

    result = CliRunner().invoke(main, ["--model", expert, "--base-model", merged, "--out-path", out,
                                       "--max-rank", str(rank), "--embed-lora"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return load_file(f"{out}/adapter_model.safetensors")


def test_steps_0_equals_mergekit_extract_lora(extract_output, tiny_family, tmp_path):
    """Every block adapter's up·down and the head correction's H_u·H_d equal lora_B·lora_A of
    mergekit-extract-lora --model EXPERT --base-model MERGED at the same rank."""
    from safetensors.torch import load_file

    out, _ = extract_output
    darts = load_file(f"{out}/darts.safetensors")
    for domain in ("math", "code"):
        lora = _extract_lora(tiny_family[domain], tiny_family["merged"], str(tmp_path / domain), rank=2)
        # q k v o gate up down in each of the two blocks, and the head
        assert _assert_products_equal(darts, lora, domain) == 2 * 7 + 1


def _assert_products_equal(darts, lora, domain):
    """Every lora_B·lora_A of mergekit-extract-lora equals up·down of the same module; returns how many."""
    compared = 0
    for name, lora_a in lora.items():
        if ".lora_A.weight" not in name or "embed_tokens" in name:
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        expected = lora[name.replace("lora_A", "lora_B")].float() @ lora_a.float()
        if module == "lm_head":
            prefix = f"darts.{domain}.head_"
        else:
            layer, path = module.removeprefix("model.layers.").split(".", 1)
            prefix = f"darts.{domain}.blocks.{layer}.{path}."
        product = darts[prefix + "up.weight"] @ darts[prefix + "down.weight"]
        torch.testing.assert_close(product, expected, atol=1e-5, rtol=1e-4)
        compared += 1
    return compared


@pytest.fixture(scope="module")
def qwen2_family(tmp_path_factory):
    """A tiny Qwen2 family (q/k/v carry biases) whose experts also moved those biases, and its merge."""
    from safetensors.torch import load_file, save_file

    from helpers import merge_tiny
    from mergekit_darts.tiny import make_family

    root = tmp_path_factory.mktemp("qwen2")
    paths = make_family(str(root), arch="qwen2", domains=["math", "code"], seed=3)
    for seed, name in enumerate(("math", "code"), start=1):
        weights = f"{paths[name]}/model.safetensors"
        tensors = load_file(weights)
        generator = torch.Generator().manual_seed(seed)
        for key in [key for key in tensors if key.endswith(".bias")]:
            tensors[key] = tensors[key] + 0.1 * torch.randn(tensors[key].shape, generator=generator)
        save_file(tensors, weights, metadata={"format": "pt"})
    paths["merged"] = str(root / "merged")
    merge_tiny(paths, paths["merged"])
    return paths


@pytest.fixture(scope="module")
def qwen2_extract(qwen2_family, tmp_path_factory):
    """The tiny Qwen2 merge with ``adapter_init: delta``, ``steps: 0``, every block, captured in bfloat16:
    the extract with the q/k/v bias deltas (linear content, no position table: it bakes and exports)."""
    return _run(qwen2_family, tmp_path_factory.mktemp("qwen2_extract"), steps=0, adapter_init="delta", head_rank=2,
                content="linear", method="standard", dtype="bfloat16")


def test_qwen2_steps_0_equals_mergekit_extract_lora_with_the_bias_deltas(qwen2_extract, qwen2_family, tmp_path):
    """Qwen2, captured in bfloat16: the blocks and the head (read from the files in float32, not from
    the bfloat16 capture of the heads) equal mergekit-extract-lora's lora_B·lora_A, and the adapters on
    q/k/v carry the bias deltas the tool writes as lora_B.bias (``up.bias``); no other adapter has a bias."""
    from safetensors.torch import load_file

    out, report = qwen2_extract
    darts = load_file(f"{out}/darts.safetensors")
    for domain in ("math", "code"):
        lora = _extract_lora(qwen2_family[domain], qwen2_family["merged"], str(tmp_path / domain), rank=2)
        assert _assert_products_equal(darts, lora, domain) == 2 * 7 + 1
        biases = {name: tensor for name, tensor in lora.items() if name.endswith("lora_B.bias")}
        assert len(biases) == 2 * 3  # q, k, v of both blocks
        carried = {name for name in darts if name.startswith(f"darts.{domain}.blocks.") and name.endswith(".bias")}
        assert len(carried) == len(biases)
        for name, tensor in biases.items():
            layer, path = name.removeprefix("base_model.model.model.layers.").removesuffix(".lora_B.bias").split(".", 1)
            key = f"darts.{domain}.blocks.{layer}.{path}.up.bias"
            assert key in carried and bool(tensor.any())
            torch.testing.assert_close(darts[key], tensor.float(), atol=1e-6, rtol=1e-5)
        baseline = report["domains"][domain]["baseline"]
        assert baseline["bias_linears"] == 6 and "bias_deltas_not_carried" not in baseline
        assert baseline["parameters"] == sum(t.numel() for key, t in darts.items()
                                             if key.startswith((f"darts.{domain}.blocks.", f"darts.{domain}.head_")))


def _qwen2_ids(model):
    return torch.randint(4, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


def test_qwen2_output_with_biases_loads_and_an_older_one_without_them_too(qwen2_extract, tmp_path, caplog):
    """The emitted Qwen2 (depth: all) loads with trust_remote_code; its adapters' biases change the
    logits and a mixed-domain batch adds each domain's bias to its own rows only. A directory written
    before the adapters had biases (no up.bias tensors) loads without a word about missing tensors and
    computes what it always did: the same adapters with no bias."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from helpers import logits_of

    out, _ = qwen2_extract
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    adapter = model.darts["math"].blocks["1"]["self_attn"]["q_proj"]
    assert adapter.up.bias is not None and bool(adapter.up.bias.any())
    assert model.darts["math"].blocks["1"]["self_attn"]["o_proj"].up.bias is None
    ids = _qwen2_ids(model)
    per_domain = {name: logits_of_domain(model, ids, name) for name in ("math", "code", "none")}
    with torch.no_grad():
        mixed = model(input_ids=ids, darts_domain=["code", "math"]).logits.float()
    torch.testing.assert_close(mixed[0], per_domain["code"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], per_domain["math"][1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        mixed_plain = model(input_ids=ids, darts_domain=["math", "none"]).logits.float()
    torch.testing.assert_close(mixed_plain[1], per_domain["none"][1], atol=1e-5, rtol=1e-5)

    old = tmp_path / "old"
    shutil.copytree(out, old)
    tensors = load_file(f"{old}/darts.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(".up.bias")}, f"{old}/darts.safetensors",
              metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        legacy, info = AutoModelForCausalLM.from_pretrained(str(old), trust_remote_code=True, dtype=torch.float32,
                                                            output_loading_info=True)
    legacy.eval()
    assert not [key for key in info["missing_keys"] if key.startswith("darts.")]
    assert "darts.* tensors" not in caplog.text
    for _, _, block in legacy.darts["math"].block_adapters():
        assert block.up.bias is None or not bool(block.up.bias.any())
    with torch.no_grad():  # the same adapters without their biases: what the older directory meant
        for surgery in model.darts.values():
            for _, _, block in surgery.block_adapters():
                if block.up.bias is not None:
                    block.up.bias.zero_()
    for name in ("math", "code"):
        expected = logits_of_domain(model, ids, name)
        assert torch.equal(logits_of_domain(legacy, ids, name), expected)
        assert not torch.allclose(expected, per_domain[name], atol=1e-4)  # the biases mattered


def logits_of_domain(model, ids, domain):
    with torch.no_grad():
        return model(input_ids=ids, darts_domain=domain).logits.float()


def test_qwen2_extract_bakes_and_exports_with_its_biases(qwen2_extract, tmp_path):
    """bake folds the adapters' biases into q/k/v's biases; export-peft writes them as lora_B.bias with
    lora_bias: true, and PEFT's logits equal the remote-code model's (its merge_and_unload refuses a
    lora_bias target without a base bias, which the o_proj/MLP/lm_head targets are)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.output.bake import bake
    from mergekit_darts.output.peft_export import export_peft

    out, _ = qwen2_extract
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math",
                                                  dtype=torch.float32).eval()
    ids = _qwen2_ids(remote)
    expected = logits_of(remote, ids)
    bake(out, "math", str(tmp_path / "baked"))
    baked = AutoModelForCausalLM.from_pretrained(str(tmp_path / "baked"), dtype=torch.float32).eval()
    assert_same_logits(logits_of(baked, ids), expected)

    summary = export_peft(out, str(tmp_path / "adapters"))
    assert summary["math"]["lora_bias"] and summary["math"]["block_modules"] == 14
    folder = tmp_path / "adapters" / "math"
    assert json.loads((folder / "adapter_config.json").read_text())["lora_bias"] is True
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters" / "base-model"), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    assert_same_logits(logits_of(model, ids), expected)
    with pytest.raises(RuntimeError, match="lora_bias"):
        model.merge_and_unload()


def test_qwen2_adapters_export_without_their_biases_for_vllm_and_llama_cpp(qwen2_extract, tmp_path):
    """``--drop-lora-bias``: no lora_B.bias and lora_bias: false (vLLM and llama.cpp take no LoRA bias);
    PEFT's logits equal the remote-code model's with the adapters' biases zeroed, merge_and_unload works,
    the command prints the held-out KL the surgery measured without them; export-gguf refuses the biases
    naming the flag."""
    import json

    from click.testing import CliRunner
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.cli import main

    out, report = qwen2_extract
    kl = report["domains"]["math"]["held_out_kl"]
    assert kl["after_without_lora_bias"] > 0 and kl["after_without_lora_bias"] != kl["after"]
    result = CliRunner().invoke(main, ["export-peft", out, str(tmp_path / "adapters"), "--drop-lora-bias"])
    assert result.exit_code == 0, result.output
    assert (f"math: DROPPED the block adapters' biases (--drop-lora-bias); held-out KL to the expert "
            f"(darts_report.json, measured at training): plain merge {kl['before']:.4g}") in result.output
    folder = tmp_path / "adapters" / "math"
    assert not json.loads((folder / "adapter_config.json").read_text()).get("lora_bias")
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as handle:
        assert not [key for key in handle.keys() if key.endswith(".bias")]
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math",
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        zeroed = [p for name, p in remote.named_parameters() if ".blocks." in name and name.endswith("up.bias")]
        assert len(zeroed) == 2 * 2 * 3  # q/k/v of both blocks, both domains
        for param in zeroed:
            param.zero_()
    ids = _qwen2_ids(remote)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters" / "base-model"), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    assert_same_logits(logits_of(model, ids), logits_of(remote, ids))
    assert_same_logits(logits_of(model.merge_and_unload(), ids), logits_of(remote, ids))

    (tmp_path / "llama.cpp").mkdir()
    for name in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py"):
        (tmp_path / "llama.cpp" / name).write_text("raise SystemExit('not reached')\n")
    result = CliRunner().invoke(main, ["export-gguf", out, str(tmp_path / "gguf"), "--llama-cpp", str(tmp_path / "llama.cpp")])
    assert result.exit_code != 0 and "--drop-lora-bias" in result.output and not (tmp_path / "gguf").exists()


def test_qwen2_adapter_biases_train_from_zero(qwen2_family, tmp_path):
    """With the identity start the q/k/v adapters' biases start at zero and train like the factors
    (the run's darts_report.json counts them in the module's parameters); no other adapter has one."""
    from safetensors.torch import load_file

    out, report = _run(qwen2_family, tmp_path, steps=5, no_regret="false")
    darts = load_file(f"{out}/darts.safetensors")
    for domain in ("math", "code"):
        biases = {key: t for key, t in darts.items()
                  if key.startswith(f"darts.{domain}.blocks.") and key.endswith(".bias")}
        assert {key.rsplit(".", 3)[-3] for key in biases} == {"q_proj", "k_proj", "v_proj"} and len(biases) == 6
        assert all(bool(t.any()) for t in biases.values())
        assert report["domains"][domain]["parameters"] == sum(t.numel() for key, t in darts.items()
                                                              if key.startswith(f"darts.{domain}."))


def test_untrained_extract_is_the_reported_baseline(extract_output):
    """With steps 0 the exported module is the extract: its held-out figures are the baseline's."""
    from safetensors.torch import load_file

    out, report = extract_output
    darts = load_file(f"{out}/darts.safetensors")
    for name, entry in report["domains"].items():
        baseline = entry["baseline"]
        assert baseline["rank"] == 2 and baseline["linears"] == 14 and baseline["head_rank"] == 2
        # its size: the block adapters and the head correction as exported (the final-state part is identity)
        assert baseline["parameters"] == sum(t.numel() for key, t in darts.items()
                                             if key.startswith((f"darts.{name}.blocks.", f"darts.{name}.head_")))
        assert baseline["held_out_kl"]["after"] == pytest.approx(entry["held_out_kl"]["after"], rel=1e-5)
        assert baseline["held_out_kl"]["after"] != pytest.approx(baseline["held_out_kl"]["before"], rel=1e-3)


def test_zero_init_reports_the_extract_beside_the_trained_module(tiny_family, tmp_path):
    """The paper's identity start is untouched by the weights; the baseline still reads them (the
    tiny difference of 'after' is the float32 replay of the blocks)."""
    _, report = _run(tiny_family, tmp_path, steps=0, head_rank=2)
    for entry in report["domains"].values():
        assert entry["held_out_kl"]["after"] == pytest.approx(entry["held_out_kl"]["before"], rel=1e-4)
        assert entry["baseline"]["held_out_kl"]["after"] != pytest.approx(entry["held_out_kl"]["after"], rel=1e-2)


def test_mergekit_yaml_with_preset_best_trains_from_the_extract(extract_output, tiny_family, tmp_path):
    """The unchanged ``mergekit-yaml`` with ``preset: best`` (adapter_init: delta, every block): the
    report's baseline is the extract of the same merge, and training moved away from it. Math adds
    prompts the base writes (docs/quality.md's recipe): they only train, so its baseline is unchanged."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers import QUICK_TEXTS, merge_yaml

    written = {"math": f", synthesize: 2, synthesize_writer: {tiny_family['base']}", "code": ""}
    domains = "".join(f"    {name}:\n      model: {tiny_family[name]}\n"
                      f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3{written[name]}}}\n"
                      for name in ("math", "code"))
    config = tmp_path / "cfg.yml"
    config.write_text(merge_yaml(tiny_family) + "surgery:\n  preset: best\n  rank: 2\n  depth_rank: 2\n  head_rank: 2\n"
                      f"  max_positions: 16\n  steps: 5\n  lr: 0.01\n  device: cpu\n  held_out: 0.34\n"
                      f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n" + domains)
    out = tmp_path / "out"
    result = subprocess.run([str(Path(sys.executable).parent / "mergekit-yaml"), str(config), str(out)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data-free extract (rank 2 + head 2" in result.stderr
    trained = json.loads((out / "darts_report.json").read_text())
    assert trained["surgery"]["adapter_init"] == "delta" and trained["surgery"]["depth"] == 2
    synthesis = trained["domains"]["math"]["calibration"]["synthesis"]
    assert synthesis["kept"] > 0 and trained["domains"]["math"]["calibration"]["train"] == 2 + synthesis["kept"]
    for name, entry in extract_output[1]["domains"].items():
        # the same merge, so the same extract; the trained adapters moved away from it
        assert trained["domains"][name]["baseline"]["held_out_kl"]["after"] == pytest.approx(
            entry["baseline"]["held_out_kl"]["after"], rel=1e-5)
        assert trained["domains"][name]["held_out_kl"]["after"] != pytest.approx(entry["held_out_kl"]["after"], rel=1e-3)


def test_depth_0_has_no_extract_and_delta_needs_something_to_start(tiny_family, tmp_path):
    from mergekit_darts.config import SurgeryConfigError
    from mergekit_darts.pipeline import parse_config_source

    config = depth_config(tiny_family, tmp_path / "cache", depth=0).replace("  depth_rank: 2\n", "")
    with pytest.raises(SurgeryConfigError, match="adapter_init"):
        parse_config_source(config.replace("  domains:\n", "  adapter_init: delta\n  domains:\n"))
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    report = run_surgery(config.replace("  steps: 20\n", "  steps: 2\n"), str(out))
    assert "block adapters" in report["domains"]["math"]["baseline"]["not_measured"]


def test_randomized_svd_close_to_exact(monkeypatch):
    """Above EXACT_SVD_MAX (on a CPU) the SVD is randomized; on a decaying spectrum it is close."""
    from mergekit_darts.repair.train import delta_init

    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(300, 40, generator=generator), torch.randn(40, 200, generator=generator)
    matrix = left @ torch.diag(0.7 ** torch.arange(40.0)) @ right
    exact_down, exact_up = delta_init.low_rank_factors(matrix, 8)
    monkeypatch.setattr(delta_init, "EXACT_SVD_MAX", 16)
    down, up = delta_init.low_rank_factors(matrix, 8)
    exact = exact_up @ exact_down
    assert float((up @ down - exact).norm() / exact.norm()) < 1e-3
    short_down, short_up = delta_init.low_rank_factors(torch.ones(3, 5), 4)  # rank past the matrix's own
    assert short_down.shape == (4, 5) and short_up.shape == (3, 4)
    torch.testing.assert_close(short_up @ short_down, torch.ones(3, 5))


def test_report_card_and_console_show_the_extract_beside_the_trained(extract_output):
    from mergekit_darts.pipeline import summary_lines
    from mergekit_darts.repair.report.table import render_report

    out, report = extract_output
    gap = f"{100 * report['domains']['math']['baseline']['held_out_kl']['gap_closed']:.1f}%"
    table = render_report(out, plot=False)
    assert "data-free extract" in table and gap in table
    card = open(f"{out}/README.md", encoding="utf-8").read()
    assert "against the data-free extract it started from" in card and f"| {gap} / {gap} |" in card  # steps 0: trained = extract
    assert any(line.startswith("  data-free extract (rank 2 + head 2") and gap in line for line in summary_lines(report))


def test_extract_exports_as_a_standard_peft_lora(extract_output, tmp_path):
    """export-peft writes the delta-initialised domain as a PEFT LoRA (blocks + lm_head) on the plain
    base; PEFT's logits and merge_and_unload equal the remote-code model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.output.peft_export import export_peft

    out, _ = extract_output
    summary = export_peft(out, str(tmp_path / "adapters"))
    assert summary["math"]["block_modules"] == 14
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math").eval()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters" / "base-model")).eval()
    ids = torch.randint(4, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = logits_of(remote, ids)
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapters" / "math")).eval()
    assert_same_logits(logits_of(model, ids), expected)
    assert_same_logits(logits_of(model.merge_and_unload(), ids), expected)


def test_export_gguf_pads_every_lora_to_one_rank_for_llama_cpp(extract_output, tmp_path):
    """llama.cpp scales each LoRA by lora_alpha / its own rank with one lora_alpha per file: the head's
    LoRA (rank + head_rank) beside block LoRAs (depth_rank) is padded with zeros to one rank, and PEFT's
    logits with the padded adapter equal the unpadded one's (scaling 1 everywhere)."""
    import json
    import shutil

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.output.peft_export import export_peft
    from mergekit_darts.serving.gguf import uniform_rank

    out, _ = extract_output
    export_peft(out, str(tmp_path / "adapters"))
    original, padded = tmp_path / "adapters" / "math", tmp_path / "padded"
    shutil.copytree(original, padded)
    config = json.loads((original / "adapter_config.json").read_text())
    assert config["rank_pattern"] and config["rank_pattern"]["lm_head"] != config["r"]  # two ranks to start with
    rank = uniform_rank(str(padded))
    assert rank == max(config["r"], config["rank_pattern"]["lm_head"])
    after = json.loads((padded / "adapter_config.json").read_text())
    assert after["r"] == after["lora_alpha"] == rank and not after["rank_pattern"] and not after["alpha_pattern"]
    tensors = load_file(str(padded / "adapter_model.safetensors"))
    assert {t.shape[0] for k, t in tensors.items() if k.endswith("lora_A.weight")} == {rank}
    assert {t.shape[1] for k, t in tensors.items() if k.endswith("lora_B.weight")} == {rank}
    assert bool(tensors["base_model.model.lm_head.lora_B.weight"].any())  # a head correction that would show
    assert uniform_rank(str(padded)) is None  # already uniform: left alone

    base_dir = str(tmp_path / "adapters" / "base-model")
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (original, padded):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        logits.append(logits_of(PeftModel.from_pretrained(base, str(folder)).eval(), ids))
    assert_same_logits(logits[1], logits[0])


def test_export_peft_uniform_rank_flag(extract_output, tmp_path):
    """``export-peft --uniform-rank`` writes the padded adapter (one r, one lora_alpha: what llama.cpp's
    converter reads) with the same PEFT logits as the default export, which says why it has two ranks."""
    import json

    from click.testing import CliRunner
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import assert_same_logits, logits_of
    from mergekit_darts.cli import main

    out, _ = extract_output
    plain = CliRunner().invoke(main, ["export-peft", out, str(tmp_path / "plain")], catch_exceptions=False)
    assert plain.exit_code == 0, plain.output
    assert "rank_pattern/alpha_pattern" in plain.output and "--uniform-rank" in plain.output
    padded = CliRunner().invoke(main, ["export-peft", out, str(tmp_path / "padded"), "--uniform-rank"],
                                catch_exceptions=False)
    assert padded.exit_code == 0, padded.output
    assert "padded with zeros to rank" in padded.output and "rank_pattern/alpha_pattern" not in padded.output
    config = json.loads((tmp_path / "padded" / "math" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] and not config["rank_pattern"] and not config["alpha_pattern"]
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in ("plain", "padded"):
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / folder / "base-model"), dtype=torch.float32).eval()
        logits.append(logits_of(PeftModel.from_pretrained(base, str(tmp_path / folder / "math")).eval(), ids))
    assert_same_logits(logits[1], logits[0])
