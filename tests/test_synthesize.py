"""``calibration.synthesize``: prompts written by the expert from the user's training prompts, filtered,
never near a held-out prompt, seeded, cached, answered like the user's (docs/quality.md)."""

import logging
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers import merge_yaml

from mergekit_darts.repair.capture.synthesize import is_near_duplicate, split_prompts, synthesize_prompts

BOS, EOS, PAD, ENDING = 1, 2, 3, [30, 31]


class ScriptedWriter:
    """Stands in for an expert: after any prefix it writes 1-4 random content tokens (10-19), the
    prompts' ending, then noise; every fifth row it writes the held-out prompt ``copy`` instead, and
    every seventh a special token. Records the prefixes it was given."""

    def __init__(self, copy):
        self.copy, self.prefixes = copy, []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            self.prefixes.append(ids[mask.bool()].tolist())
            k = len(self.prefixes)
            if k % 5 == 0:
                new = self.copy[1:] + [20] * 8
            else:
                new = torch.randint(10, 20, (int(torch.randint(1, 5, ())),)).tolist()
                new += ([PAD] if k % 7 == 0 else []) + ENDING + [20] * 8
            rows.append(ids.tolist() + new[:max_new_tokens] + [PAD] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


CTX = SimpleNamespace(batch_size=4, max_positions=64, pad_id=PAD, progress=False, lines=False, device=torch.device("cpu"))
TRAIN = [[BOS, 10, 11, 12, *ENDING], [BOS, 13, 14, *ENDING], [BOS, 15, 16, 17, 18, *ENDING]]
HELD = [[BOS, 19, 18, 17, *ENDING]]


def _run(seed, count=12, writer=None):
    writer = writer or ScriptedWriter(HELD[0])
    rows, stats = synthesize_prompts(writer, TRAIN, HELD, count, CTX, temperature=1.0, seed=seed,
                                     stop_ids={EOS}, special_ids={BOS, EOS, PAD}, desc="test")
    return rows, stats, writer


def test_shared_beginning_and_ending():
    assert split_prompts(TRAIN + HELD) == (1, 2)
    assert split_prompts([[1, 5, 6, 7]]) == (1, 0)  # one prompt: only its first token is "shared"


def test_near_duplicates():
    held = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert is_near_duplicate([1, *held, 2], held)  # contains it
    assert is_near_duplicate([5, 6, 7, 8, 9, 10, 11, 12, 13, 99], held)  # one token changed of ten
    assert not is_near_duplicate([5, 6, 7, 8, 40, 41, 42, 12, 13, 14], held)


def test_synthesized_prompts_are_filtered_new_and_seeded():
    rows, stats, writer = _run(seed=3)
    assert stats["kept"] == len(rows) == 12 and stats["requested"] == 12
    assert stats["near_held_out"] > 0 and stats["special"] > 0  # the writer's copies and specials were caught
    seen = {tuple(row) for row in TRAIN + HELD}
    for row in rows:
        assert row[0] == BOS and row[-2:] == ENDING and 4 <= len(row) <= 9  # complete, as long as the user's
        assert PAD not in row and tuple(row) not in seen
        assert not is_near_duplicate(row[1:-2], HELD[0][1:-2])
        seen.add(tuple(row))
    # every prefix is the beginning of a training prompt: a held-out prompt never seeds the expert
    assert all(any(p == t[:len(p)] and len(p) > 1 for t in TRAIN) for p in writer.prefixes)
    assert _run(seed=3)[0] == rows  # seeded
    assert _run(seed=4)[0] != rows


def test_too_few_acceptable_prompts_are_reported(caplog):
    class Copier(ScriptedWriter):
        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            self.prefixes += [None] * len(input_ids)
            return torch.cat([input_ids, torch.tensor([HELD[0][1:]] * len(input_ids))], dim=1)

    with caplog.at_level(logging.WARNING):
        rows, stats, _ = _run(seed=0, count=5, writer=Copier(HELD[0]))
    assert rows == [] and stats["kept"] == 0 and stats["near_held_out"] + stats["duplicate"] == stats["sampled"]
    assert "acceptable prompt(s) of the 5 asked for" in caplog.text


def test_synthesis_shows_its_progress(caplog, capsys):
    """Issue 34: a long synthesis said nothing for minutes. One log line per round, and with progress on,
    a bar of the prompts kept over all rounds (besides each round's sampling bar)."""
    with caplog.at_level(logging.INFO, logger="mergekit_darts.repair.capture.synthesize"):
        rows, stats, _ = _run(seed=3)
    rounds = [r.getMessage() for r in caplog.records if "round" in r.getMessage()]
    assert rounds and rounds[0].startswith("test: round 1 of at most 12: sampling ") and "0 of 12 kept" in rounds[0]
    shown = SimpleNamespace(**{**vars(CTX), "progress": True})
    synthesize_prompts(ScriptedWriter(HELD[0]), TRAIN, HELD, 12, shown, temperature=1.0, seed=3, stop_ids={EOS},
                       special_ids={BOS, EOS, PAD}, desc="test")
    assert "test: prompts kept: 100%" in capsys.readouterr().err


TEXTS = ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4", "the sum of two numbers",
         "count the apples", "what is 5 minus 1 ?"]


