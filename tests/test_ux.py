"""What a new user meets: eval on small-context models, the documented example commands, warnings
printed once and readably, compare's wording, the report's KL, the bias figure, benchmark outputs."""

import json
import logging
import os
import shlex

import pytest
from click.testing import CliRunner

from mergekit_darts.evaluation.harness import EvaluationError, evaluate, generation_length

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "evaluation.md")]
# The offline example's evaluation commands exactly as docs/evaluation.md prints them: they must run
# as printed from the repository root on the offline example's output `out`.
DOCUMENTED_EVAL = [
    "mergekit-darts eval out --domain math --trust-remote-code --tasks gsm8k_darts "
    "--data examples/data/gsm8k_example.jsonl --compare-none --limit 2",
    "mergekit-darts eval out --domain code --trust-remote-code --tasks humaneval_darts --allow-code-execution --limit 2",
    "mergekit-darts eval out --domain math --trust-remote-code --tasks alpaca_darts "
    "--data examples/data/alpaca_example.jsonl --output-dir gen --limit 2",
]


def _cli(args, **kwargs):
    from mergekit_darts.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False, **kwargs)


@pytest.fixture(scope="module")
def darts_dir(tiny_family, tmp_path_factory):
    """The tiny family's merge with a math and a code surgery (context 256, like the offline example)."""
    from helpers import quick_surgery_output

    root = tmp_path_factory.mktemp("ux")
    return quick_surgery_output(tiny_family, root / "tiny_out", root / "cache", domains=("math", "code"))


# --- 1. eval on a model whose context is shorter than the tasks' generation length -----------

def test_eval_clips_generation_to_a_small_context_through_lm_eval(tmp_path, caplog):
    from mergekit_darts.tiny import make_random_model

    model_dir = str(tmp_path / "ctx128")
    make_random_model(model_dir, seed=0, max_position_embeddings=128)
    with pytest.raises(EvaluationError, match=r"--max-gen-toks 512: .* context of 128 tokens.*--max-gen-toks 64"):
        generation_length(model_dir, ["gsm8k_darts"], 512)
    assert generation_length(model_dir, ["gsm8k_darts"], 20) == 20
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.evaluation.harness"):
        assert generation_length(model_dir, ["gsm8k_darts"], None) == 64
    assert "context of 128 tokens" in caplog.text and "512" in caplog.text
    # the real lm-eval run that used to fail with "requested max tokens to generate (512) must be less ..."
    data = os.path.join(REPO, "examples", "data", "gsm8k_example.jsonl")
    out = evaluate(model_dir, "none", ["gsm8k_darts"], data=data, limit=1, device="cpu")
    assert 0.0 <= out["tasks"]["gsm8k_darts"]["exact_match,strict-match"] <= 1.0
    result = _cli(["eval", model_dir, "--domain", "none", "--data", data, "--limit", "1", "--device", "cpu",
                   "--max-gen-toks", "128"])
    assert result.exit_code == 2
    assert "--max-gen-toks 128" in result.output and "context of 128 tokens" in result.output
    assert "Traceback" not in result.output


# --- 2. the example data files and the documented commands -----------------------------------

def test_example_data_files_are_in_the_tasks_formats():
    with open(os.path.join(REPO, "examples", "data", "gsm8k_example.jsonl")) as handle:
        gsm = [json.loads(line) for line in handle]
    assert len(gsm) >= 10 and all(r["question"] and "\n#### " in r["answer"] for r in gsm)
    with open(os.path.join(REPO, "examples", "data", "alpaca_example.jsonl")) as handle:
        alpaca = [json.loads(line) for line in handle]
    assert len(alpaca) >= 10 and all(r["instruction"] for r in alpaca)
    assert any("output" in r for r in alpaca) and any("output" not in r for r in alpaca)


