"""Nothing is lost on failure, nothing non-finite is exported or made the default, and numbers say
what they were measured on (issue 14 "Data loss", issue 13 "Output hygiene")."""

import glob
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import merge_yaml
from mergekit_darts.config import SurgeryConfigError
from mergekit_darts.pipeline import run_surgery, summary_lines

BIN = Path(sys.executable).parent
TEXTS = ("['how many apples are left if we have 7 and give 2 ?', 'what is 3 plus 4 ?', "
         "'how many pears are left if we have 9 and give 4 ?', 'what is 8 minus 5 ?', 'total of 2 and 6 is ?', "
         "'each has 3 apples how many in total ?', 'take 5 from 12 then add 1', 'give 2 pears and take 3 apples']")


def _config(paths, tmp_path, weights=(0.5, 0.5), expert=None, **settings):
    base = dict(rank=4, max_positions=32, steps=20, lr=0.01, cache_dir=str(tmp_path / "cache"), held_out=0.25,
                device="cpu", dtype="float32")
    base.update(settings)
    merge = merge_yaml(paths).replace("weight: 0.5}", f"weight: {weights[0]}}}", 1)
    merge = merge.replace("weight: 0.5}", f"weight: {weights[1]}}}", 1)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in base.items()] + [
        "  domains:", "    math:", f"      model: {expert or paths['math']}", f"      calibration: {{texts: {TEXTS}}}"]
    return merge + "\n".join(lines) + "\n"


