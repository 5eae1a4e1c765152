"""Multi-seed statistics match scipy; compare runs on a tiny merged family; the CLI commands work."""

import json
import math
import os
import shutil

import pytest
from click.testing import CliRunner
from scipy import stats as sps

from mergekit_darts.evaluation.compare import compare_table, heldout_scorer, run_compare, summarize_groups

A = [41.2, 42.0, 40.8, 43.1, 41.9, 42.4]
B = [44.0, 45.2, 43.8, 44.9, 46.1, 45.0]


def test_summarize_groups_matches_scipy():
    out = summarize_groups({"standard+l1": A, "darts+ewl1": B})
    a, b = out["groups"]["standard+l1"], out["groups"]["darts+ewl1"]
    assert a["n"] == 6 and a["scores"] == A
    assert a["mean"] == pytest.approx(sum(A) / 6)
    mean = sum(A) / 6
    assert a["std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in A) / 5))  # sample std
    for group, values in ((a, A), (b, B)):
        w, p = sps.shapiro(values)
        assert group["shapiro"] == {"W": pytest.approx(w), "p": pytest.approx(p)}
    u, p = sps.mannwhitneyu(A, B, alternative="two-sided")
    test = out["mann_whitney"]["standard+l1 vs darts+ewl1"]
    assert test["U"] == pytest.approx(u) and test["p"] == pytest.approx(p)
    assert test["U"] == 0.0 and test["p"] == pytest.approx(0.0021645, rel=1e-3)  # complete separation, n=6+6
    json.dumps(out)


def test_summarize_groups_small_and_degenerate_inputs():
    out = summarize_groups({"a": [1.0, 2.0], "b": [3.0], "c": [5.0, 5.0, 5.0]})
    assert out["groups"]["a"]["shapiro"] is None and out["groups"]["b"]["std"] is None
    assert out["groups"]["c"]["std"] == 0.0
    shapiro_c = out["groups"]["c"]["shapiro"]
    assert shapiro_c is not None and all(v is None or math.isfinite(v) for v in shapiro_c.values())
    assert set(out["mann_whitney"]) == {"a vs b", "a vs c", "b vs c"}
    json.dumps(out, allow_nan=False)  # NaN from scipy must not leak into the JSON
    assert summarize_groups({"a": [], "b": [1.0]})["mann_whitney"]["a vs b"] is None


def _fake_report(l1, ewl1):
    return {"domains": {"math": {"bias": {"mean_after": l1, "mean_after_weighted": ewl1}},
                        "code": {"bias": {"mean_after": l1 + 1, "mean_after_weighted": None},
                                 "held_out_kl": {"before": 2.0, "after": 1.0}}}}


def test_heldout_scorer():
    assert heldout_scorer("x", _fake_report(0.5, 0.25)) == {
        "math/heldout_l1": 0.5, "math/heldout_ewl1": 0.25, "code/heldout_l1": 1.5, "code/heldout_kl": 1.0}


def test_run_compare_with_a_stub_pipeline(monkeypatch):
    import mergekit_darts.pipeline as pipeline

    calls = []

    def fake_run_surgery(config_source, out_path, *, overrides=None, options=None):
        calls.append(overrides)
        if overrides is None:
            return _fake_report(0.0, 0.0)
        base = 1.0 if overrides["method"] == "standard" else 0.5
        return _fake_report(base + 0.01 * overrides["seed"], base)

    monkeypatch.setattr(pipeline, "run_surgery", fake_run_surgery)
    result = run_compare("cfg", "out", seeds=3, first_seed=10, log=lambda _: None)
    assert calls[:2] == [{"method": "standard", "loss": "l1", "seed": 10}, {"method": "darts", "loss": "ewl1", "seed": 10}]
    assert calls[-1] is None and len(calls) == 7  # restore with the config's own settings
    assert result["seeds"] == [10, 11, 12] and len(result["runs"]) == 6
    math_l1 = result["stats"]["math/heldout_l1"]["groups"]
    assert math_l1["standard+l1"]["scores"] == pytest.approx([1.10, 1.11, 1.12])
    assert math_l1["darts+ewl1"]["scores"] == pytest.approx([0.60, 0.61, 0.62])
    assert "Mann-Whitney standard+l1 vs darts+ewl1" in compare_table(result)
    with pytest.raises(ValueError, match="seeds"):
        run_compare("cfg", "out", seeds=0)


TINY_SURGERY = """
surgery:
  method: darts
  loss: ewl1
  rank: 2
  max_positions: 16
  steps: 3
  lr: 1.0e-2
  device: cpu
  dtype: float32
  cache_dir: {cache}
  domains:
    math:
      model: {math}
      calibration:
        texts: ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4 then take 1", "what is 5 times 2 ?",
                "give the total of 2 and 7", "what is 9 minus 3 ?"]
"""


def test_compare_command_on_the_tiny_family(tiny_family, tmp_path):
    """The real pipeline end to end: three seeds per group on the tiny family, in a scratch copy that
    leaves MERGED_PATH byte for byte as it was; then --in-place, which restores the config's surgery."""
    import hashlib

    from helpers import merge_yaml

    from mergekit_darts.cli.evaluate import compare_command, report_command
    from mergekit_darts.cli.scratch import scratch_path

    out = tmp_path / "merged"
    shutil.copytree(tiny_family["merged"], out)

    def digest():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}

    before = digest()
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(merge_yaml(tiny_family) + TINY_SURGERY.format(cache=tmp_path / "cache", math=tiny_family["math"]))
    runner = CliRunner()
    result = runner.invoke(compare_command, [str(cfg), str(out), "--seeds", "3", "--json", str(tmp_path / "c.json"),
                                             "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert f"{out} is left as it is" in result.output
    assert digest() == before and not os.path.exists(scratch_path(str(out)))
    data = json.loads((tmp_path / "c.json").read_text())
    assert len(data["runs"]) == 6 and "math/heldout_l1" in data["stats"]
    for group in data["stats"]["math/heldout_l1"]["groups"].values():
        assert group["n"] == 3 and group["shapiro"] is not None
    assert "Mann-Whitney" in result.output
    in_place = runner.invoke(compare_command, [str(cfg), str(out), "--seeds", "1", "--json", str(tmp_path / "c.json"),
                                               "--quiet", "--in-place"])
    assert in_place.exit_code == 0, in_place.output
    assert "--in-place" in in_place.output and "(replacing the earlier file)" in in_place.output
    report = runner.invoke(report_command, [str(out)])  # restored surgery has a report to render
    assert report.exit_code == 0, report.output
    assert "math" in report.output and (out / "darts_bias.png").exists()


def test_compare_groups_option_parses_method_and_loss():
    import click

    from mergekit_darts.cli.evaluate import _groups

    assert _groups("standard+l1, darts+kl") == {
        "standard+l1": {"method": "standard", "loss": "l1"}, "darts+kl": {"method": "darts", "loss": "kl"}}
    for bad in ("darts+huber,standard+l1", "magic+l1,darts+l1", "darts+l1"):
        try:
            _groups(bad)
        except click.BadParameter as error:
            assert "--groups" in str(error.param_hint)
        else:
            raise AssertionError(f"{bad!r} was accepted")