def test_documented_eval_commands_run_as_printed(darts_dir, tmp_path, monkeypatch):
    documented = "\n".join(open(p).read() for p in DOCS if os.path.exists(p))
    monkeypatch.chdir(REPO)  # the commands use paths relative to the repository root
    for command in DOCUMENTED_EVAL:
        assert command in documented.replace("\\\n", ""), f"not documented as tested: {command}"
        args = shlex.split(command)[1:]
        args = [darts_dir if a == "out" else str(tmp_path / "gen") if a == "gen" else a for a in args]
        result = _cli(args + ["--device", "cpu"])
        assert result.exit_code == 0, result.output
        assert "generating at most 128 new tokens" in result.output  # context 256: clipped, said once
        assert result.output.count("generating at most") == 1
        table = [line for line in result.output.splitlines() if line.startswith("task")]
        assert table, result.output
    exported = json.loads((tmp_path / "gen" / "alpaca_outputs.math.json").read_text())
    assert [r["instruction"] for r in exported][:1] == ["Reverse the order of the words: red green blue"]


# --- 5. warnings: readable, and once per run ------------------------------------------------

def test_calibration_warning_is_readable_and_printed_once_per_command(tmp_path):
    import io

    from mergekit_darts.config import CalibrationConfig
    from mergekit_darts.console import user_logging
    from mergekit_darts.repair.capture.calibration import load_calibration_texts

    cal = CalibrationConfig(texts=["a b", "c d", "e f"], samples=50)
    stream = io.StringIO()
    with user_logging(stream):
        for seed in range(5):  # what compare does: the same calibration for every seed and group
            assert len(load_calibration_texts(cal, seed, where="surgery.domains.code.calibration")) == 3
    lines = stream.getvalue().splitlines()
    assert lines == ["mergekit-darts: warning: surgery.domains.code.calibration: 'texts' has 3 records, fewer "
                     "than samples=50; using all 3 (set samples: 3 to silence this)"]
    logger = logging.getLogger("mergekit_darts")
    assert logger.propagate and not logger.handlers  # restored after the command


@pytest.mark.parametrize("config", ["mergekit_darts/demo/tiny_offline.yml", "examples/sweep_tiny.yml"])
def test_the_offline_examples_do_not_warn_about_themselves(config):
    """Every calibration asks for at most the records it has (the sweep's cells used to warn in each worker)."""
    import yaml

    from mergekit_darts.config import SurgeryConfig
    from mergekit_darts.demo import offline

    with open(os.path.join(REPO, config)) as handle:
        surgery = SurgeryConfig.model_validate(yaml.safe_load(handle)["surgery"])
    for name, domain in surgery.domains.items():
        cal = domain.calibration
        if cal.texts is None:
            assert cal.path == f"./{offline.FAMILY}/{offline.PROMPTS}"  # what `mergekit-darts example` writes
        count = len(cal.texts) if cal.texts is not None else sum(1 for _ in open(os.path.join(offline.HERE, offline.PROMPTS)))
        assert cal.samples <= count, f"{name}: samples={cal.samples} > {count} records"


def test_example_command_writes_the_offline_example_and_keeps_what_is_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _cli(["example"])
    assert first.exit_code == 0, first.output
    assert first.output.splitlines()[-1] == "next: mergekit-yaml tiny_offline.yml out"
    assert "Writing model shards" not in first.output and "Loading weights" not in first.output
    for part in ("base", "math", "code"):
        assert (tmp_path / "tiny_family" / part / "model.safetensors").is_file()
    assert (tmp_path / "tiny_family" / "math_prompts.jsonl").is_file()
    text = (tmp_path / "tiny_offline.yml").read_text()
    assert "./tiny_family/math_prompts.jsonl" in text and "examples/" not in text
    weights = (tmp_path / "tiny_family" / "base" / "model.safetensors").stat().st_mtime_ns
    again = _cli(["example"])
    assert again.exit_code == 0 and "kept the existing ./tiny_family/" in again.output
    assert (tmp_path / "tiny_family" / "base" / "model.safetensors").stat().st_mtime_ns == weights
    (tmp_path / "tiny_offline.yml").write_text(text.replace("steps: 100", "steps: 7"))  # the user's edit
    refused = _cli(["example"])
    assert refused.exit_code == 1 and "--force" in refused.output
    assert "steps: 7" in (tmp_path / "tiny_offline.yml").read_text()
    elsewhere = _cli(["example", "--dir", "sub"])
    assert elsewhere.exit_code == 0 and "next: mergekit-yaml sub/tiny_offline.yml sub/out" in elsewhere.output
    assert "base_model: sub/tiny_family/base" in (tmp_path / "sub" / "tiny_offline.yml").read_text()


