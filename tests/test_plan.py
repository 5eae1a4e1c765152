"""``mergekit-darts plan``: the cost plan read from configs only (mergekit_darts/plan.py, docs/scale.md)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mergekit_darts.plan import CARDS, GB, USABLE, Shape, fitting_micro_batch, run_from_surgery, training_memory
from mergekit_darts.tiny import tiny_config

# the published shapes of the three bases the examples name (their Hub config.json files)
HUB_CONFIGS = {
    "llama2-7b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096}, 6_738_415_616),
    "llama3-8b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192}, 8_030_261_248),
    "qwen2.5-7b": ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "max_position_embeddings": 131072}, 7_615_616_512),
}
ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def write_config(folder, fields: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump({**fields, "architectures": [ARCHITECTURE[fields["model_type"]]], "tie_word_embeddings": False,
                   "rms_norm_eps": 1e-6}, handle)
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_parameters_are_the_models_own_count(arch, tied):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size=300, hidden_size=64, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    shape = Shape.from_config(config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    block = model.model.layers[0]
    linears = sum(p.numel() for n, p in block.named_parameters() if "norm" not in n)
    assert shape.block_linear_parameters == linears
    # a rank-1 adapter on each of the seven linears: (in + out) parameters each
    assert shape.block_linear_sides == sum(m.in_features + m.out_features for m in block.modules()
                                           if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_parameters_of_the_real_7b_configs_are_the_published_ones(tmp_path, name):
    from transformers import AutoConfig

    fields, published = HUB_CONFIGS[name]
    assert Shape.from_config(AutoConfig.from_pretrained(write_config(tmp_path / name, fields))).parameters == published


def _yaml(tmp_path, model: str, surgery: str) -> str:
    path = tmp_path / "cfg.yml"
    path.write_text(f"""merge_method: task_arithmetic
base_model: {model}
models:
  - model: {model}
    parameters: {{weight: 0.5}}
dtype: bfloat16
surgery:
{surgery}
  domains:
    math:
      model: {model}
      calibration: {{texts: ["two plus two", "three times four"], samples: 50, continue_tokens: 64}}
