"""How the library's log records reach a person running a command.

Library modules log with ``logging.getLogger(__name__)`` and print nothing themselves. A command
(``mergekit-darts ...`` or ``mergekit-yaml`` through the hook) wraps its run in ``user_logging()``:
records of the ``mergekit_darts`` loggers are then printed as ``mergekit-darts: warning: ...``
(not mergekit's ``WARNING:mergekit_darts.repair.capture.calibration:...`` root format), and each distinct
message only once per run, because ``compare`` and the demo run the same steps many times and the
same warning about the same input says nothing new the second time. Outside a command (tests,
library use) records propagate to the root logger untouched.
"""

import contextlib
import logging
import os
import sys
import time
from typing import Iterable, Iterator, List, Optional, TextIO

LOGGER = "mergekit_darts"


class OncePerRun(logging.Filter):
    """Passes a record only the first time its (level, formatted message) is seen."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"mergekit-darts: {level}{record.getMessage()}"


@contextlib.contextmanager
def user_logging(stream: Optional[TextIO] = None, level: int = logging.WARNING) -> Iterator[OncePerRun]:
    """Print ``mergekit_darts`` log records at ``level`` and above to ``stream`` (stderr), once each,
    for the duration of a command; the logger's previous state is restored afterwards."""
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter())
    once = OncePerRun()
    handler.addFilter(once)
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # mergekit's basicConfig root handler would print it a second time
    try:
        yield once
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


# --- third-party noise: known messages that say nothing to a user of these commands ---------------

# logger name -> message starts that are dropped unless verbose. Each is printed by a library on
# every run for reasons the user cannot act on: mergekit sets ``config.torch_dtype`` when it writes
# the merged config (transformers 5 deprecates the name); bitsandbytes tries an optional kernels
# package at import on CPUs with AVX512-BF16 and warns that it is absent.
THIRD_PARTY_NOISE = {
    "transformers.configuration_utils": ("`torch_dtype` is deprecated",),
    "transformers.modeling_utils": ("`torch_dtype` is deprecated",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}
VERBOSE_ENV = "MERGEKIT_DARTS_VERBOSE"


def verbose() -> bool:
    """``--verbose`` / ``-v`` on the command line (ours or mergekit's), or MERGEKIT_DARTS_VERBOSE=1."""
    if os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return True
    return any(arg == "--verbose" or (arg.startswith("-v") and set(arg[1:]) == {"v"}) for arg in sys.argv[1:])


class KnownNoise(logging.Filter):
    """Drops the records of ``THIRD_PARTY_NOISE`` (decided per record, so ``-v`` seen late still counts)."""

    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        if verbose():
            return True
        return not str(record.msg).startswith(self.prefixes)


def filter_third_party_noise() -> None:
    """Install the ``KnownNoise`` filters (once). The loggers need not exist yet: a library's
    ``getLogger(__name__)`` later returns the same logger, filter included."""
    for name, prefixes in THIRD_PARTY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNoise) for f in logger.filters):
            logger.addFilter(KnownNoise(prefixes))


# --- text that several commands print the same way (torch-free: `info` and `report` use it) -----

def before_after(values: Optional[dict], label: str, digits: int = 4) -> Optional[str]:
    """``"label a -> b"`` from a {"before"/"mean_before", "after"/"mean_after"} entry, or None."""
    values = values or {}
    before = values.get("mean_before", values.get("before"))
    after = values.get("mean_after", values.get("after"))
    if before is None or after is None:
        return None
    return f"{label} {before:.{digits}f} -> {after:.{digits}f}"


def share(count: int, total: int) -> str:
    """``"80.0% (4/5)"``: a share always with the count it was measured on (one record is not 0 %)."""
    return f"{100 * count / total:.1f}% ({count}/{total})" if total else "- (no records)"


def routing_accuracy(entry: dict) -> str:
    """Per-domain routing accuracy with its sample size, then the share over all records pooled:
    ``math 100.0% (4/4), code 0.0% (0/1); pooled 80.0% (4/5)``."""
    confusion = entry.get("confusion") or {}
    parts, right, total = [], 0, 0
    for name, row in confusion.items():
        count = sum(row.values())
        parts.append(f"{name} {share(row.get(name, 0), count)}")
        right, total = right + row.get(name, 0), total + count
    if not parts:  # an entry without its confusion matrix: the rates alone
        return ", ".join(f"{name} {'-' if value is None else f'{100 * value:.1f}%'}"
                         for name, value in (entry.get("accuracy") or {}).items())
    return ", ".join(parts) + (f"; pooled {share(right, total)}" if len(parts) > 1 else "")