def _config(family, cache, synthesize, writer=None):
    extra = f", synthesize: {synthesize}" if synthesize else ""
    extra += f", synthesize_writer: {writer}" if writer else ""
    return merge_yaml(family) + (
        "surgery:\n  rank: 2\n  max_positions: 24\n  steps: 5\n  loss: kl\n  device: cpu\n  dtype: float32\n"
        f"  seed: 0\n  held_out: 0.5\n  cache_dir: {cache}\n  domains:\n"
        f"    math:\n      model: {family['math']}\n"
        f"      calibration: {{texts: {TEXTS}, samples: 6, continue_tokens: 3{extra}}}\n")


def test_pipeline_trains_on_synthesized_prompts_and_holds_out_the_same_ones(tiny_family, tmp_path, caplog):
    """The expert's prompts only add training records: the held-out records (and so the merge's
    held-out KL) are those of the run without them; a rerun takes the prompts from the cache."""
    from mergekit_darts.pipeline import run_surgery

    plain_out, out = tmp_path / "plain", tmp_path / "out"
    shutil.copytree(tiny_family["merged"], plain_out)
    shutil.copytree(tiny_family["merged"], out)
    plain = run_surgery(_config(tiny_family, tmp_path / "cache", 0), str(plain_out))["domains"]["math"]
    report = run_surgery(_config(tiny_family, tmp_path / "cache", 4), str(out))["domains"]["math"]
    synthesis = report["calibration"]["synthesis"]
    assert synthesis["requested"] == 4 and 0 < synthesis["kept"] <= 4
    assert report["calibration"]["held_out"] == plain["calibration"]["held_out"] == 3
    assert report["calibration"]["train"] == 3 + synthesis["kept"]
    assert report["held_out_kl"]["before"] == pytest.approx(plain["held_out_kl"]["before"], rel=1e-6)
    # the same held-out prompts and expert continuations (3 prompts: counted, no score below the minimum)
    counts = ("prompts", "empty_continuations", "expert_tokens", "stopped_before_budget")
    assert {k: report["behaviour"][k] for k in counts} == {k: plain["behaviour"][k] for k in counts}
    with caplog.at_level(logging.INFO):
        again = run_surgery(_config(tiny_family, tmp_path / "cache", 4), str(out))["domains"]["math"]
    assert "capture cache: hit" in caplog.text and "synthesized.math" in caplog.text
    assert again["calibration"]["synthesis"] == synthesis


def test_synthesize_is_validated():
    from mergekit_darts.config import CalibrationConfig

    with pytest.raises(ValueError, match="synthesize"):
        CalibrationConfig(texts=["a"], synthesize=-1)
    assert CalibrationConfig(texts=["a"], synthesize=3).synthesize == 3
    with pytest.raises(ValueError, match="synthesize_writer needs synthesize > 0"):
        CalibrationConfig(texts=["a"], synthesize_writer="base")


def test_another_model_can_write_the_prompts(tiny_family, tmp_path):
    """``synthesize_writer``: the base model writes, the expert answers; a writer of another family is
    refused with the field's name."""
    from mergekit_darts.errors import SurgeryConfigError
    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.tiny import make_random_model

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    by_expert = run_surgery(_config(tiny_family, tmp_path / "cache", 4), str(out))["domains"]["math"]
    by_base = run_surgery(_config(tiny_family, tmp_path / "cache", 4, tiny_family["base"]), str(out))["domains"]["math"]
    assert by_base["calibration"]["synthesis"]["kept"] > 0
    assert by_base["calibration"]["held_out"] == by_expert["calibration"]["held_out"]
    # cached per writer (the tiny experts are the base plus a small delta: they may sample alike)
    assert len(list((tmp_path / "cache").glob("synthesized.math.*.safetensors"))) == 2
    other = tmp_path / "other"
    make_random_model(str(other), seed=3, vocab_size=77)
    with pytest.raises(SurgeryConfigError, match="calibration.synthesize_writer: .*vocabulary"):
        run_surgery(_config(tiny_family, tmp_path / "cache", 4, other), str(out))
    # checked before any capture, like an expert path (test_preflight_checks.py runs it before a merge)
    with pytest.raises(SurgeryConfigError, match="calibration.synthesize_writer: no such directory"):
        run_surgery(_config(tiny_family, tmp_path / "cache", 4, tmp_path / "missing"), str(out))


def test_a_long_synthesis_prints_lines_to_a_log_file(tiny_family, tmp_path, capfd, monkeypatch):
    """Issue 46 item 9: `synthesize: 1600` ran minutes with no output when stderr was a file. Through the
    pipeline with stderr captured to a file, the sampling rounds and the prompts kept print a line every
    few seconds (here every 0 s), the last one marked done."""
    from mergekit_darts import console
    from mergekit_darts.pipeline import run_surgery

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    run_surgery(_config(tiny_family, tmp_path / "cache", 4), str(out))
    err = capfd.readouterr().err
    assert "mergekit-darts: synthesize · math (round 1): 1/" in err and " batches, " in err
    assert re.search(r"synthesize · math: prompts kept: [1-4]/4 prompts, \d+ s \(done\)\n", err), err
    assert "\r" not in err
