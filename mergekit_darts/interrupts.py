"""SIGTERM handled like Ctrl-C during a run (docs/reliability.md, "A failed run loses no data").

Without a handler SIGTERM (``kill``, ``timeout``, a job scheduler ending a job) ended the process at once:
exit 143, no message, and a ``.darts-staging-*`` folder holding the whole plain merge. While a run is in
``terminate_as_interrupt``, SIGTERM raises ``Interrupted`` in the main thread instead: a ``KeyboardInterrupt``,
so every cleanup Ctrl-C gets runs for it too (the staging folder removed, or the plain merge kept as
documented). The pipeline records what became of the output in ``outcome``; the command line prints it
as one line and exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

import contextlib
import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGTERM (Ctrl-C raises a plain KeyboardInterrupt, read as SIGINT)."""

    def __init__(self, signal_name: str = "SIGTERM"):
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises ``Interrupted`` where the main thread is, once: the handler that was there before
    comes back at the first signal (a second SIGTERM during the cleanup acts as it did) and on exit.
    Elsewhere than the main thread (signals cannot be handled there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:  # a handler installed from C, which Python cannot put back: the default then
        previous = signal.SIG_DFL

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, previous)
        raise Interrupted("SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def describe(error: KeyboardInterrupt, outcome: str) -> None:
    """Record on ``error`` what became of the output (the first description wins: the innermost knows best)."""
    if not getattr(error, "outcome", None):
        error.outcome = outcome


def exit_interrupted(error: KeyboardInterrupt):
    """Print the one line a command ends with after an interruption, and exit 128 + the signal's number."""
    name = getattr(error, "signal_name", "SIGINT")
    outcome = getattr(error, "outcome", None)
    print(f"Error: interrupted by {name}" + (f" {outcome}" if outcome else ""), file=sys.stderr, flush=True)
    raise SystemExit(128 + int(getattr(signal, name)))
