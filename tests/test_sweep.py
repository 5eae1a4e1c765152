"""``mergekit-darts sweep``: grid expansion and its errors, and real sweeps on a local Ray (num_cpus=2)
over the tiny family: all cells done, merges built once, resume skips everything, broken cells recorded."""

import json
import math
import os

import pytest
import yaml

from mergekit_darts.errors import SweepConfigError
from mergekit_darts.sweep.config import parse_sweep
from mergekit_darts.sweep.grid import expand, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_TEXTS = ["write a python function that adds two numbers", "def sum list : return the total of each number",
              "write code to reverse a list", "def count words in a string", "print the sum of 1 2 3",
              "write a function that returns true if the number is 0"]
MATH_TEXTS = ["how many apples are left if you give 2 of 5", "what is 3 plus 4", "add 7 and 2 then take 1",
              "how many pears each if 9 are split in 3", "what is 6 times 2", "subtract 4 from 10"]


def sweep_yaml(paths, sweep, surgery_extra=None) -> str:
    config = {
        "merge_method": "task_arithmetic", "base_model": paths["base"], "dtype": "float32",
        "models": [{"model": paths["math"], "parameters": {"weight": 0.5}},
                   {"model": paths["code"], "parameters": {"weight": 0.5}}],
        "surgery": {"rank": 4, "max_positions": 32, "steps": 3, "lr": 1.0e-2, "held_out": 0.34, "device": "cpu",
                    "domains": {"math": {"model": paths["math"], "calibration": {"texts": MATH_TEXTS}},
                                "code": {"model": paths["code"], "calibration": {"texts": CODE_TEXTS}}},
                    **(surgery_extra or {})},
        "sweep": sweep,
    }
    return yaml.safe_dump(config, sort_keys=False)


WEIGHTS = {"name": "weight", "paths": ["models.0.parameters.weight", "models.1.parameters.weight"],
           "values": [0.3, 0.6]}
VARIANTS = {"standard+l1": {"method": "standard", "loss": "l1"}, "darts+ewl1": {"method": "darts", "loss": "ewl1"}}
FAKE = {"base": "/m/base", "math": "/m/math", "code": "/m/code"}


# ------------------------------------------------------------------------------ schema and grid (no Ray)

def test_grid_expands_every_combination_with_distinct_hashes():
    spec = parse_sweep(sweep_yaml(FAKE, {"seeds": 2, "merge": [WEIGHTS], "surgery": {"variants": VARIANTS,
                                                                                     "grid": {"content": ["relu", "linear"]}}}))
    cells = expand(spec)
    validate(spec, cells)
    assert len(cells) == 2 * 4 * 2 and len({c.hash for c in cells}) == len(cells)
    assert len({c.merge.hash for c in cells}) == 2
    cell = next(c for c in cells if c.merge.values == {"weight": 0.6} and c.variant.name == "darts+ewl1,content=linear")
    assert [m["parameters"]["weight"] for m in cell.merge.config["models"]] == [0.6, 0.6]
    assert cell.surgery["method"] == "darts" and cell.surgery["content"] == "linear" and cell.surgery["rank"] == 4
    # hashes depend on content only: parsing again gives the same cells; a changed setting changes them
    assert [c.hash for c in expand(spec)] == [c.hash for c in cells]
    changed = parse_sweep(sweep_yaml(FAKE, {"seeds": 2, "merge": [WEIGHTS], "surgery": {"variants": VARIANTS}},
                                     surgery_extra={"steps": 4}))
    assert not {c.hash for c in expand(changed)} & {c.hash for c in cells}


def test_shipped_example_is_a_valid_sweep():
    with open(os.path.join(REPO, "examples", "sweep_tiny.yml")) as handle:
        spec = parse_sweep(handle.read())
    cells = expand(spec)
    validate(spec, cells)
    assert len(cells) == 8 and {c.variant.name for c in cells} == {"standard+l1", "darts+ewl1"}
    assert {c.merge.label for c in cells} == {"weight=0.3", "weight=0.6"}


