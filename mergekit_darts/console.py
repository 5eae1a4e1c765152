"""How the library's log records reach a person running a command.

Library modules log with ``logging.getLogger(__name__)`` and print nothing themselves. A command
(``mergekit-darts ...`` or ``mergekit-yaml`` through the hook) wraps its run in ``user_logging()``:
records of the ``mergekit_darts`` loggers are then printed as ``mergekit-darts: warning: ...``
(not mergekit's ``WARNING:mergekit_darts.repair.calibration:...`` root format), and each distinct
message only once per run, because ``compare`` and the demo run the same steps many times and the
same warning about the same input says nothing new the second time. Outside a command (tests,
library use) records propagate to the root logger untouched.
"""

import contextlib
import logging
import sys
from typing import Iterator, Optional, TextIO

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