""")
    return str(path)


def _plan(path, *options):
    command = os.path.join(os.path.dirname(sys.executable), "mergekit-darts")
    result = subprocess.run([command, "plan", path, *options],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return result


def test_plan_of_the_preset_at_8b_says_what_fits_each_card(tmp_path):
    model = write_config(tmp_path / "llama3-8b", HUB_CONFIGS["llama3-8b"][0])
    result = _plan(_yaml(tmp_path, model, "  preset: best"), "--gpu", "h100")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "8.03 B parameters" in out and "vocabulary 128256" in out and "32 adapted block(s)" in out
    # the frozen float32 copy of 32 blocks (28 GB) cannot fit 24 GB whatever the micro-batch
    fits = out.splitlines()[-1]
    assert "24 GB: no" in fits and "80 GB: micro_batch_size:" in fits
    assert "to fit: training: set `micro_batch_size:" in out


def test_the_fitting_micro_batch_is_the_largest_that_fits():
    from mergekit_darts.config import parse_surgery_block

    shape = Shape.from_config(_hub_config("llama3-8b"))
    surgery = parse_surgery_block({"preset": "best", "domains": {
        "math": {"model": "m", "calibration": {"texts": ["a"], "samples": 50}}}})
    run = run_from_surgery(surgery, "math", shape.layers)
    card = CARDS["h100"]
    micro, total = fitting_micro_batch(shape, run, card)
    limit = card.memory_gb * GB * USABLE
    assert micro is not None and total <= limit
    assert sum(training_memory(shape, run, 2 * micro).values()) > limit
    # what the memory model counts for the frozen blocks: the 32 blocks' weights in float32
    assert training_memory(shape, run, 1)["frozen blocks (float32)"] == 4 * 32 * (shape.block_linear_parameters
                                                                                   + 2 * shape.hidden)
    assert fitting_micro_batch(shape, run, CARDS["rtx4090"])[0] is None


def test_a_final_state_loss_needs_no_micro_batches(tmp_path):
    model = write_config(tmp_path / "llama2-7b", HUB_CONFIGS["llama2-7b"][0])
    result = _plan(_yaml(tmp_path, model, "  loss: ewl1\n  rank: 16"), "--gpu", "rtx4090")
    assert result.returncode == 0, result.stderr
    assert "0 adapted block(s)" in result.stdout
    assert result.stdout.splitlines()[-1].endswith("24 GB: yes | 48 GB: yes | 80 GB: yes | 141 GB: yes")


def test_a_hub_id_that_is_not_available_offline_is_one_line_naming_the_field(tmp_path):
    result = _plan(_yaml(tmp_path, "no-such-org/no-such-model-xyz", "  loss: ewl1"))
    assert result.returncode != 0
    assert "no-such-org/no-such-model-xyz" in result.stderr and "Traceback" not in result.stderr


def _hub_config(name):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in HUB_CONFIGS[name][0].items() if k != "model_type"})


def test_the_plan_check_benchmark_compares_every_stage_with_a_run(tmp_path):
    """benchmarks/speed_memory/plan_check.py at tiny shapes: the plan's figures beside a real mergekit-yaml run's."""
    out = tmp_path / "plan_check.json"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "speed_memory",
                          "plan_check.py")
    result = subprocess.run([sys.executable, script, "--hidden", "32", "--layers", "2", "--steps", "2", "--samples", "4",
                             "--tokens", "16", "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"ewl1", "preset_shape"}
    for stages in rows.values():
        assert set(stages) == {"capture", "train math", "train code", "peak memory added (bytes)"}
        assert all(s["planned"] > 0 and s["measured"] > 0 for k, s in stages.items() if k != "peak memory added (bytes)")
    # the preset's shape of training adapts every block: the plan counts it far above the final-state loss
    assert rows["preset_shape"]["train math"]["planned"] > 10 * rows["ewl1"]["train math"]["planned"]
    # the activation model against what autograd keeps in transformers' own Llama block (SDPA)
    blocks = json.loads(out.read_text())["activations_per_block"]
    assert len(blocks) == 3 and all(0.95 < b["measured_over_planned"] < 1.25 for b in blocks), blocks


def test_training_only_the_top_blocks_costs_their_steps_only():
    """train_blocks: k: a step runs k blocks (the rest ran once at their extract); the float32 copy of
    every adapted block is still held (the capture keeps the whole tail)."""
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.plan import step_flops

    shape = Shape.from_config(_hub_config("llama2-7b"))
    runs = {}
    for k in (None, 2, 0):
        raw = {"preset": "best", "domains": {"math": {"model": "m", "calibration": {"texts": ["a"], "samples": 50}}}}
        if k is not None:
            raw["train_blocks"] = k
        runs[k] = run_from_surgery(parse_surgery_block(raw), "math", shape.layers)
    whole, top2, none = (step_flops(shape, runs[k], 40)["blocks"] for k in (None, 2, 0))
    assert none < top2 < whole and abs(top2 / whole - 2 / 32) < 0.01
    memory = {k: training_memory(shape, run, 1) for k, run in runs.items()}
    assert memory[2]["frozen blocks (float32)"] == memory[None]["frozen blocks (float32)"]
    assert memory[2]["activations"] * 16 == memory[None]["activations"] and memory[0]["activations"] == 0


def test_fitting_the_extract_to_the_activations_adds_one_pass_of_the_blocks():
    """extract_fit: activations: the delta start grows by a forward of the adapted blocks over the
    training records, their Gram matrices and the Cholesky factorizations; nothing else changes."""
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.plan import activation_fit_seconds, delta_seconds, plan_domain, step_flops, train_records

    shape = Shape.from_config(_hub_config("llama2-7b"))
    runs = {}
    for fit in ("weights", "activations"):
        raw = {"preset": "best", "extract_fit": fit,
               "domains": {"math": {"model": "m", "calibration": {"texts": ["a"], "samples": 50}}}}
        runs[fit] = run_from_surgery(parse_surgery_block(raw), "math", shape.layers)
    card = CARDS["h200"]
    assert runs["activations"].activation_fit and not runs["weights"].activation_fit
    extra = activation_fit_seconds(shape, runs["activations"], card)
    assert activation_fit_seconds(shape, runs["weights"], card) == 0.0
    assert delta_seconds(shape, runs["activations"], card) == pytest.approx(delta_seconds(shape, runs["weights"], card) + extra)
    # at least the blocks' forward over the training records at the card's bfloat16 rate and the Cholesky
    # of down_proj's 11008-wide input, 32 x 11008^3 / 3 FLOPs, at the card's float64 peak
    _, records = train_records(runs["activations"])
    forward = 2 * shape.layers * shape.block_linear_parameters * records * runs["activations"].tokens
    assert extra > forward / card.bf16_flops + 32 * 11008 ** 3 / 3 / card.fp64_flops
    assert step_flops(shape, runs["activations"], 40) == step_flops(shape, runs["weights"], 40)
    planned = {fit: plan_domain(shape, run, card) for fit, run in runs.items()}
    assert planned["activations"]["training"] == planned["weights"]["training"]
    assert planned["activations"]["delta start"]["seconds"] > planned["weights"]["delta start"]["seconds"]
