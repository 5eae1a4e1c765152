"""benchmarks/demo_quality/preset_grid.py: the choice rule of issue 52 (a cell qualifies when every domain is
within noise of that domain's best: Mann-Whitney p > 0.05 and at most 2 points lower; the cheapest qualifying
foldable cell is chosen, else the cheapest qualifying one) on cell results written by hand, and the cells' YAML (the preset with the cell's keys; the demo's keys the preset owns left out)."""

import json
import os
import sys

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "demo_quality"))

import preset_grid  # noqa: E402

DOMAINS = ("math", "code")


def write_cell(workdir, seed, name, math, code, cpu):
    cells = os.path.join(workdir, f"seed{seed}", "cells")
    os.makedirs(cells, exist_ok=True)
    result = {"cell": name, "seed": seed, "accuracy": {"math": math, "code": code},
              "gap_closed": {"math": 0.5, "code": 0.5}, "extract_gap_closed": {"math": 0.4, "code": 0.4},
              "seconds": {"wall": cpu, "cpu": cpu}}
    with open(os.path.join(cells, f"{name}.json"), "w") as handle:
        json.dump(result, handle)


def test_cheapest_cell_within_noise_is_chosen(tmp_path):
    workdir = str(tmp_path)
    for seed in range(6):
        write_cell(workdir, seed, "relu_kall", 40 + seed, 90, cpu=300)
        # one point lower on math, same code: within noise, and the cheapest trained cell
        write_cell(workdir, seed, "foldable_k0", 39 + seed, 90, cpu=60)
        # cheaper still would not matter: far below on math (p < 0.05 over six seeds each side)
        write_cell(workdir, seed, "relu_k0", 10 + seed, 90, cpu=50)
        # as good on math but 3 points lower on code: rejected
        write_cell(workdir, seed, "foldable_k1", 40 + seed, 87, cpu=100)
        # noisy math: not told apart by Mann-Whitney, but its mean is more than 2 points lower
        write_cell(workdir, seed, "relu_k1", (30, 50, 35, 55, 40, 20)[seed], 90, cpu=40)
        write_cell(workdir, seed, "extract", 5, 80, cpu=10)
        write_cell(workdir, seed, "extract_act", 60, 95, cpu=12)  # an untrained start is never the best
    data = preset_grid.summarize(workdir)
    cells = data["cells"]
    assert data["seeds"] == list(range(6))
    assert data["best_per_domain"]["math"] in ("relu_kall", "foldable_k1")
    assert cells["relu_k0"]["qualifies"] is False
    assert cells["relu_k0"]["vs_best"]["math"]["p"] < 0.05
    assert cells["foldable_k1"]["vs_best"]["code"]["points_below_best"] == 3.0
    assert cells["foldable_k1"]["qualifies"] is False
    assert cells["relu_k1"]["vs_best"]["math"]["p"] > 0.05
    assert cells["relu_k1"]["vs_best"]["math"]["points_below_best"] > 2
    assert cells["relu_k1"]["qualifies"] is False
    assert cells["foldable_k0"]["qualifies"] is True
    assert "qualifies" not in cells["extract"]  # the untrained extract stands beside, never chosen
    assert "qualifies" not in cells["extract_act"] and data["best_per_domain"]["code"] != "extract_act"
    assert data["chosen"] == "foldable_k0"
    assert data["qualifying_by_cpu"] == ["foldable_k0", "relu_kall"]
    assert data["cpu_ratio_to_shipped"]["foldable_k0"] == pytest.approx(0.2)


def test_a_qualifying_foldable_cell_wins_over_a_cheaper_relu_one(tmp_path):
    workdir = str(tmp_path)
    for seed in range(6):
        write_cell(workdir, seed, "relu_kall", 40 + seed, 90, cpu=300)
        write_cell(workdir, seed, "relu_k2", 40 + seed, 90, cpu=100)
        write_cell(workdir, seed, "foldable_kall", 40 + seed, 90, cpu=310)
    data = preset_grid.summarize(workdir)
    assert data["qualifying_by_cpu"] == ["relu_k2", "relu_kall", "foldable_kall"]
    assert data["chosen"] == "foldable_kall"