@pytest.mark.parametrize("sweep, message", [
    ({"merge": [{"path": "models.5.parameters.weight", "values": [1]}]}, "sweep.merge.0: 'models.5'"),
    ({"merge": [{"path": "dtype.x", "values": [1]}]}, "cannot go into a str"),
    ({"merge": [{"path": "a", "paths": ["b"], "values": [1]}]}, "sweep.merge.0: give exactly one of"),
    ({"surgery": {"variants": {"bad": {"loss": "nope"}}}}, "sweep.surgery[bad].loss"),
    ({"surgery": {"variants": {"s": {"seed": 3}}}}, "seeds are listed in sweep.seeds"),
    ({"seedz": [1]}, "sweep.seedz: unknown key"),
    ({"merge": [{"path": "models", "values": [5]}]}, "not a valid mergekit config"),
])
def test_bad_sweep_blocks_name_the_field(sweep, message):
    with pytest.raises(SweepConfigError) as error:
        spec = parse_sweep(sweep_yaml(FAKE, sweep))
        validate(spec, expand(spec))
    assert message in str(error.value)


def test_cli_without_ray_names_the_extra(tmp_path, monkeypatch):
    import sys

    from click.testing import CliRunner

    from mergekit_darts.cli import main

    path = tmp_path / "sweep.yml"
    path.write_text(sweep_yaml(FAKE, {"merge": [WEIGHTS]}))
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    result = CliRunner().invoke(main, ["sweep", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    from mergekit_darts.extras import install_command

    assert "[sweep] extra: " + install_command("sweep") in result.output
    listed = CliRunner().invoke(main, ["sweep", str(path), "-o", str(tmp_path / "out"), "--dry-run"])
    assert listed.exit_code == 0 and "2 cells, 0 done" in listed.output


# ------------------------------------------------------------------------------ on a local Ray

@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from mergekit_darts.sweep.runner import worker_runtime_env

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2,
             runtime_env=worker_runtime_env(), log_to_driver=False)
    yield ray
    ray.shutdown()


def _lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_sweep_runs_every_cell_and_resumes_without_rerunning(local_ray, tiny_family, tmp_path, monkeypatch):
    from mergekit_darts.sweep import runner

    spec = parse_sweep(sweep_yaml(tiny_family, {"seeds": [0, 1], "merge": [WEIGHTS], "surgery": {"variants": VARIANTS}}))
    out = str(tmp_path / "sweep")
    outcome = runner.run_sweep(spec, out, progress=False)
    assert (outcome["cells"], outcome["ran"], outcome["failed"], outcome["skipped"]) == (8, 8, 0, 0)
    records = _lines(os.path.join(out, "results.jsonl"))
    assert len(records) == 8 and {r["status"] for r in records} == {"done"}
    assert {r["cell"] for r in records} == {c.hash for c in expand(spec)}
    for record in records:  # the workers ran this checkout's package, not some installed copy
        assert record["worker"]["package"] == os.path.join(REPO, "mergekit_darts", "__init__.py")
        assert math.isfinite(record["scores"]["mean/heldout_kl"]) and record["scores"]["mean/heldout_kl"] >= 0
        assert record["scores"]["mean/heldout_kl_before"] > 0  # the plain merge differs from the experts
    # seeds give different runs; the merge weight gives different merges
    by = {(r["merge"]["weight"], r["variant"], r["seed"]): r["scores"]["mean/heldout_kl"] for r in records}
    assert by[(0.3, "darts+ewl1", 0)] != by[(0.3, "darts+ewl1", 1)]
    assert by[(0.3, "darts+ewl1", 0)] != by[(0.6, "darts+ewl1", 0)]
    # each merge was built once; every cell's weights are hard links to it
    merges = sorted(os.listdir(os.path.join(out, "merges")))
    assert merges == sorted({r["merge_hash"] for r in records})
    for record in records:
        merged = os.path.join(out, "merges", record["merge_hash"], "model.safetensors")
        shards = [f for f in os.listdir(record["output"]) if f.endswith(".safetensors") and f != "darts.safetensors"]
        assert len(shards) == 1
        assert os.stat(os.path.join(record["output"], shards[0])).st_ino == os.stat(merged).st_ino
    table = open(os.path.join(out, "results.md")).read()
    assert table.count("| weight=0.3 |") == 3 and "standard+l1 vs darts+ewl1" in table  # 2 rows + 1 test
    stats = json.load(open(os.path.join(out, "stats.json")))
    assert stats["by_merge"]["weight=0.6"]["groups"]["darts+ewl1"]["n"] == 2
    assert stats["by_merge"]["weight=0.6"]["mann_whitney"]["standard+l1 vs darts+ewl1"]["p"] is not None
    assert os.path.getsize(os.path.join(out, "sweep_plot.png")) > 1000

    # resume: nothing is submitted to Ray, no cell output is touched
    stamps = {r["cell"]: os.stat(os.path.join(r["output"], "darts.safetensors")).st_mtime_ns for r in records}

    def no_work(*args, **kwargs):
        raise AssertionError("a finished cell ran again")

    with monkeypatch.context() as patch:
        patch.setattr(runner, "_run_cells", no_work)
        again = runner.run_sweep(spec, out, progress=False)
    assert (again["ran"], again["skipped"]) == (0, 8)
    assert {r["cell"]: os.stat(os.path.join(r["output"], "darts.safetensors")).st_mtime_ns for r in records} == stamps
    assert _lines(os.path.join(out, "results.jsonl")) == records

    # a lost record reruns only that cell, on the merge already built
    lost = records[5]
    with open(os.path.join(out, "results.jsonl"), "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records if r is not lost)
    partial = runner.run_sweep(spec, out, progress=False)
    assert (partial["ran"], partial["skipped"], partial["failed"]) == (1, 7, 0)
    rerun = next(r for r in _lines(os.path.join(out, "results.jsonl")) if r["cell"] == lost["cell"])
    assert rerun["seconds"]["merge"] == 0.0 and rerun["scores"] == lost["scores"]


def test_broken_cells_are_recorded_and_the_rest_finish(local_ray, tiny_family, tmp_path):
    from mergekit_darts.sweep import runner

    broken_domains = {"math": {"model": str(tmp_path / "no_such_expert"), "calibration": {"texts": MATH_TEXTS}}}
    sweep = {"seeds": [0],
             "merge": [{"name": "second", "path": "models.1.model", "values": [tiny_family["code"], str(tmp_path / "gone")]}],
             "surgery": {"variants": {"good": {}, "bad_expert": {"domains": broken_domains}}}}
    spec = parse_sweep(sweep_yaml(tiny_family, sweep))
    out = str(tmp_path / "sweep")
    outcome = runner.run_sweep(spec, out, progress=False)
    assert (outcome["ran"], outcome["failed"]) == (4, 3)
    records = {(r["merge"]["second"] == tiny_family["code"], r["variant"]): r for r in _lines(os.path.join(out, "results.jsonl"))}
    assert records[(True, "good")]["status"] == "done"
    bad_expert = records[(True, "bad_expert")]
    assert (bad_expert["status"], bad_expert["stage"]) == ("failed", "surgery")
    assert "no_such_expert" in bad_expert["error"] and "surgery.domains.math.model" in bad_expert["error"]
    for variant in ("good", "bad_expert"):
        failed = records[(False, variant)]
        assert (failed["status"], failed["stage"]) == ("failed", "merge") and failed["error"].startswith("merge failed")
    table = open(os.path.join(out, "results.md")).read()
    assert "## Failed cells" in table and table.count("merge failed") == 2
    # failed cells run again on the next run; the finished one does not
    again = runner.run_sweep(spec, out, progress=False)
    assert (again["ran"], again["skipped"], again["failed"]) == (3, 1, 3)
