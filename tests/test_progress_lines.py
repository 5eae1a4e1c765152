"""console.ProgressLines: what a long stage prints to a log file instead of a tqdm bar (issue 46 item 9)."""

import io

from mergekit_darts.console import ProgressLines, progress_iter


def test_a_short_stage_prints_nothing_a_long_one_a_line_per_interval():
    quiet = io.StringIO()
    with ProgressLines(3, "capture", unit="batches", every=3600.0, stream=quiet) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""  # seconds of work: no line

    shown = io.StringIO()
    bar = ProgressLines(None, "sampling", unit="batches", every=0.0, stream=shown)
    bar.set_postfix(loss="0.5")
    bar.update(2)
    bar.close()
    bar.close()
    assert shown.getvalue().splitlines()[0].startswith("mergekit-darts: sampling: 2 batches, loss 0.5, ")
    assert len(shown.getvalue().splitlines()) == 1  # the last line already showed the count: no repeat

    stopped = io.StringIO()
    bar = ProgressLines(10, "train", unit="steps", every=0.0, stream=stopped)
    bar.update(1)
    bar.every = 3600.0  # the next updates come too soon for a line of their own
    bar.update(2)
    bar.close()
    lines = stopped.getvalue().splitlines()
    assert lines[0].startswith("mergekit-darts: train: 1/10 steps, ") and not lines[0].endswith("(done)")
    assert lines[1].startswith("mergekit-darts: train: 3/10 steps, ") and lines[1].endswith(" s (done)")


def test_progress_iter_without_bars_or_lines_only_iterates(capfd):
    assert list(progress_iter(range(4), "x", bars=False, lines=False)) == [0, 1, 2, 3]
    assert capfd.readouterr().err == ""


def test_training_prints_step_lines_to_a_log_file_and_a_last_line_when_it_stops_early(monkeypatch, capsys):
    import torch

    from mergekit_darts import console
    from mergekit_darts.remote_code.surgery import DomainSurgery
    from mergekit_darts.repair.train.loop import train_surgery

    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)  # every step is "a few seconds" later
    torch.manual_seed(0)
    merged, target = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    mask, positions = torch.ones(4, 6, dtype=torch.bool), torch.arange(6).expand(4, 6)

    def run(**kwargs):
        train_surgery(DomainSurgery(16, rank=2, max_positions=8), merged, target, mask, positions,
                      loss="l1", steps=5, desc="surgery[math]", **kwargs)
        return capsys.readouterr().err.splitlines()

    assert run() == []  # a library call (no lines asked for) prints nothing
    lines = run(lines=True)
    assert lines[0].startswith("mergekit-darts: surgery[math]: 1/5 steps, ")
    assert lines[-1].startswith("mergekit-darts: surgery[math]: 5/5 steps, ") and lines[-1].endswith("(done)")
    stopped = run(lines=True, on_step=lambda step, module: step == 2)
    assert stopped[-1].startswith("mergekit-darts: surgery[math]: 2/5 steps, ")
