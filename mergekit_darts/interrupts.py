"""SIGTERM handled like Ctrl-C during a run (docs/reliability.md, "A failed run loses no data").

Without a handler SIGTERM (``kill``, ``timeout``, a job scheduler ending a job) ended the process at once:
exit 143, no message, and a ``.darts-staging-*`` folder holding the whole plain merge. While a run is in
``terminate_as_interrupt``, SIGTERM raises ``Interrupted`` in the main thread instead: a ``KeyboardInterrupt``,
so every cleanup Ctrl-C gets runs for it too (the staging folder removed, or the plain merge kept as
documented). The pipeline records what became of the output in ``outcome``; the command line prints it
as one line and exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).

``held_signals`` is for the few steps that must not stop half way (switching a finished folder in, the
cleanup after an interruption): SIGINT and SIGTERM wait until the step has ended.
"""

import contextlib
import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGTERM, or by either signal once ``held_signals`` held it (Ctrl-C otherwise
    raises a plain KeyboardInterrupt, read as SIGINT)."""

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


class Holder:
    """What ``held_signals`` received: ``received`` the first signal's name; ``stoppable`` (set by the
    block once what must not stop half way is done) makes a second signal stop the block at once."""

    def __init__(self):
        self.received = None
        self.stoppable = False


@contextlib.contextmanager
def held_signals(raise_after: bool = True):
    """SIGINT and SIGTERM wait while the block runs; yields a ``Holder``. When the block ends the first
    one is raised as ``Interrupted`` (``raise_after``; else it is dropped: a cleanup of a run that is
    stopping already). A second one stops the block at once once ``holder.stoppable`` is set, and is
    otherwise held too. A signal the process ignores (SIG_IGN) stays ignored; off the main thread
    nothing changes. The handlers that were there before come back when the block ends."""
    holder = Holder()
    if threading.current_thread() is not threading.main_thread():
        yield holder
        return
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    previous = {number: signal.SIG_DFL if handler is None else handler for number, handler in previous.items()
                if handler is not signal.SIG_IGN}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if holder.received and holder.stoppable:
            raise Interrupted(name)
        holder.received = holder.received or name

    for number in previous:
        signal.signal(number, handler)
    try:
        yield holder
    finally:
        for number, before in previous.items():
            signal.signal(number, before)
    if raise_after and holder.received:
        raise Interrupted(holder.received)


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