def test_a_cell_measured_on_the_other_family_must_qualify_there_too(tmp_path):
    workdir = str(tmp_path)
    for seed in range(6):
        write_cell(workdir, seed, "foldable_kall", 40 + seed, 90, cpu=300)
        write_cell(workdir, seed, "foldable_kall_b8", 40 + seed, 90, cpu=100)  # level on the grid, a third the cost
    assert preset_grid.summarize(workdir)["chosen"] == "foldable_kall_b8"
    # on the other family it is 3 points lower on math (not told apart by the test, but past the 2-point margin)
    other = {"foldable_kall": {"math": [30, 31, 32, 33, 34, 35], "code": [90] * 6},
             "foldable_kall_b8": {"math": [27, 28, 29, 30, 31, 32], "code": [90] * 6}}
    data = preset_grid.summarize(workdir, other)
    cells = data["cells"]
    assert cells["foldable_kall_b8"]["qualifies_on_grid"] is True and cells["foldable_kall_b8"]["qualifies"] is False
    assert cells["foldable_kall_b8"]["second_family"]["vs_best"]["math"]["points_below_best"] == 3.0
    assert cells["foldable_kall"]["qualifies"] is True and data["chosen"] == "foldable_kall"
    # level there as well: chosen again; a cell the other family did not measure is judged on the grid alone
    other["foldable_kall_b8"]["math"] = [31, 30, 33, 32, 35, 34]
    data = preset_grid.summarize(workdir, other)
    assert data["chosen"] == "foldable_kall_b8" and "second_family" in data["cells"]["foldable_kall_b8"]
    assert "Other family" not in preset_grid.markdown(data) and "other family" in preset_grid.markdown(data)


def test_the_other_familys_best_counts_cells_this_grid_did_not_run(tmp_path):
    workdir = str(tmp_path)
    for seed in range(6):
        write_cell(workdir, seed, "foldable_kall", 40 + seed, 90, cpu=300)
        write_cell(workdir, seed, "foldable_kall_b8", 40 + seed, 90, cpu=100)
    # on the other family b8 is 2 points below foldable_kall (within) but 3 below relu_kall, which this grid
    # did not run: measured against every cell there, it misses the rule
    other = {"relu_kall": {"math": [33, 34, 35, 36, 37, 38], "code": [90] * 6},
             "foldable_kall": {"math": [32, 33, 34, 35, 36, 37], "code": [90] * 6},
             "foldable_kall_b8": {"math": [30, 31, 32, 33, 34, 35], "code": [90] * 6}}
    data = preset_grid.summarize(workdir, other)
    b8 = data["cells"]["foldable_kall_b8"]["second_family"]
    assert b8["vs_best"]["math"]["best"] == "relu_kall" and b8["vs_best"]["math"]["points_below_best"] == 3.0
    assert b8["qualifies"] is False and data["chosen"] == "foldable_kall"
    assert "relu_kall" not in data["cells"]


