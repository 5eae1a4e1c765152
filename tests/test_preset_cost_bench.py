"""The benchmark that measures ``preset: best``'s step at 7B shapes on a GPU (benchmarks/gpu/gpu_kl_scale.py
--preset, docs/scale.md) runs, here at tiny shapes on the CPU, and writes what docs/scale.md reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gpu_preset_step_script_runs_at_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "preset.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "gpu_kl_scale.py"), "--preset", "--small",
                             "--device", "cpu", "--repeats", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    preset = json.loads(out.read_text())["preset"]
    assert preset["shape"] == {"hidden": 64, "mlp": 96, "layers": 2, "heads": 4, "vocab": 512}
    measured = preset["measured"]
    assert set(measured) == {"kl_depth0", "preset_float32", "preset_bf16_autocast",
                             "preset_top0_bf16_autocast", "preset_top1_bf16_autocast"}
    # the preset's training by default: 500 fixed steps on all 40 records, 12 a step (no early-stopped run)
    assert preset["batch_size"] == 12 and preset["steps"] == {"stopped": 0, "refit": 500}
    assert preset["train_blocks"] == [0, 1]
    for name, row in measured.items():
        assert row["seconds_per_step"] > 0 and row["minutes_per_domain"] > 0
        # 12 records per step: 12/40 of a 40-record step; train_blocks adds the frozen blocks' one-time forward
        full_step = row["seconds_per_step_at_20480_positions"]
        once = row.get("first_input_seconds_at_20480_positions", 0.0)
        assert ("first_input_seconds_at_20480_positions" in row) == name.startswith("preset_top")
        assert abs(row["minutes_per_domain"] - (full_step * 500 * 12 / 40 + once) / 60) < 1e-9 * full_step
    assert preset["flop_model"]["preset_over_kl"] > 1
    assert "min per domain" in result.stdout


def _cost_module():
    sys.path.insert(0, str(REPO / "benchmarks" / "speed_memory"))
    import preset_cost_7b

    return preset_cost_7b


def test_the_7b_estimate_charges_a_minibatch_step_for_its_records_only():
    cost = _cost_module()
    flops = {"blocks": 2.6e10, "kl": 1.3e9}
    full = cost.domain_minutes(500, 500, flops, cost.BF16_BLOCKS, True)
    batch8 = cost.domain_minutes(500, 500, flops, cost.BF16_BLOCKS, True, batch=8)
    # the stopped run trains 8 of 32 records per step and the refit 8 of 40: the checks cost the same
    checks = cost.seconds((500 / cost.EVAL_EVERY + 1) / 3, cost.VALIDATION, flops, cost.BF16_BLOCKS) / 60
    assert abs((batch8 - checks) / (full - checks) - (8 * 500 + 8 * 500) / (32 * 500 + 40 * 500)) < 1e-9
    # a batch at least the record count is the full batch
    assert cost.domain_minutes(500, 500, flops, cost.BF16_BLOCKS, True, batch=50) == full


def test_variants_group_tags_with_the_same_overrides_and_test_against_the_preset():
    cost = _cost_module()
    domain = {"steps_run": 500, "chosen_steps": 500, "refit_records": 40, "gap_closed": 0.9, "baseline_gap_closed": 0.4}

    def run(overrides, seeds, math):
        return {"overrides": overrides,
                "seeds": {str(s): {"domains": {"math": domain}, "scores": {"math": m}} for s, m in zip(seeds, math)}}

    steps = {"a": run({}, [0, 1, 2], [30, 31, 32]), "b": run({"batch_size": 8}, [0, 1, 2], [10, 11, 12]),
             "c": run({"batch_size": 8}, [3, 4, 5], [13, 14, 15])}
    variants = {json.dumps(v["overrides"]): v for v in cost.variant_rows(steps, {"blocks": 2.6e10, "kl": 1.3e9})}
    assert set(variants) == {"{}", '{"batch_size": 8}'}
    batch8 = variants['{"batch_size": 8}']
    assert batch8["tags"] == ["b", "c"] and batch8["seeds"] == 6 and batch8["mean_scores"] == {"math": 12.5}
    assert batch8["max_minutes"] < variants["{}"]["max_minutes"] / 4
    assert batch8["p_vs_preset"]["math"] < 0.05  # six scores all below the preset's three
    assert "p_vs_preset" not in variants["{}"] and variants["{}"]["is_preset"] and not batch8["is_preset"]
    assert batch8["mean_gap_closed"] == {"math": 0.9} and batch8["mean_extract_gap_closed"] == {"math": 0.4}


def test_a_variant_is_tested_against_the_preset_with_its_own_final_state_correction():
    cost = _cost_module()
    domain = {"steps_run": 500, "chosen_steps": 500, "refit_records": 40, "gap_closed": 0.9, "baseline_gap_closed": 0.4}

    def run(overrides, content, math):
        settings = {"content": content, "method": "darts" if content == "relu" else "standard"}
        return {"overrides": overrides, "seeds": {str(s): {"domains": {"math": domain}, "scores": {"math": m},
                                                           "preset_settings": settings}
                                                  for s, m in enumerate(math)}}

    # the ReLU-era preset scored high, the linear one low: a linear variant level with the linear preset
    steps = {"relu": run({}, "relu", [40, 41, 42]), "linear": run({}, "linear", [10, 11, 12]),
             "fewer": run({"kl_positions_per_step": 256}, "linear", [10, 11, 12]),
             "old_variant": run({"steps": 150}, "relu", [10, 11, 12])}
    variants = {v["tags"][0]: v for v in cost.variant_rows(steps, {"blocks": 2.6e10, "kl": 1.3e9})}
    assert set(variants) == {"relu", "linear", "fewer", "old_variant"}  # two presets, not one of six seeds
    assert variants["relu"]["is_preset"] and variants["linear"]["is_preset"]
    assert variants["fewer"]["correction"] == {"content": "linear", "method": "standard"}
    assert variants["fewer"]["p_vs_preset"]["math"] == 1.0  # against the linear preset: the same scores
    assert variants["old_variant"]["p_vs_preset"]["math"] < 0.15  # against the ReLU one: all three below


def test_the_micro_batch_memory_benchmark_runs_and_every_variant_takes_the_same_step(tmp_path):
    out = tmp_path / "micro.json"
    script = REPO / "benchmarks" / "speed_memory" / "bench_micro_batches.py"
    result = subprocess.run([sys.executable, str(script), "--micro", "2",
                             "--rows", "4", "--tokens", "8", "--layers", "1", "--threads", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["result"]
    assert [r["micro_batch_size"] for r in rows] == [None, 2]
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=1e-6)
    assert all(r["peak_added_mib"] >= 0 and r["seconds"] > 0 for r in rows)


def test_train_blocks_estimate_counts_k_blocks_the_kl_and_the_frozen_blocks_once():
    cost = _cost_module()
    llama2, llama3 = cost.MODELS["Llama-2-7B"], cost.MODELS["Llama-3-8B"]
    whole = cost.top_blocks_minutes(llama2, "all", 500, 500)
    assert whole["first_input_minutes"] == 0 and abs(whole["minutes"] - cost.domain_minutes(
        500, 500, {k: v / cost.TOKENS for k, v in cost.preset_flops(4096, 11008, 32, 32000, 1, cost.TOKENS,
                                                                    kl_matmuls=5).items()},
        cost.BF16_BLOCKS, True)) < 1e-9
    top = {k: cost.top_blocks_minutes(llama2, k, 500, 500) for k in (0, 1, 2)}
    # each trained block adds the same training minutes, and takes its forward out of the one-time pass
    step = top[1]["training_minutes"] - top[0]["training_minutes"]
    assert step > 0 and abs(top[2]["training_minutes"] - top[1]["training_minutes"] - step) < 1e-9
    assert top[0]["first_input_minutes"] > top[1]["first_input_minutes"] > top[2]["first_input_minutes"] > 0
    assert top[2]["minutes"] < whole["minutes"] / 4  # the exact float32 KL stays: most of a k = 2 step
    # Llama-3's 128k vocabulary: the KL through the head is about 4x Llama-2's, most of a k = 0 step
    three = cost.top_blocks_minutes(llama3, 0, 500, 500)
    assert three["minutes"] > 3 * top[0]["minutes"] and top[0]["kl_share_of_step"] == 1.0  # k = 0: no block runs
    assert cost.top_blocks_minutes(llama3, 1, 500, 500)["kl_share_of_step"] > top[1]["kl_share_of_step"] > 0.5
    # touching 4096 of a step's positions charges the KL for those only
    fewer = cost.top_blocks_minutes(llama3, 0, 500, 500, cost.BF16_BLOCKS, 4096)
    assert fewer["minutes"] < cost.top_blocks_minutes(llama3, 0, 500, 500, cost.BF16_BLOCKS)["minutes"] / 3
    # every block on minibatches of 10 records: the training as domain_minutes charges it, nothing run once
    flops3 = {k: v / cost.TOKENS for k, v in cost.preset_flops(4096, 14336, 32, 128256, 1, cost.TOKENS, kl_matmuls=5,
                                                                 kv_hidden=1024).items() if k != "preset_over_kl"}
    batch10 = cost.top_blocks_minutes(llama3, "all", 500, 500, batch=10)
    assert batch10["first_input_minutes"] == 0
    assert abs(batch10["minutes"] - cost.domain_minutes(500, 500, flops3, cost.BF16_BLOCKS, True, batch=10)) < 1e-9
    assert batch10["minutes"] < cost.top_blocks_minutes(llama3, "all", 500, 500)["minutes"] / 3
    rows = cost.top_blocks_rows({"x": (500, 500)})
    assert {r["batch_size"] for r in rows if r["train_blocks"] == "all"} == {None, *cost.ALL_BLOCKS_BATCHES}
    assert {r["batch_size"] for r in rows if r["train_blocks"] != "all"} == {None}


def test_real_family_step_counts_come_from_the_preset_rows_selection():
    cost = _cost_module()
    entry = {"selection": {"lr": 1e-3, "steps": 200, "candidates": [{"lr": 3e-3, "steps_run": 150},
                                                                     {"lr": 1e-3, "steps_run": 300}]}}
    assert cost.chosen_steps(entry) == (300, 200)
    assert cost.chosen_steps({"selection": None}) is None and cost.chosen_steps(None) is None


def test_a_recipe_is_priced_at_its_batch_and_its_runs_median_steps():
    cost = _cost_module()

    def domain(run, chosen):
        return {"steps_run": run, "chosen_steps": chosen}

    name = "batch_size: 8, early stopping"
    tags, overrides = cost.RECIPES[name]
    batch = overrides["batch_size"]
    steps = {tags[0]: {"overrides": overrides, "seeds": {
        "0": {"domains": {"math": domain(500, 500), "code": domain(200, 100), "instruct": domain(400, 300)}}}},
        "other": {"overrides": {"batch_size": 50}, "seeds": {"0": {"domains": {"math": domain(1, 1)}}}}}
    rows = cost.recipe_rows(steps, name)
    assert {(r["model"], r["kl"]) for r in rows} == {(m, k) for m in cost.MODELS for k in cost.KL_VARIANTS}
    row = next(r for r in rows if r["model"] == "Llama-3-8B" and r["kl"] == "exact float32 KL")
    assert (row["steps_run"], row["chosen"], row["batch_size"], row["domain_runs"]) == (400, 300, batch, 3)
    expected = cost.top_blocks_minutes(cost.MODELS["Llama-3-8B"], "all", 400, 300, cost.FP32, None, batch)["minutes"]
    assert row["minutes"] == pytest.approx(expected)
    assert row["minutes"] < cost.top_blocks_minutes(cost.MODELS["Llama-3-8B"], "all", 400, 300)["minutes"] / 3
    assert cost.recipe_rows({"other": steps["other"]}, name) == []  # no run of the recipe: no row


def test_a_fixed_step_recipe_trains_its_steps_once_on_every_record():
    """early_stopping: false: no stopped run on 32 records, no validation checks, no refit: the chosen
    steps once on all 40 records, so at batch 16 the same records a step as batch 8's stopped run and refit."""
    cost = _cost_module()
    name = "batch_size: 16, 500 fixed steps"
    tags, overrides = cost.RECIPES[name]
    fixed = {"steps_run": None, "chosen_steps": 500, "refit_records": None}
    assert cost.steps_of(fixed) == (500, 500, False)
    steps = {tags[0]: {"overrides": overrides, "seeds": {"0": {"domains": {"math": fixed, "code": fixed}}}}}
    row = next(r for r in cost.recipe_rows(steps, name)
               if r["model"] == "Llama-2-7B" and r["kl"] == "exact float32 KL")
    assert row["early_stopping"] is False and row["batch_size"] == 16
    flops = {k: v / cost.TOKENS for k, v in cost.preset_flops(4096, 11008, 32, 32000, 1, cost.TOKENS,
                                                             kl_matmuls=5).items() if k != "preset_over_kl"}
    once = cost.seconds(500, cost.RECORDS, flops, cost.BF16_BLOCKS, 16) / 60
    assert row["training_minutes"] == pytest.approx(once)
    # what early stopping + refit at the same batch would cost: the stopped run, its checks and the refit
    assert row["minutes"] < cost.top_blocks_minutes(cost.MODELS["Llama-2-7B"], "all", 500, 500, batch=16)["minutes"] / 1.8


def test_a_recipe_refuses_runs_that_trained_something_else():
    cost = _cost_module()
    name = "batch_size: 8, early stopping"
    tags, overrides = cost.RECIPES[name]
    steps = {tags[0]: {"overrides": {**overrides, "steps": 150},
                       "seeds": {"0": {"domains": {"math": {"steps_run": 150, "chosen_steps": 150}}}}}}
    with pytest.raises(SystemExit, match="RECIPES"):
        cost.recipe_rows(steps, name)
