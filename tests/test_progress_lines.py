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