def test_a_cell_another_grid_measured_must_qualify_there_too(tmp_path):
    workdir = str(tmp_path)
    for seed in range(6):
        write_cell(workdir, seed, "foldable_kall", 40 + seed, 90, cpu=300)
        write_cell(workdir, seed, "foldable_kall_fixed_b16", 40 + seed, 90, cpu=90)
        write_cell(workdir, seed, "foldable_k0", 40 + seed, 90, cpu=60)
    assert preset_grid.summarize(workdir)["chosen"] == "foldable_k0"
    # the same grid on other families (another machine's run, read from its JSON): k0 far below there, the
    # fixed-step cell not measured there, so judged where it was
    other = preset_grid.summarize(workdir)
    for name, math in (("foldable_kall", [30, 31, 32, 33, 34, 35]), ("foldable_k0", [10, 11, 12, 13, 14, 15])):
        other["cells"][name]["accuracy"]["math"] = math
        other["cells"][name]["mean_accuracy"]["math"] = sum(math) / 6
    del other["cells"]["foldable_kall_fixed_b16"]
    data = preset_grid.summarize(workdir, other_grids={"preset_grid_avx512.json": other})
    cells = data["cells"]
    assert cells["foldable_k0"]["qualifies_on_grid"] is True and cells["foldable_k0"]["qualifies"] is False
    assert cells["foldable_k0"]["other_grids"]["preset_grid_avx512.json"]["vs_best"]["math"]["p"] < 0.05
    assert "other_grids" not in cells["foldable_kall_fixed_b16"] and cells["foldable_kall_fixed_b16"]["qualifies"]
    assert data["chosen"] == "foldable_kall_fixed_b16" and data["other_grids"] == ["preset_grid_avx512.json"]
    # cost against the foldable full-batch preset where the grid ran no ReLU one
    assert data["shipped"] == "foldable_kall" and data["cpu_ratio_to_shipped"]["foldable_kall_fixed_b16"] == 0.3
    assert "preset_grid_avx512.json: math / code" in preset_grid.markdown(data)


def test_the_other_family_scores_are_read_from_preset_steps_tags(tmp_path):
    def run(math):
        return {"seeds": {str(i): {"scores": {"math": m, "code": 100.0}} for i, m in enumerate(math)}}

    tags = preset_grid.SECOND_FAMILY_TAGS["foldable_kall_b8"]
    runs = {tags[0]: run([20, 21, 22]), tags[1]: run([23, 24, 25]), "unrelated": run([1])}
    runs[preset_grid.SECOND_FAMILY_TAGS["foldable_kall"][0]] = run([30])  # its second tag missing: not read
    path = tmp_path / "preset_steps.json"
    path.write_text(json.dumps({"runs": runs}))
    scores = preset_grid.second_family_scores(str(path))
    assert scores == {"foldable_kall_b8": {"math": [20, 21, 22, 23, 24, 25], "code": [100.0] * 6}}
    assert preset_grid.second_family_scores(str(tmp_path / "absent.json")) == {}


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no cell results"):
        preset_grid.summarize(str(tmp_path))


def test_cell_yaml_keeps_the_cell_keys_over_the_demo(tmp_path):
    from mergekit_darts.demo.run import DemoSizes

    paths = {"base": "/b", "math": "/m", "code": "/c", "instruct": "/i"}
    text = preset_grid.cell_yaml(str(tmp_path), paths, 3, DemoSizes(), preset_grid.CELLS["foldable_k1"],
                                 str(tmp_path / "cache"))
    surgery = yaml.safe_load(text)["surgery"]
    assert surgery["preset"] == "best"
    assert (surgery["content"], surgery["method"], surgery["train_blocks"]) == ("linear", "standard", 1)
    assert surgery["cache_dir"] == str(tmp_path / "cache") and surgery["seed"] == 3
    # the demo's paper keys would win over the preset's: none is written
    assert not {"rank", "steps", "lr", "loss"} & set(surgery)
    assert yaml.safe_load(preset_grid.cell_yaml(str(tmp_path), paths, 0, DemoSizes(), preset_grid.CELLS["extract"],
                                                "c"))["surgery"]["steps"] == 0


@pytest.mark.parametrize("cell,content,method", [("relu_kall", "relu", "darts"), ("relu_k0", "relu", "darts"),
                                                 ("foldable_kall", "linear", "standard"),
                                                 ("foldable_act_k0", "linear", "standard"),
                                                 ("foldable_kall_fixed_b16", "linear", "standard")])
def test_cells_name_their_final_state_correction(cell, content, method):
    """The preset's own correction changed (ReLU -> linear): a rerun of a relu cell must still train ReLU."""
    from mergekit_darts.config import parse_surgery_block

    surgery = parse_surgery_block({"preset": "best", **preset_grid.CELLS[cell],
                                   "domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}})
    assert (surgery.content, surgery.method) == (content, method)