def _with_nan_norm(source: str, dest) -> str:
    """A copy of the model at ``source`` whose final norm weight is NaN: every state it computes is NaN
    (what fails a run only after the merge, in capture)."""
    import shutil

    shutil.copytree(source, dest)
    weights = os.path.join(dest, "model.safetensors")
    with safe_open(weights, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(dest)


@pytest.fixture(scope="module")
def nan_models(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    return {"expert": _with_nan_norm(tiny_family["math"], root / "math"),
            "base": _with_nan_norm(tiny_family["base"], root / "base")}


NAN_EXPERT_ERROR = ("surgery.domains.math.model: the expert's captured states hold NaN/inf", "model.norm.weight holds NaN")


def _digest(directory) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def _is_plain_merge(directory) -> bool:
    config = json.loads((Path(directory) / "config.json").read_text())
    names = set(os.listdir(directory))
    return ("darts" not in config and config["architectures"] == ["LlamaForCausalLM"]
            and "model.safetensors" in names and not names & {"darts.safetensors", "modeling_darts.py",
                                                              "darts_report.json", "model.safetensors.index.json"})


# ------------------------------------------------------------------------------------------ data loss

def test_failed_rerun_of_mergekit_yaml_leaves_the_repaired_model_as_it_was(tiny_family, nan_models, merged_copy,
                                                                          tmp_path):
    """The issue's case: a *different* merge re-run into a repaired directory fails after merging."""
    run_surgery(_config(tiny_family, tmp_path), merged_copy, progress=False)
    before = _digest(merged_copy)
    assert "darts.safetensors" in before
    cfg = tmp_path / "rerun.yml"
    cfg.write_text(_config(tiny_family, tmp_path, weights=(0.3, 0.7), expert=nan_models["expert"]))  # fails in capture
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    result = subprocess.run([str(BIN / "mergekit-yaml"), str(cfg), merged_copy], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in NAN_EXPERT_ERROR), result.stderr[-2000:]
    assert _digest(merged_copy) == before, "the repaired directory was modified by a failed run"
    kept = glob.glob(merged_copy + ".plain-merge-*")
    assert len(kept) == 1 and _is_plain_merge(kept[0]), kept  # the new merge is not thrown away
    assert kept[0] in result.stderr
    assert not glob.glob(os.path.join(os.path.dirname(merged_copy), ".darts-staging-*"))


def test_failed_surgery_into_a_new_directory_leaves_a_plain_merge(tiny_family, nan_models, tmp_path):
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    out = tmp_path / "new-out"
    with pytest.raises(SurgeryConfigError, match=NAN_EXPERT_ERROR[0]):
        merge_and_repair(_config(tiny_family, tmp_path, expert=nan_models["expert"]), str(out), original_run_merge())
    assert _is_plain_merge(out)
    readme = (out / "README.md").read_text()
    assert ".darts-staging" not in readme  # mergekit names the card after the directory: the final name
    assert not glob.glob(str(tmp_path / ".darts-staging-*"))


def test_successful_rerun_replaces_the_directory_as_a_whole(tiny_family, merged_copy, tmp_path):
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    run_surgery(_config(tiny_family, tmp_path), merged_copy, progress=False)
    (Path(merged_copy) / "stale-file.txt").write_text("from the old run")
    report = merge_and_repair(_config(tiny_family, tmp_path, weights=(0.3, 0.7)), merged_copy, original_run_merge())
    names = set(os.listdir(merged_copy))
    assert "stale-file.txt" not in names and {"darts.safetensors", "config.json"} <= names
    assert report["domains"]["math"]["verdict"]["status"] in ("improved", "worse")
    assert not glob.glob(os.path.join(os.path.dirname(merged_copy), ".darts-staging-*"))


def test_output_that_is_a_symlink_is_followed(tiny_family, merged_copy, tmp_path):
    """Issue 25 item 3: the link itself used to be swapped for a real directory, its target keeping the
    old model (exit 0). Now the target is replaced (staged beside it) and the link is left as it is."""
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    link = tmp_path / "links" / "out"
    link.parent.mkdir()
    os.symlink(merged_copy, link)
    (Path(merged_copy) / "stale-file.txt").write_text("from the old run")
    merge_and_repair(_config(tiny_family, tmp_path, steps=5), str(link), original_run_merge())
    assert link.is_symlink() and os.readlink(link) == merged_copy
    names = set(os.listdir(merged_copy))
    assert "darts.safetensors" in names and "stale-file.txt" not in names
    assert json.loads((Path(merged_copy) / "config.json").read_text())["architectures"] == ["DartsLlamaForCausalLM"]
    for folder in (link.parent, Path(merged_copy).parent):
        assert not [n for n in os.listdir(folder) if n.startswith(".darts-staging-")]


def test_cache_write_failure_is_a_warning_and_leaves_no_temp_file(tiny_family, merged_copy, tmp_path, monkeypatch, caplog):
    import safetensors.torch
    from safetensors import SafetensorError

    import mergekit_darts.output.export  # noqa: F401  (binds the real save_file: only the cache's writes fail)

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")  # what a full disk leaves behind
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture.cache"):
        report = run_surgery(_config(tiny_family, tmp_path), merged_copy, progress=False)
    assert report["domains"]["math"]["bias"]["mean_after"] is not None
    assert any("could not write" in r.getMessage() and "SafetensorError" in r.getMessage() for r in caplog.records)
    cache = tmp_path / "cache"
    assert not list(cache.glob(".tmp-*")) and not list(cache.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------ non-finite

def test_nan_cache_entry_is_recomputed_not_trained_on(tiny_family, merged_copy, tmp_path, caplog):
    first = run_surgery(_config(tiny_family, tmp_path), merged_copy, progress=False)
    entries = sorted((tmp_path / "cache").glob("expert.math.*.safetensors"))
    assert entries
    with safe_open(str(entries[0]), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 3)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(entries[0]), metadata=metadata)
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture.cache"):
        second = run_surgery(_config(tiny_family, tmp_path), merged_copy, progress=False)
    assert any("non-finite" in r.getMessage() for r in caplog.records)
    assert second["domains"]["math"]["bias"] == first["domains"]["math"]["bias"]


def test_non_finite_expert_is_an_error_and_exports_nothing(tiny_family, nan_models, merged_copy, tmp_path):
    before = _digest(merged_copy)
    with pytest.raises(SurgeryConfigError) as error:
        run_surgery(_config(tiny_family, tmp_path, expert=nan_models["expert"]), merged_copy, progress=False)
    assert all(part in str(error.value) for part in NAN_EXPERT_ERROR) and nan_models["expert"] in str(error.value)
    assert _digest(merged_copy) == before


def test_diverged_training_is_an_error():
    """lr is bounded by the schema now (lr: 1e30 is refused before the merge); a correction that still
    ends non-finite (e.g. in a low-precision dtype) stops the run before export."""
    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.remote_code.surgery import DomainSurgery
    from mergekit_darts.repair.train.domain import check_finite_training

    surgery = parse_surgery_block({"domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}})
    module = DomainSurgery(8, rank=2, max_positions=4)
    with torch.no_grad():
        module.up.weight.fill_(float("inf"))
    with pytest.raises(SurgeryConfigError, match=r"surgery.domains.math: training diverged.*surgery.lr"):
        check_finite_training("math", module, torch.zeros(1, 4, 8), surgery)


def test_nan_in_the_base_model_is_blamed_on_the_merge(tiny_family, nan_models, tmp_path):
    """Issue 25 item 11: NaN from the base model used to be blamed on the math expert's path."""
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    paths = {**tiny_family, "base": nan_models["base"]}
    with pytest.raises(SurgeryConfigError) as error:
        merge_and_repair(_config(paths, tmp_path), str(tmp_path / "out"), original_run_merge())
    message = str(error.value)
    assert message.startswith("surgery.domains.math: the merged model's captured states hold NaN/inf"), message
    assert "in the merge, weight model.norm.weight holds NaN/inf" in message and "input models" in message
    assert tiny_family["math"] not in message


def test_a_second_export_into_the_same_directory_is_refused_and_leaves_the_first_ones_stage(tiny_family, merged_copy):
    """An export removes the staging folders it finds in the output directory (a killed export's); one
    running beside another would have removed that one's stage mid-write (seen with two benchmark processes
    exporting into one folder): now the second is refused by name and the stage stays."""
    import fcntl

    from mergekit_darts.errors import BusyError
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape

    config = json.loads((Path(merged_copy) / "config.json").read_text())
    module = DomainSurgery.from_shape(SurgeryShape(method="standard", rank=2, head_rank=0, max_positions=8,
                                                   content="linear"),
                                      hidden_size=config["hidden_size"], vocab_size=config["vocab_size"])
    stage = Path(merged_copy) / ".darts-staging-0badf00d"
    stage.mkdir()
    (stage / "darts.safetensors").write_bytes(b"being written")
    other = os.open(merged_copy, os.O_RDONLY)  # the export already running
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with pytest.raises(BusyError, match="another mergekit-darts process is exporting into this directory"):
            export_surgery(merged_copy, {"math": module}, {"math": tiny_family["math"]}, "math", loss="kl")
        assert (stage / "darts.safetensors").read_bytes() == b"being written"
        assert "darts.safetensors" not in os.listdir(merged_copy)
    finally:
        os.close(other)
    # alone, an export runs and clears what a killed one left
    export_surgery(merged_copy, {"math": module}, {"math": tiny_family["math"]}, "math", loss="kl")
    assert not stage.exists() and "darts.safetensors" in os.listdir(merged_copy)


def test_report_with_nan_is_valid_json_with_nulls_and_a_flag(tiny_family, merged_copy, tmp_path):
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.report.verdict import sanitized_report

    report = {"domains": {"math": {"final_loss": float("nan"), "bias": {"after": [1.0, float("inf")]}}}}
    clean = sanitized_report(report)
    assert clean["domains"]["math"]["final_loss"] is None and clean["domains"]["math"]["bias"]["after"] == [1.0, None]
    assert clean["non_finite_values"] == ["domains.math.final_loss", "domains.math.bias.after[1]"]
    config = json.loads((Path(merged_copy) / "config.json").read_text())
    module = DomainSurgery.from_shape(SurgeryShape(method="darts", rank=2, head_rank=0, max_positions=8, content="relu"),
                                      hidden_size=config["hidden_size"], vocab_size=config["vocab_size"])
    export_surgery(merged_copy, {"math": module}, {"math": tiny_family["math"]}, "math", loss="l1", report=report)

    def refuse(constant):
        raise ValueError(f"invalid JSON constant {constant}")

    written = json.loads((Path(merged_copy) / "darts_report.json").read_text(), parse_constant=refuse)
    assert written["non_finite_values"] == clean["non_finite_values"]


# ------------------------------------------------------------------------------------------ defaults

def test_worse_domain_is_not_made_the_default_unless_forced(tiny_family, merged_copy, tmp_path, caplog):
    # overshoots: seeded, always worse; no_regret off, or the untrained identity would ship instead (test_no_regret.py)
    worse = dict(lr=3.0, loss="l1", content="linear", default_domain="math", no_regret="false")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.pipeline"):
        report = run_surgery(_config(tiny_family, tmp_path, **worse), merged_copy, progress=False)
    assert report["domains"]["math"]["verdict"]["status"] == "worse"
    config = json.loads((Path(merged_copy) / "config.json").read_text())
    assert config["darts_domain"] == "none"
    assert report["default_domain"] == {"requested": "math", "used": "none", "reason": "worse than the plain merge"}
    assert any("WORSE" in r.getMessage() for r in caplog.records)
    assert any("WARNING: worse" in line for line in summary_lines(report))
    card = (Path(merged_copy) / "README.md").read_text()
    assert "**worse than the plain merge**" in card and "requested `math`" in card

    forced = run_surgery(_config(tiny_family, tmp_path, allow_worse_default="true", **worse), merged_copy,
                         progress=False)
    assert json.loads((Path(merged_copy) / "config.json").read_text())["darts_domain"] == "math"
    assert forced["default_domain"]["used"] == "math" and "allow_worse_default" in forced["default_domain"]["reason"]


def test_improved_domain_stays_the_default(tiny_family, merged_copy, tmp_path):
    report = run_surgery(_config(tiny_family, tmp_path, steps=60), merged_copy, progress=False)
    entry = report["domains"]["math"]
    verdict = entry["verdict"]
    assert verdict["status"] == "improved"
    assert json.loads((Path(merged_copy) / "config.json").read_text())["darts_domain"] == "math"
    # decided by the objective's own held-out value (ewl1 here), and the report says so
    assert verdict["decided_by"] == "held-out ewl1 loss"
    assert (verdict["before"], verdict["after"]) == (entry["held_out_loss"]["before"], entry["held_out_loss"]["after"])
    assert "decided by held-out ewl1 loss" in (Path(merged_copy) / "README.md").read_text()
    assert any(line.strip().startswith("verdict improved: decided by held-out ewl1 loss") for line in summary_lines(report))


def _entry(loss_before_after=None, kl=(0.5, 0.4), bias=(0.30, 0.20)):
    entry = {"bias": {"mean_before": bias[0], "mean_after": bias[1], "mean_before_weighted": bias[0],
                      "mean_after_weighted": bias[1]},
             "held_out_kl": {"before": kl[0], "after": kl[1]}}
    if loss_before_after:
        entry["held_out_loss"] = dict(zip(("before", "after"), loss_before_after))
    return entry


def test_verdict_and_default_follow_the_objectives_held_out_metric():
    """Issue 25 item 5: the verdict used the L1 bias for every hidden-state loss (mse, cosine, ...),
    so it could call a domain improved while the metric the run optimised got worse."""
    from mergekit_darts.repair.report.verdict import choose_default, domain_verdict

    entry = _entry(loss_before_after=(0.010, 0.012))  # L1 bias better, the mse objective worse
    entry["verdict"] = domain_verdict(entry, "mse")
    assert entry["verdict"]["status"] == "worse" and entry["verdict"]["decided_by"] == "held-out mse loss"
    # every other figure that got better is named (issue 35 item 2), not only the KL
    assert [d["metric"] for d in entry["verdict"]["disagreeing"]] == ["KL to expert", "L1 bias",
                                                                      "entropy-weighted L1 bias"]
    report = {"domains": {"math": entry}}
    assert choose_default(report, "math", allow_worse=False) == "none"
    kl_only = _entry(kl=(0.5, 0.6), bias=(0.3, 0.1))  # loss: kl decides on the KL, whatever the bias did
    assert domain_verdict(kl_only, "kl")["status"] == "worse"


def test_a_metric_that_disagrees_with_the_verdict_is_reported():
    from mergekit_darts.repair.report.table import summary_table
    from mergekit_darts.repair.report.verdict import domain_verdict

    entry = {**_entry(loss_before_after=(0.2, 0.1), kl=(0.5, 0.7)), "calibration": {"train": 6, "held_out": 2}}
    entry["verdict"] = domain_verdict(entry, "ewl1")
    assert entry["verdict"]["status"] == "improved" and entry["verdict"]["disagreeing"][0]["status"] == "worse"
    report = {"domains": {"math": entry}}
    assert "  verdict improved: decided by held-out ewl1 loss; KL to expert got worse" in summary_lines(report)
    assert "verdict math: decided by held-out ewl1 loss; KL to expert got worse" in summary_table(report)


def test_every_measured_figure_that_moved_the_other_way_is_listed():
    """Issue 35 item 2: a kl run whose L1 bias and greedy exact match got worse had ``disagreeing: []``."""
    from mergekit_darts.repair.report.verdict import domain_verdict, verdict_note

    entry = _entry(kl=(0.5, 0.3), bias=(0.20, 0.26))
    entry["behaviour"] = {"prompts": 10, "before": {"exact_match": 0.9, "top1_agreement": 0.95, "first_disagreement": 7.0},
                          "after": {"exact_match": 0.8, "top1_agreement": 0.97, "first_disagreement": 7.0}}
    verdict = domain_verdict(entry, "kl")
    assert verdict["status"] == "mixed"  # issue 46 item 1: never "improved" while the exact match fell
    assert [(d["metric"], d["status"]) for d in verdict["disagreeing"]] == [
        ("L1 bias", "worse"), ("entropy-weighted L1 bias", "worse"), ("greedy exact match", "worse")]
    assert "greedy exact match got worse" in verdict_note(verdict)  # top-1 rose, first disagreement tied: not listed
    worse = domain_verdict({**entry, "held_out_kl": {"before": 0.3, "after": 0.5}}, "kl")
    assert worse["status"] == "worse" and [d["metric"] for d in worse["disagreeing"]] == ["top-1 agreement"]


def test_without_held_out_records_numbers_say_training_records(tiny_family, merged_copy, tmp_path):
    from mergekit_darts.repair.report.table import render_report

    report = run_surgery(_config(tiny_family, tmp_path, held_out=0), merged_copy, progress=False)
    entry = report["domains"]["math"]
    assert entry["calibration"]["held_out"] == 0 and entry["verdict"]["measured_on"] == "training records"
    lines = summary_lines(report)
    assert "training-records bias" in lines[0] and "held-out" not in lines[0]
    card = (Path(merged_copy) / "README.md").read_text()
    assert "**training records**" in card
    table = render_report(merged_copy, plot=False)
    assert "TRAINING records" in table
    assert not math.isnan(entry["bias"]["mean_after"])
