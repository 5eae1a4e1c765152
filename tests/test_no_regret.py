"""No regret (issue 45 ask 2): each domain's trained correction is compared with its untrained start
(the data-free extract with ``adapter_init: delta``, the identity with the zero start) and the better
one ships; the report, ``mergekit-darts report`` and the card say which and by how much. The baseline's
texts and sizes (ask 4)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import QUICK_TEXTS, merge_yaml


def _preset_config(family, root, steps, lr):
    domains = "".join(f"    {name}:\n      model: {family[name]}\n"
                      f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code"))
    return merge_yaml(family) + (
        "surgery:\n  preset: best\n  rank: 2\n  depth_rank: 2\n  head_rank: 2\n  max_positions: 16\n"
        f"  steps: {steps}\n  lr: {lr}\n  device: cpu\n  held_out: 0.34\n  cache_dir: {root / 'cache'}\n"
        "  domains:\n" + domains)


def _command(name):
    return str(Path(sys.executable).parent / name)


@pytest.fixture(scope="module")
def overshot(tiny_family, tmp_path_factory):
    """``preset: best`` through the unchanged ``mergekit-yaml`` with an lr that wrecks every adapter
    (lr 5: each Adam step moves every parameter by about 5), and the same merge at ``steps: 0``."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("overshot")
    config = root / "cfg.yml"
    config.write_text(_preset_config(tiny_family, root, steps=6, lr=5.0))
    out = root / "out"
    result = subprocess.run([_command("mergekit-yaml"), str(config), str(out)], cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    untrained = root / "untrained"
    shutil.copytree(out, untrained)
    run_surgery(_preset_config(tiny_family, root, steps=0, lr=5.0), str(untrained))
    return out, untrained, result.stderr


def test_a_training_that_makes_things_worse_ships_the_extract(overshot):
    out, untrained, stderr = overshot
    report = json.loads((out / "darts_report.json").read_text())
    shipped, start = load_file(str(out / "darts.safetensors")), load_file(str(untrained / "darts.safetensors"))
    assert set(shipped) == set(start)
    for name, entry in report["domains"].items():
        record = entry["no_regret"]
        assert record["kept"] == "start" and record["start"] == "data-free extract"
        # the preset trains its steps without early stopping, so there is no validation split and the
        # held-out records decide, and it says so
        assert record["compared_on"] == "held_out" and record["trained"] > record["untrained"]
        assert record["margin"] == pytest.approx(record["untrained"] - record["trained"])
        # the training would have been far worse on the report's records too
        assert record["other_held_out_kl"] > entry["held_out_kl"]["after"]
        # what ships is the extract: its held-out figures are the baseline's
        assert entry["held_out_kl"]["after"] == pytest.approx(entry["baseline"]["held_out_kl"]["after"], rel=1e-6)
    assert report["surgery"]["early_stopping"] is False and "fitted" not in report["surgery"]["preset_settings"]
    for key, tensor in shipped.items():  # every tensor of every domain is the untrained start's, exactly
        assert torch.equal(tensor, start[key]), key
    assert "no regret: kept the untrained start (data-free extract): training did not beat it" in stderr
    table = subprocess.run([_command("mergekit-darts"), "report", str(out)], capture_output=True, text=True,
                           timeout=300)
    assert table.returncode == 0, table.stderr
    assert "no regret math: kept the untrained start (data-free extract)" in " ".join(table.stdout.split())
    card = (out / "README.md").read_text()
    assert "kept the untrained start (data-free extract)" in card
    assert "No regret shipped the untrained start for math, code: its 'trained' cells are that start's." in card


def test_the_zero_start_ships_the_identity_when_training_hurts(tiny_family, merged_copy, tmp_path):
    """An lr that overshoots from the paper's zero start (no validation split: the held-out records
    decide): the identity ships (``up`` and the table exactly zero), the verdict is "unchanged" and the
    default domain the plain merge, each with the reason."""
    from mergekit_darts.pipeline import run_surgery, summary_lines
    from test_reliability import _config

    report = run_surgery(_config(tiny_family, tmp_path, lr=3.0, loss="l1", content="linear", default_domain="math"),
                         merged_copy, progress=False)
    entry = report["domains"]["math"]
    assert entry["no_regret"]["kept"] == "start" and entry["no_regret"]["start"] == "identity"
    assert entry["no_regret"]["compared_on"] == "held_out"
    darts = load_file(f"{merged_copy}/darts.safetensors")
    assert not darts["darts.math.up.weight"].any() and not darts["darts.math.position_bias"].any()
    assert entry["held_out_kl"]["after"] == entry["held_out_kl"]["before"]
    verdict = entry["verdict"]
    assert verdict["status"] == "unchanged" and "identity" in verdict["why"]
    assert report["default_domain"]["used"] == "none"
    assert report["default_domain"]["reason"].startswith("no better than the plain merge (the untrained start")
    lines = summary_lines(report)
    assert any("no regret: kept the untrained start (identity)" in line and "no validation split" in line
               for line in lines)
    assert any("WARNING: no better than the plain merge" in line for line in lines)


@pytest.fixture(scope="module")
def head_only(tiny_family, tmp_path_factory):
    """A head correction only (depth 0, head_rank 2) at steps: 0 from the zero start, no continuations."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("head_only")
    out = root / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  head_rank: 2\n  max_positions: 16\n  steps: 0\n  loss: kl\n  device: cpu\n"
        f"  dtype: float32\n  held_out: 0.34\n  cache_dir: {root / 'cache'}\n  domains:\n"
        + "".join(f"    {name}:\n      model: {tiny_family[name]}\n"
                  f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code")))
    return out, run_surgery(config, str(out))


def test_an_exact_tie_is_unchanged(head_only):
    """Issue 46 item 1: steps 0 from the zero start gave "improved" on KL before = after."""
    _, report = head_only
    for entry in report["domains"].values():
        assert entry["held_out_kl"]["after"] == entry["held_out_kl"]["before"]
        assert entry["verdict"]["status"] == "unchanged"
    from mergekit_darts.repair.report.verdict import domain_verdict

    tie = {**report["domains"]["math"], "no_regret": None}  # without the no-regret record: the tie itself decides
    assert domain_verdict(tie, "kl")["status"] == "unchanged" and "exact tie" in domain_verdict(tie, "kl")["why"]


def test_head_only_report_reads_as_one_table_per_topic(head_only):
    """Issue 46 item 12 and 45 ask 4: the baseline table of a head-only run does not wrap into a second
    table of '-' cells; exact match is not measured, said once and why; both parameter counts shown;
    the texts say zero start (nothing 'added to' the extract); train s + measure s is the stage."""
    from mergekit_darts.repair.report.table import render_report

    out, report = head_only
    table = render_report(str(out), plot=False)
    lines = table.splitlines()
    headers = [line for line in lines if line.startswith("domain")]
    assert len(headers) == 3 and all("exact match" not in line for line in headers)  # training, measured, baseline
    assert len([line for line in lines if line.startswith("exact match: not measured")]) == 1
    assert "continue_tokens is 0" in table and all(len(line) <= 100 for line in lines)
    assert "beside the correction trained from the zero start" in " ".join(lines)
    assert "added to" not in table and "same size" not in table
    for name, entry in report["domains"].items():
        row = next(line for line in lines if line.startswith(name) and "head 2" in line)
        assert f"{entry['baseline']['parameters']:,} | {entry['parameters']:,}" in row
        assert entry["parameters"] > entry["baseline"]["parameters"]  # + the content module and the table
        stage = report["stages"][f"train:{name}"]["seconds"]
        assert entry["train_seconds"] + entry["measure_seconds"] == pytest.approx(stage, abs=0.5)
    card = (out / "README.md").read_text()
    assert "Greedy exact match: not measured (calibration.continue_tokens is 0" in card
    assert "| Parameters: extract / trained |" in card and "Greedy exact match: extract" not in card


def test_held_out_0_baseline_text_says_training_records():
    from mergekit_darts.repair.report.table import baseline_intro

    report = {"surgery": {"adapter_init": "delta", "rank": 64, "method": "darts", "max_positions": 512},
              "domains": {"math": {"bias_split": "train"}}}
    intro = baseline_intro(report)
    assert "same training records" in intro and "held-out records" not in intro
    assert "started from" in intro and "rank-64 content correction and a 512-position table" in intro


def test_the_synthesize_writer_is_named_in_the_warning(caplog):
    """Issue 46 item 12: with synthesize_writer the warning said 'the expert wrote'."""
    import logging
    from types import SimpleNamespace

    from mergekit_darts.repair.capture.synthesize import writer_name
    from mergekit_darts.repair.capture.synthesize import synthesize_prompts
    from test_synthesize import BOS, CTX, EOS, HELD, PAD, TRAIN, ScriptedWriter

    class Copier(ScriptedWriter):  # writes only copies of a held-out prompt: none is acceptable
        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            self.prefixes += [None] * len(input_ids)
            return torch.cat([input_ids, torch.tensor([HELD[0][1:]] * len(input_ids))], dim=1)

    spec = SimpleNamespace(synthesize_writer="/models/base")
    assert writer_name(spec) == "the synthesize_writer (/models/base)"
    assert writer_name(SimpleNamespace(synthesize_writer=None)) == "the expert"
    with caplog.at_level(logging.WARNING):
        synthesize_prompts(Copier(HELD[0]), TRAIN, HELD, 5, CTX, temperature=1.0, seed=0, stop_ids={EOS},
                           special_ids={BOS, EOS, PAD}, desc="test", writer=writer_name(spec))
    assert "the synthesize_writer (/models/base) wrote 0 acceptable prompt(s)" in caplog.text
    assert "the expert wrote" not in caplog.text


def test_verdict_unit_cases():
    """Issue 46 item 1 on hand-made entries: improved needs the behaviour figures to get no worse (else
    mixed, with why), and when neither moved the KL to the expert to improve (issue 54: a tie on behaviour
    is said, with its prompt count, and is no verdict of "no better"); a worse objective stays worse."""
    from mergekit_darts.repair.report.verdict import choose_default, domain_verdict, verdict_note

    def entry(kl, exact, top1):
        figures = lambda i: {"exact_match": exact[i], "top1_agreement": top1[i], "first_disagreement": 1.0}
        return {"held_out_kl": {"before": kl[0], "after": kl[1]}, "bias": {},
                "behaviour": {"prompts": 10, "before": figures(0), "after": figures(1)}}

    assert domain_verdict(entry((0.5, 0.4), (0.2, 0.3), (0.5, 0.5)), "kl")["status"] == "improved"
    assert "why" not in domain_verdict(entry((0.5, 0.4), (0.2, 0.2), (0.5, 0.6)), "kl")
    mixed = domain_verdict(entry((0.5, 0.4), (0.3, 0.2), (0.5, 0.6)), "kl")
    assert mixed["status"] == "mixed" and mixed["why"] == "KL to expert improved but greedy exact match got worse (0.3 -> 0.2)"
    assert verdict_note(mixed).count("greedy exact match") == 1  # said once, not again as a disagreeing figure
    # issue 54: a tie on behaviour is no evidence of no gain; the distribution figure decides, the tie is said
    still = domain_verdict(entry((0.5, 0.4), (0.3, 0.3), (0.5, 0.5)), "kl")
    assert still["status"] == "improved" and "why" not in still
    assert still["behaviour_tie"] == ("no greedy decision changed on the 10 held-out prompts (greedy exact match "
                                      "0.3 -> 0.3, top-1 agreement 0.5 -> 0.5): a tie on behaviour, not evidence of "
                                      "no gain; the distribution improved (KL to expert 0.5 -> 0.4)")
    assert still["behaviour_tie"] in verdict_note(still)
    ceiling = domain_verdict(entry((0.5275, 0.04126), (1.0, 1.0), (1.0, 1.0)), "kl")
    assert ceiling["status"] == "improved" and "already wrote the expert's continuation on every one" in \
        ceiling["behaviour_tie"]
    # a hidden-state objective that improved while neither behaviour nor the KL did is no better
    flat = dict(entry((0.5, 0.6), (0.3, 0.3), (0.5, 0.5)), held_out_loss={"before": 2.0, "after": 1.0})
    unchanged = domain_verdict(flat, "ewl1")
    assert unchanged["status"] == "unchanged" and "behaviour_tie" not in unchanged
    assert unchanged["why"].startswith("ewl1 loss improved (2 -> 1) but the KL to the expert did not (0.5 -> 0.6)")
    assert "no greedy decision changed on the 10 held-out prompts" in unchanged["why"]
    improved_kl = dict(flat, held_out_kl={"before": 0.5, "after": 0.4})
    assert domain_verdict(improved_kl, "ewl1")["status"] == "improved"
    tie = domain_verdict(entry((0.5, 0.5), (0.3, 0.3), (0.5, 0.5)), "kl")
    assert tie["status"] == "unchanged" and tie["why"].startswith("an exact tie")
    worse = domain_verdict(entry((0.5, 0.6), (0.3, 0.4), (0.5, 0.5)), "kl")
    assert worse["status"] == "worse" and [d["metric"] for d in worse["disagreeing"]] == ["greedy exact match"]
    no_behaviour = {"held_out_kl": {"before": 0.5, "after": 0.4}, "bias": {}}
    assert domain_verdict(no_behaviour, "kl")["status"] == "improved"  # nothing measured can overrule it
    report = {"domains": {"math": {"verdict": mixed}}}
    assert choose_default(report, "math", allow_worse=False) == "none"
    assert report["default_domain"]["reason"].startswith("mixed against the plain merge (KL to expert improved")
    assert choose_default(report, "math", allow_worse=True) == "math"


def test_with_a_validation_split_the_choice_is_made_there(merged_copy, tiny_family):
    """early_stopping + lr_candidates keep a validation split: the comparison is made on it (never on the
    held-out records), the trained side being the selected run's own validation loss from before its
    refit. Early stopping evaluates step 0 (the start), so the trained side can only tie or win."""
    from mergekit_darts.pipeline import run_surgery

    config = merge_yaml(tiny_family) + (
        "surgery:\n  loss: kl\n  steps: 12\n  rank: 2\n  head_rank: 4\n  max_positions: 32\n  device: cpu\n"
        "  early_stopping: true\n  eval_every: 3\n  lr_candidates: [1.0e-3, 1.0e-2]\n  held_out: 0.25\n"
        "  validation: 0.5\n  domains:\n"
        f"    math:\n      model: {tiny_family['math']}\n      calibration:\n"
        "        texts: [a b c, what is 2 + 3, how many apples, def sum list, print total, apples]\n")
    entry = run_surgery(config, merged_copy, progress=False)["domains"]["math"]
    record, selection = entry["no_regret"], entry["selection"]
    assert record["compared_on"] == "validation" and record["records"] == entry["calibration"]["validation"] == 2
    assert record["trained"] == selection["validation_loss"] and record["trained"] <= record["untrained"]
    assert record["kept"] == ("start" if selection["steps"] == 0 else "trained")
    # refit (the default): what ships when trained is the refit run, which was not itself compared (issue 53 ask 6)
    assert record["refit"] is True and selection["refit_records"] == 4


def test_the_report_says_a_shipped_refit_was_not_compared_with_the_start():
    """With a refit the trained side of the comparison is the selected run before its refit; when the
    trained correction ships, it is the refit one: the text says so and gives both held-out KLs."""
    from mergekit_darts.repair.report.table import no_regret_text

    record = {"kept": "trained", "start": "data-free extract", "compared_on": "validation", "records": 8,
              "metric": "kl loss", "trained": 0.2, "untrained": 0.4, "margin": 0.2, "other_held_out_kl": 0.45}
    entry = {"held_out_kl": {"before": 0.9, "after": 0.3}, "no_regret": {**record, "refit": True}}
    assert no_regret_text(entry) == (
        "kept the trained correction: kl loss 0.2 trained against 0.4 untrained (50.0% lower) on the validation "
        "split (8 records); the trained side is the selected run before its refit: the shipped correction is "
        "that run refit on the training and validation records, which was not compared with the start "
        "(held-out KL to the expert: 0.3 shipped, 0.45 the start)")
    assert "refit" not in no_regret_text({**entry, "no_regret": record})  # no refit: what was compared ships
    assert "refit" not in no_regret_text({**entry, "no_regret": {**record, "refit": True, "kept": "start"}})
