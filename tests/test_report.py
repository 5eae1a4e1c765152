"""The bias report: numbers match a direct per-token computation; plot and re-render work."""

import json
import os

import pytest
import torch

from mergekit_darts.repair.report.measure import bias_by_position, bin_edges

from mergekit_darts.repair.report.plot import plot_bias

from mergekit_darts.repair.report.table import render_report, summary_table


def _data(seed=0, n=3, t=10, h=4):
    g = torch.Generator().manual_seed(seed)
    merged = torch.randn(n, t, h, generator=g)
    expert = torch.randn(n, t, h, generator=g)
    corrected = expert + 0.1 * torch.randn(n, t, h, generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[1, :3] = 0  # left padding in record 1
    mask[2, 8:] = 0  # right padding in record 2
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    entropy = torch.rand(n, t, generator=g) + 0.1
    return merged, expert, mask, position_ids, entropy, corrected


def _direct(states, expert, mask, position_ids, weight, lo, hi):
    total, norm = 0.0, 0.0
    for i in range(states.shape[0]):
        for j in range(states.shape[1]):
            p = int(position_ids[i, j])
            if mask[i, j] and lo <= p < hi:
                d = float((states[i, j] - expert[i, j]).abs().mean())
                w = float(weight[i, j])
                total, norm = total + d * w, norm + w
    return total / norm if norm else None


def test_bias_by_position_matches_direct_computation():
    merged, expert, mask, pos, ent, corrected = _data()
    report = bias_by_position(merged, expert, mask, pos, ent, corrected, bins=4)
    assert report["positions"] == 10
    edges = report["bin_edges"]
    assert edges[0] == 0 and edges[-1] == 10 and len(edges) == 5
    ones = torch.ones_like(ent)
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        assert report["before"][b] == pytest.approx(_direct(merged, expert, mask, pos, ones, lo, hi), rel=1e-5)
        assert report["after"][b] == pytest.approx(_direct(corrected, expert, mask, pos, ones, lo, hi), rel=1e-5)
        assert report["before_weighted"][b] == pytest.approx(_direct(merged, expert, mask, pos, ent, lo, hi), rel=1e-5)
        assert report["after_weighted"][b] == pytest.approx(_direct(corrected, expert, mask, pos, ent, lo, hi), rel=1e-5)
    assert report["mean_before"] == pytest.approx(_direct(merged, expert, mask, pos, ones, 0, 10), rel=1e-5)
    assert report["mean_after_weighted"] == pytest.approx(_direct(corrected, expert, mask, pos, ent, 0, 10), rel=1e-5)
    assert report["mean_after"] < report["mean_before"]
    json.dumps(report)  # JSON-able


def test_bias_by_position_agrees_with_per_position_l1():
    from mergekit_darts.repair.train.losses import per_position_l1

    merged, expert, mask, pos, ent, corrected = _data(1)
    report = bias_by_position(merged, expert, mask, pos, ent, corrected, bins=100)
    assert report["bin_edges"] == list(range(11))  # one position per bin when bins >= positions
    expected = per_position_l1(merged, expert, mask, pos)
    assert report["before"] == pytest.approx(expected.tolist(), rel=1e-5)


def test_max_positions_caps_and_empty_bins_are_none():
    merged, expert, mask, pos, ent, corrected = _data(2)
    report = bias_by_position(merged, expert, mask, pos, ent, corrected, bins=16, max_positions=6)
    assert report["positions"] == 6 and report["bin_edges"][-1] == 6
    mask2 = mask.clone()
    mask2[:, :] = 0
    mask2[0, 0] = 1
    mask2[0, 9] = 1
    report = bias_by_position(merged, expert, mask2, pos, ent, corrected, bins=5)
    assert report["before"][0] is not None and report["before"][-1] is not None
    assert report["before"][1] is None and report["tokens"][1] == 0
    with pytest.raises(ValueError, match="no valid"):
        bias_by_position(merged, expert, torch.zeros_like(mask), pos, ent, corrected)
    with pytest.raises(ValueError, match="entropy"):
        bias_by_position(merged, expert, mask, pos, ent[:, :3], corrected)


def test_bin_edges():
    assert bin_edges(512, 16) == list(range(0, 513, 32))
    assert bin_edges(3, 16) == [0, 1, 2, 3]
    assert bin_edges(1, 4) == [0, 1]


def test_plot_and_render_report(tmp_path):
    merged, expert, mask, pos, ent, corrected = _data(3)
    bias = bias_by_position(merged, expert, mask, pos, ent, corrected, bins=4)
    report = {
        "surgery": {"method": "darts", "loss": "ewl1", "rank": 4, "max_positions": 16, "steps": 5, "seed": 0},
        "domains": {
            name: {"expert": f"/models/{name}", "calibration": {"train": 8, "held_out": 2, "truncated": 0, "skipped": 0},
                   "final_loss": 0.5, "bias": bias}
            for name in ("math", "code")
        },
    }
    (tmp_path / "darts_report.json").write_text(json.dumps(report))
    table = render_report(str(tmp_path))
    png = tmp_path / "darts_bias.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "math" in table and "code" in table and "method=darts" in table
    assert f"{bias['mean_before']:.4f}" in table
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp.png")]
    assert summary_table({"domains": {}}).startswith("domain")
    with pytest.raises(FileNotFoundError, match="darts_report.json"):
        render_report(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="bias"):
        plot_bias({"domains": {"x": {}}}, str(tmp_path / "x.png"))


def test_stage_clock_times_each_stage_and_the_report_table_shows_them():
    import time

    from mergekit_darts.repair.stages import StageClock

    clock = StageClock("cpu")
    with clock.stage("capture"):
        time.sleep(0.05)
    with pytest.raises(RuntimeError), clock.stage("train:math"):  # a failed stage is still timed
        raise RuntimeError("boom")
    stages = clock.as_report()
    assert list(stages) == ["capture", "train:math"] and stages["capture"]["seconds"] >= 0.05
    assert "cuda_peak_gib" not in stages["capture"] and stages["capture"]["peak_rss_gib_so_far"] > 0.05
    stages["capture"]["seconds"], stages["train:math"]["seconds"] = 80.4, 19.6
    table = summary_table({"domains": {}, "stages": stages})
    assert f"stages: capture 80 s, train math 20 s; peak RSS {stages['train:math']['peak_rss_gib_so_far']:.1f} GiB" in table
    assert "stages:" not in summary_table({"domains": {}})
