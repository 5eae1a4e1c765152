"""The package's errors, in one place. Library code raises these; only the command line and the
mergekit hook turn them into click errors (one ``Error: ...`` line, non-zero exit)."""


class DartsError(Exception):
    """Base of every error mergekit-darts raises on purpose; its message names the field or file."""


class SurgeryConfigError(DartsError, ValueError):
    """A ``surgery:`` block, or what it points at (calibration files, experts), is invalid."""


class FormatError(DartsError, ValueError):
    """A directory or file is not in the format mergekit-darts reads or writes."""


class EvaluationError(DartsError, ValueError):
    """A bad evaluation request (unknown task, missing data, code execution not allowed, ...)."""


class FoldError(DartsError, ValueError):
    """A domain's correction cannot be folded exactly into the LM head (``bake``, ``export-peft``)."""


class DeviceError(DartsError, RuntimeError):
    """The requested device is not available on this machine."""


def to_click_error(error: Exception):
    """A library error as the one-line ``Error: ...`` that click commands (``mergekit-yaml`` too)
    print, with exit status 2. Only the command line and the mergekit hook call this."""
    import click

    class DartsClickError(click.ClickException):
        exit_code = 2

    return DartsClickError(str(error))


class SweepConfigError(DartsError, ValueError):
    """A sweep YAML (its ``sweep:`` block, or a cell it expands to) is invalid."""