# Below this many held-out records in a domain, a routing accuracy says little and the router itself
# was trained on a handful of prompts (the offline example's code domain has 6, one held out).
FEW_ROUTER_RECORDS = 10


def few_records_note(entry: dict) -> Optional[str]:
    """A line saying that a router measured on very few records is not expected to route well, or None."""
    counts = {name: sum(row.values()) for name, row in (entry.get("confusion") or {}).items()}
    few = {name: count for name, count in counts.items() if count < FEW_ROUTER_RECORDS}
    if not few:
        return None
    listed = ", ".join(f"{name} {count}" for name, count in few.items())
    return (f"router note: measured on {listed} record(s) only; a router trained on this few prompts is not "
            "expected to route well (docs/routing.md)")


WIDTH = 100  # the widest line a command prints (tables are split, prose wrapped, to fit)


def format_table(rows: List[List[str]], width: int = WIDTH, keep: int = 1) -> List[str]:
    """A plain-text table (first row the header, a rule under it). Wider than ``width``: the columns
    after the first ``keep`` are split into several tables, one under the other, each repeating them."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    blocks, current = [], []
    kept = sum(widths[:keep]) + 2 * keep
    for index in range(keep, len(widths)):
        used = kept + sum(widths[i] + 2 for i in current)
        if current and used + widths[index] > width:
            blocks.append(current)
            current = []
        current.append(index)
    blocks.append(current)
    lines = []
    for number, block in enumerate(blocks):
        columns = list(range(keep)) + block
        if number:
            lines.append("")
        for row_index, row in enumerate(rows):
            lines.append("  ".join(row[i].ljust(widths[i]) for i in columns).rstrip())
            if row_index == 0:
                lines.append("  ".join("-" * widths[i] for i in columns))
    return lines


def pack(items: List[str], width: int = WIDTH, first: str = "", indent: str = "  ", separator: str = ", ") -> List[str]:
    """``first`` then ``items`` joined by ``separator``, wrapped between items (never inside one)."""
    lines, line = [], first
    for position, item in enumerate(items):
        piece = item + (separator if position < len(items) - 1 else "")
        if line.strip() and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line.rstrip())
    return lines


# --- progress of long stages ------------------------------------------------------------------------

# A log file (stderr not a terminal) gets no tqdm bars, whose \r updates flood it; a stage that runs
# longer than this instead prints one line this often, so a long wait is never silent. A stage that
# ends sooner prints nothing.
PROGRESS_EVERY_S = 5.0


class ProgressLines:
    """A progress bar's stand-in for a log file: ``update(n)`` prints ``mergekit-darts: DESC: done/total
    UNIT, N s`` at most once every ``every`` seconds (the first after ``every`` seconds), and ``close()``
    the count reached, marked ``(done)``, when any line was printed and the last one did not show it
    already. tqdm's ``update``/``set_postfix``/``close`` interface, so a call site holds either."""

    def __init__(self, total: Optional[int], desc: str, unit: str = "it", every: Optional[float] = None,
                 stream: Optional[TextIO] = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.every = PROGRESS_EVERY_S if every is None else every
        self.stream = stream  # None: sys.stderr when a line is printed (whatever it is then)
        self.done, self.shown, self.postfix = 0, None, ""  # shown: the count the last line printed
        self.start = self.last = time.monotonic()

    def _line(self, now: float, final: bool = False) -> None:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        extra = f", {self.postfix}" if self.postfix else ""
        done = " (done)" if final or (self.total and self.done >= self.total) else ""
        print(f"mergekit-darts: {self.desc}: {count} {self.unit}{extra}, {now - self.start:.0f} s{done}",
              file=self.stream if self.stream is not None else sys.stderr, flush=True)
        self.shown, self.last = self.done, now

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self._line(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{key} {value}" for key, value in values.items())

    def close(self) -> None:
        if self.shown is not None and self.shown != self.done:
            self._line(time.monotonic(), final=True)
            self.shown = None  # a second close prints nothing

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: Optional[int], desc: str, *, bars: bool, lines: bool, unit: str = "it", leave: bool = False):
    """A tqdm bar (``bars``: stderr is a terminal), ``ProgressLines`` (``lines``: a log file, and not
    ``--quiet``) or nothing, behind one interface (``update``, ``set_postfix``, ``close``)."""
    if bars:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=leave)
    return ProgressLines(total, desc, unit) if lines else _NoProgress()


def progress_iter(iterable: Iterable, desc: str, *, bars: bool, lines: bool, total: Optional[int] = None,
                  unit: str = "it") -> Iterator:
    """``iterable`` with ``progress_bar``'s progress, one ``update`` per item."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = progress_bar(total, desc, bars=bars, lines=lines, unit=unit)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()