# --- 7. compare's wording and our own loads --------------------------------------------------

def test_compare_table_labels_directions_and_explains_small_samples():
    from mergekit_darts.evaluation.compare import compare_table, smallest_p, summarize_groups

    stats = {
        "math/heldout_l1": {**summarize_groups({"standard+l1": [0.4, 0.5], "darts+ewl1": [0.2, 0.3]}), "better": "lower"},
        "math/demo_accuracy": summarize_groups({"standard+l1": [3, 4, 5, 6], "darts+ewl1": [1, 2, 2, 1]}),
    }
    table = compare_table({"stats": stats})
    assert "math/heldout_l1 (lower is better)" in table and "math/demo_accuracy (higher is better)" in table
    assert "darts+ewl1 better on mean" in table.split("math/demo_accuracy")[0]
    assert "standard+l1 better on mean" in table.split("math/demo_accuracy")[1]
    assert "Shapiro: n=2, needs 3" in table and "Shapiro W=-" not in table
    assert "smallest two-sided Mann-Whitney p possible is 0.33" in table
    assert smallest_p(2, 2) == pytest.approx(1 / 3) and smallest_p(4, 4) == pytest.approx(2 / 70)


def test_capture_of_a_repaired_directory_prints_no_load_report(darts_dir, caplog):
    """Loading a repaired directory as the plain merge (what the capture does) lists its darts.*
    tensors as UNEXPECTED in transformers' load report; our own loads keep that quiet."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mergekit_darts.repair.capture.models import ModelSlot
    hf_logging.enable_propagation()  # let caplog see transformers' records
    try:
        with caplog.at_level(logging.WARNING):
            ModelSlot(darts_dir, device=torch.device("cpu"), dtype=torch.float32).get()
            assert "LOAD REPORT" not in caplog.text and "UNEXPECTED" not in caplog.text
            assert hf_logging.get_verbosity() != hf_logging.ERROR  # restored afterwards
            AutoModelForCausalLM.from_pretrained(darts_dir)  # a plain load does report them
            assert "LOAD REPORT" in caplog.text and "darts.math.up.weight" in caplog.text
    finally:
        hf_logging.disable_propagation()


# --- 10/11. report: held-out KL in the table; the figure with several variants -----------------

def _report(tmp_path, loss, after_scale):
    import torch

    from mergekit_darts.repair.report.measure import bias_by_position

    g = torch.Generator().manual_seed(0)
    merged, expert = torch.randn(3, 12, 4, generator=g), torch.randn(3, 12, 4, generator=g)
    corrected = expert + after_scale * torch.randn(3, 12, 4, generator=g)
    ones = torch.ones(3, 12, dtype=torch.long)
    bias = bias_by_position(merged, expert, ones, (ones.cumsum(-1) - 1), torch.rand(3, 12, generator=g) + 0.1,
                            corrected, bins=6)
    return {"surgery": {"method": "darts", "loss": loss, "rank": 2, "max_positions": 16, "steps": 3, "seed": 0},
            "domains": {d: {"expert": f"/models/{d}", "calibration": {"train": 8, "held_out": 2}, "final_loss": 0.1,
                            "bias": bias, "held_out_kl": {"before": 0.5, "after": 0.5 * after_scale,
                                                          "gap_closed": 1 - after_scale}}
                        for d in ("math", "code")}}


def test_report_table_includes_held_out_kl_and_fits_100_columns(tmp_path):
    from mergekit_darts.repair.report.table import summary_table

    table = summary_table(_report(tmp_path, "kl", 0.25))
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("domain") and "KL before" in line)
    assert "KL after" in header and "gap closed" in header
    math_row = [line for line in lines if line.startswith("math")]
    assert math_row[0].split()[-1] == "-"  # the verdict closes the training table
    assert math_row[1].split()[-3:] == ["0.5", "0.125", "75.0%"]
    # issue 35 item 6: the behaviour columns are explained only where they are shown
    assert "exact match" not in table and "greedy continuation" not in table
    report = _report(tmp_path, "kl", 0.25)
    figures = {"exact_match": 0.5, "top1_agreement": 0.75, "first_disagreement": 3.0}
    report["domains"]["math"]["behaviour"] = {"prompts": 2, "before": figures, "after": figures}
    shown = summary_table(report)
    assert "exact match" in shown and "greedy continuation is the expert's" in shown
    # the widest case: long domain names, depth, a preset
    report = _report(tmp_path, "kl", 0.25)
    report["domains"] = {"instruct": report["domains"]["math"], "mathematics": report["domains"]["code"]}
    report["surgery"].update(depth=1, depth_rank=8, preset="best", head_rank=4, content="linear")
    wide = summary_table(report)
    assert max(len(line) for line in wide.splitlines()) <= 100, wide
    assert "(preset best)" in wide and "  2·2·4096 + 16·4096" in wide and "= 850,944 of" in wide


def test_report_redraws_the_figure_only_when_it_is_stale(darts_dir):
    figure = os.path.join(darts_dir, "darts_bias.png")
    fresh = _cli(["report", darts_dir])
    assert fresh.exit_code == 0 and "is up to date" in fresh.output  # the surgery wrote it after the report
    drawn_at = os.path.getmtime(figure)
    os.utime(os.path.join(darts_dir, "darts_report.json"), (drawn_at + 5, drawn_at + 5))
    stale = _cli(["report", darts_dir])
    assert stale.exit_code == 0 and "re-drew" in stale.output and os.path.getmtime(figure) > drawn_at
    assert "re-drew" in _cli(["report", darts_dir, "--plot"]).output
    assert "darts_bias.png" not in _cli(["report", darts_dir, "--no-plot"]).output


def test_bias_figure_draws_several_variants_without_a_legend_over_data(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mergekit_darts.repair.report.plot import plot_bias, variant_label

    reports = {variant_label(r): r for r in (_report(tmp_path, "ewl1", 0.5), _report(tmp_path, "kl", 0.2))}
    assert list(reports) == ["DARTS + EWL1", "DARTS + KL"]
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))  # keep the figure to inspect it
    path = plot_bias(reports, str(tmp_path / "bias.png"))
    assert open(path, "rb").read(4) == b"\x89PNG"
    fig = figures[0]
    axes = fig.axes
    assert len(axes) == 6  # 3 rows (L1, entropy-weighted L1, KL) x 2 domains; no twin axes
    assert [ax.get_title() for ax in axes[:2]] == ["math", "code"]  # no "math (vs math)"
    assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["merged, no surgery (before)", "after DARTS + EWL1", "after DARTS + KL"]
    bars = [t.get_text() for t in axes[4].get_yticklabels()]
    assert bars == ["merged", "DARTS + EWL1", "DARTS + KL"]
    # the legend sits below every panel
    legend_top = fig.legends[0].get_window_extent().y1
    assert all(ax.get_window_extent().y0 > legend_top for ax in axes)
    # a single report (what every surgery writes) still works
    plot_bias(reports["DARTS + KL"], str(tmp_path / "one.png"))
    # issue 35 item 5: the demo's ten variants with long labels: the legend inside the figure, every
    # variant in its own colour, none the grey of the "before" curve
    many = {f"variant {i}: DARTS + EWL1, rank 16, depth all, preset best": _report(tmp_path, "ewl1", 0.1 * (i + 1))
            for i in range(10)}
    figures.clear()
    plot_bias(many, str(tmp_path / "many.png"))
    fig = figures[0]
    box, legend = fig.bbox, fig.legends[0].get_window_extent()
    assert legend.x0 >= box.x0 and legend.x1 <= box.x1 and legend.y0 >= box.y0, (legend, box)
    assert all(ax.get_window_extent().y0 > legend.y1 for ax in fig.axes)
    colours = [line.get_color() for line in fig.axes[0].get_lines() if line.get_label().startswith("after ")]
    assert len(colours) == 10 and len(set(colours)) == 10 and "0.35" not in colours


# --- 6. benchmarks never replace the committed results unless asked ---------------------------

def test_benchmark_results_go_to_a_new_file_unless_overwrite(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import _common

    monkeypatch.setattr(_common, "RESULTS_DIR", str(tmp_path))
    first = _common.write_json("bench_x", {"run": 1})
    second = _common.write_json("bench_x", {"run": 2})
    assert first == str(tmp_path / "bench_x.json") and second != first
    assert json.loads(open(first).read()) == {"run": 1} and json.loads(open(second).read()) == {"run": 2}
    _common.write_json("bench_x", {"run": 3}, overwrite=True)
    assert json.loads(open(first).read()) == {"run": 3}
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", os.path.relpath(second, tmp_path)], cwd=REPO,
                             capture_output=True, text=True)
    rel = os.path.join("benchmarks", "results", os.path.basename(second))
    assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=REPO).returncode == 0, ignored


def test_license_files_and_paper_citation():
    with open(os.path.join(REPO, "LICENSE")) as handle:
        text = handle.read()
    assert "GNU LESSER GENERAL PUBLIC LICENSE" in text and "Version 3, 29 June 2007" in text
    with open(os.path.join(REPO, "COPYING")) as handle:
        assert "GNU GENERAL PUBLIC LICENSE" in handle.read()
    from mergekit_darts.output.card import card_section

    meta = {"method": "darts", "rank": 2, "max_positions": 8, "head_rank": 0, "loss": "ewl1", "domains": {"math": "m"}}
    section = card_section("LlamaForCausalLM", meta, "math", None, 10, 1000)
    assert "arxiv.org/abs/2608.28547" in section
    # issue 35 item 3: the card's first lines explain the UNEXPECTED darts.* keys of a load without remote code
    head = "\n".join(section.splitlines()[:8])
    assert "trust_remote_code=True" in head and "UNEXPECTED" in head and "docs/loading.md" in head
    loading = open(os.path.join(REPO, "docs", "loading.md")).read()
    assert "UNEXPECTED" in loading and "darts.<domain>.*" in loading
    assert "docs/loading.md#without-trust_remote_code" in open(os.path.join(REPO, "README.md")).read()


# --- issue 26: info prints the router readably, accuracies with their sample sizes ------------

def test_info_prints_the_router_readably_with_sample_sizes():
    from mergekit_darts.cli.describe import info_lines

    router = {"version": 1, "domains": ["math", "code"], "threshold": 0.02, "pooling": "mean_l2", "kind": "centroid",
              "parameters": 134, "tensors": ["darts.router.centroids"], "split": "held_out",
              "accuracy": {"math": 1.0, "code": 0.0}, "mean_accuracy": 0.8,
              "confusion": {"math": {"math": 4, "code": 0, "none": 0}, "code": {"math": 0, "code": 0, "none": 1}},
              "out_of_domain": {"source": "swapped_domains", "by_domain": {"math": 0.0, "code": 1.0}, "none_share": 0.5}}
    info = {"architecture": "DartsLlamaForCausalLM", "content": "relu", "domains": {}, "parameters": 4742,
            "merged_parameters": 26592, "share": 4742 / 26592, "router": router}
    lines = info_lines(info)
    assert "router held-out accuracy: math 100.0% (4/4), code 0.0% (0/1); pooled 80.0% (4/5)" in lines
    assert "router confusion code: math=0 code=0 none=1" in lines
    # issue 35 item 6: a router measured on one record says it is not expected to route well
    assert lines[-1] == ("router note: measured on math 4, code 1 record(s) only; a router trained on this few "
                         "prompts is not expected to route well (docs/routing.md)")
    many = {**router, "confusion": {"math": {"math": 40}, "code": {"code": 30}}}
    assert not any(line.startswith("router note") for line in info_lines({**info, "router": many}))
    assert "depth_rank: - (no block adapters: depth 0)" in info_lines({**info, "depth": 0, "depth_rank": 0})
    assert "depth_rank: 8" in info_lines({**info, "depth": 2, "depth_rank": 8})
    assert "content: relu" in lines and "parameters: 4,742 added (17.832% of the merged model's 26,592)" in lines
    assert not any("{" in line or "mean_accuracy" in line for line in lines)  # no raw dicts, no "mean"
    assert all(len(line) <= 160 for line in lines)


def test_our_own_calls_trigger_no_deprecation_warnings(tiny_family, tmp_path, caplog):
    """A surgery, a remote-code load and a routed generate: no library deprecation points at our code,
    and no deprecation is logged by transformers (whose deprecations are log records, not warnings)."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from helpers import quick_surgery_output

    deprecations = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    hf_logging.enable_propagation()  # let caplog see transformers' records
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            out = quick_surgery_output(tiny_family, tmp_path / "out", tmp_path / "cache", domains=("math", "code"))
            model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="auto")
            tok = AutoTokenizer.from_pretrained(out)
            model.generate(**tok(["what is 1 plus 2 ?"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    finally:
        hf_logging.disable_propagation()
    package = os.path.join(REPO, "mergekit_darts")
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, deprecations)
            and (w.filename.startswith(package) or w.filename.startswith(str(tmp_path)))]
    assert not ours, ours
    logged = [r.getMessage() for r in caplog.records if "deprecat" in r.getMessage().lower()]
    assert not logged, logged


def test_files_the_documented_commands_write_are_git_ignored():
    import subprocess

    written = ["tiny_family/base/config.json", "tiny_offline.yml", "out/config.json", "gen/results.json",
               "baked-math/config.json", "adapters/math/adapter_config.json", "sweep_tiny/results.jsonl",
               "out.plain-merge-20261201-120000/config.json", "darts_compare.json", "darts_demo/results.md"]
    result = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True, text=True)
    assert sorted(result.stdout.split()) == sorted(written)


def test_rerunning_over_an_earlier_result_says_so_in_one_line(tiny_family, tmp_path):
    from helpers import QUICK_TEXTS, merge_yaml, quick_surgery_output

    from mergekit_darts.pipeline import describe_earlier_result

    out = quick_surgery_output(tiny_family, tmp_path / "out", tmp_path / "cache", domains=("math", "code"))
    assert describe_earlier_result(out) == "an earlier repaired merge (domains math, code)"
    assert describe_earlier_result(tiny_family["merged"]) == "an earlier model (a plain merge?)"
    assert describe_earlier_result(str(tmp_path / "nothing")) is None
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n    math:\n      model: {tiny_family['math']}\n"
        f"      calibration: {{texts: {QUICK_TEXTS['math']}, samples: 3}}\n"))
    result = _cli(["surgery", str(cfg), out, "--quiet"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line for line in lines if "holds" in line] == [
        f"mergekit-darts: {out} holds an earlier surgery (domains math, code); it is replaced when this one has finished"]
    assert lines[-1] == f"mergekit-darts: surgery written to {out}"


def test_the_demo_says_what_it_will_do_before_it_starts(tmp_path, monkeypatch):
    from mergekit_darts.cli.demo import plan_lines

    monkeypatch.chdir(tmp_path)
    first = plan_lines("./darts_demo", quick=False)  # the default --workdir
    assert first[0].startswith("mergekit-darts demo:") and "1. train a tiny Llama base and 3 experts" in first[1]
    # issue 35 item 4: an estimate, in the present tense, from the measured 430 s (docs/results.md#times)
    assert first[-1] == "  estimate: about 7.2 min on a 2-core CPU (first run, family trained; docs/results.md#times)"
    assert "430 s" in open(os.path.join(REPO, "docs", "results.md")).read()
    (tmp_path / "darts_demo" / "family").mkdir(parents=True)
    (tmp_path / "darts_demo" / "family" / "family.json").write_text("{}")
    (tmp_path / "darts_demo" / "results.md").write_text("earlier")
    again = plan_lines("./darts_demo", quick=False)
    assert "1. reuse a tiny Llama base" in again[1] and "estimate: about 5.2 min" in again[-1]
    assert any("an earlier demo's results" in line for line in again)
    assert all(len(line) <= 100 for line in first + again)


# --- issue 35 item 7: what the adversarial round found --------------------------------------

def test_info_on_a_broken_report_names_the_file(darts_dir, tmp_path):
    import shutil

    copy = shutil.copytree(darts_dir, tmp_path / "out")
    (copy / "darts_report.json").write_text('{"domains": ')
    result = _cli(["info", str(copy)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Error: {copy / 'darts_report.json'}: not valid JSON" in result.output, result.output


def test_compare_refuses_zero_seeds_before_copying_anything(tiny_family, tmp_path):
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    result = _cli(["compare", str(tmp_path / "cfg.yml"), str(merged), "--seeds", "0"])
    assert result.exit_code == 2 and "--seeds" in result.output and "0 is not in the range" in result.output
    assert sorted(os.listdir(tmp_path)) == ["merged"]  # no scratch copy was started


def test_a_full_disk_during_a_copy_names_the_destination(tmp_path, monkeypatch):
    """shutil's copy error names the source first (the packaged modeling_darts.py): the full disk is the destination's."""
    import errno
    import shutil

    from mergekit_darts.errors import io_error

    source, dest = tmp_path / "modeling_darts.py", tmp_path / "out" / "modeling_darts.py"
    source.write_text("x" * 10_000)
    dest.parent.mkdir()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", full)
    with pytest.raises(OSError) as raised:
        shutil.copyfile(source, dest)
    message = str(io_error(raised.value, "surgery"))
    assert message.startswith(f"surgery: {dest}: No space left on device") and str(source) not in message, message


def test_the_bias_plot_is_drawn_inside_the_output_folder_not_in_tmpdir(tiny_family, tmp_path, monkeypatch):
    """A SIGKILL during the export used to leave $TMPDIR/tmp*/darts_bias.png that nothing cleaned: the plot
    is now drawn in the export's staging folder inside the output, which the next export removes."""
    from helpers import quick_surgery_output
    from mergekit_darts.repair.report import plot

    drawn = []

    def fake_plot(report, path):
        drawn.append(path)
        with open(path, "wb") as handle:
            handle.write(b"png")

    monkeypatch.setattr(plot, "plot_bias", fake_plot)
    out = quick_surgery_output(tiny_family, tmp_path / "out", tmp_path / "cache")
    assert len(drawn) == 1 and os.path.dirname(drawn[0]).startswith(os.path.join(out, ".darts-staging-")), drawn
    assert open(os.path.join(out, "darts_bias.png"), "rb").read() == b"png"
    assert not [n for n in os.listdir(out) if n.startswith(".darts-staging-")]


def test_plain_mergekit_yaml_reports_yaml_syntax_errors_and_lists_in_one_line(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    cases = {"syntax.yml": ("merge_method: linear\nmodels: [a, b\n", "Error: config: not valid YAML: while parsing a "
                            "flow sequence, expected ',' or ']', but got '<stream end>' (line 3, column 1)"),
             "list.yml": ("- model: a\n- model: b\n", "Error: config: the file holds a list of 2 item(s), not a mapping")}
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mergekit-yaml"), name, "out"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1].startswith(expected), result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# --- issue 35 item 6: figures that confused -------------------------------------------------

def test_max_positions_defaults_to_the_models_context_and_warns_only_when_written(tiny_family, tmp_path, caplog):
    """`max_positions: 512` warned "exceeds the model's max_position_embeddings" for a default the user never
    wrote (even with method: standard); the default is now min(512, the model's context), and only a
    written value beyond it warns."""
    import shutil

    from helpers import merge_yaml
    from mergekit_darts.pipeline import run_surgery

    merged = shutil.copytree(tiny_family["merged"], tmp_path / "merged")
    context = json.loads((merged / "config.json").read_text())["max_position_embeddings"]
    assert context < 512
    cfg = merge_yaml(tiny_family) + (
        "surgery:\n  method: standard\n  rank: 2\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n    math:\n      model: {tiny_family['math']}\n"
        "      calibration: {texts: ['what is 1 plus 2 ?', 'add 3 and 4'], samples: 2}\n")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        report = run_surgery(cfg, str(merged))
    assert "max_position_embeddings" not in caplog.text, caplog.text
    assert report["surgery"]["max_positions"] == context
    assert json.loads((merged / "config.json").read_text())["darts"]["max_positions"] == context
    caplog.clear()
    written = cfg.replace("  rank: 2\n", "  rank: 2\n  max_positions: 512\n").replace("  steps: 2\n", "  steps: 0\n")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        report = run_surgery(written, str(merged))
    assert f"surgery.max_positions=512 exceeds the model's max_position_embeddings={context}" in caplog.text
    assert report["surgery"]["max_positions"] == 512


# --- issue 35 item 5: output ----------------------------------------------------------------

def test_surgery_quiet_keeps_the_results_and_a_log_file_gets_lines_not_bars(tiny_family, tmp_path, capfd):
    """`--quiet` hid the per-domain results and router lines too (its help says "No progress bars"); output
    that is not a terminal (a log file) got thousands of tqdm updates instead of a line per stage."""
    import shutil

    from helpers import QUICK_TEXTS, merge_yaml

    merged = str(shutil.copytree(tiny_family["merged"], tmp_path / "merged"))
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n" + "".join(
            f"    {d}:\n      model: {tiny_family[d]}\n      calibration: {{texts: {QUICK_TEXTS[d]}, samples: 3}}\n"
            for d in ("math", "code"))))
    quiet = _cli(["surgery", str(cfg), merged, "--quiet"])
    assert quiet.exit_code == 0, quiet.output
    lines = quiet.output.splitlines()
    assert any(line.startswith("mergekit-darts: math: held-out bias") for line in lines), quiet.output
    assert any(line.startswith("mergekit-darts: router (") for line in lines), quiet.output
    assert not any("capturing hidden states" in line for line in lines)
    logged = _cli(["surgery", str(cfg), merged])  # CliRunner's streams are not terminals, like a log file
    assert logged.exit_code == 0, logged.output
    for stage in ("capturing hidden states: the merged model and 2 expert(s)", "domain math trained (2 steps)",
                  "domain code trained (2 steps)", "exporting the corrections and the router"):
        assert f"mergekit-darts: {stage}" in logged.output, logged.output
    assert "\r" not in logged.output and "it/s" not in logged.output + capfd.readouterr().err


def test_a_worse_domain_is_warned_with_rounded_figures(caplog):
    """compare printed `held-out L1 0.20707011222839355 -> ...` for every worse variant."""
    from mergekit_darts import pipeline
    from mergekit_darts.config import parse_surgery_block

    surgery = parse_surgery_block({"domains": {"math": {"model": "m", "calibration": {"texts": ["a"]}}}})
    verdict = {"status": "worse", "measured_on": "held-out records", "metric": "L1",
               "before": 0.20707011222839355, "after": 0.2314159265358979}
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        getattr(pipeline, "_checked_default")({"domains": {"math": {"verdict": verdict}}}, surgery)
    assert "(L1 0.2071 -> 0.2314)" in caplog.text and "0.20707011" not in caplog.text, caplog.text


def test_eval_without_the_extra_says_so_before_any_context_warning(tmp_path, monkeypatch, caplog):
    import sys

    from mergekit_darts.tiny import make_random_model

    model_dir = str(tmp_path / "ctx128")
    make_random_model(model_dir, seed=0, max_position_embeddings=128)  # would warn: 512 tokens do not fit
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # the [eval] extra not installed
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        with pytest.raises(EvaluationError, match=r"needs the \[eval\] extra"):
            evaluate(model_dir, "none", ["gsm8k_darts"], limit=1, device="cpu")
    assert "context of 128 tokens" not in caplog.text, caplog.text
