"""The package's errors, in one place. Library code raises these; only the command line and the
mergekit hook turn them into click errors (one ``Error: ...`` line, non-zero exit)."""


class DartsError(Exception):
    """Base of every error mergekit-darts raises on purpose; its message names the field or file."""


class SurgeryConfigError(DartsError, ValueError):
    """A ``surgery:`` block, or what it points at (calibration files, experts), is invalid."""


class MergeConfigError(DartsError, ValueError):
    """The mergekit part of a config (merge_method, models, ...) is invalid: mergekit's own message."""


class FormatError(DartsError, ValueError):
    """A directory or file is not in the format mergekit-darts reads or writes."""


class EvaluationError(DartsError, ValueError):
    """A bad evaluation request (unknown task, missing data, code execution not allowed, ...)."""


class FoldError(DartsError, ValueError):
    """A domain's correction cannot be folded exactly into the LM head (``bake``, ``export-peft``)."""


class DeviceError(DartsError, RuntimeError):
    """The requested device is not available on this machine."""


class BusyError(DartsError, RuntimeError):
    """Another mergekit-darts process is writing to the same output directory."""


def first_line(error: BaseException) -> str:
    """An exception as one line: its first non-empty line, or its type when it has no message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def yaml_error_line(error: BaseException) -> str:
    """A PyYAML error as ``config: not valid YAML: <what> (line L, column C)``: what was wrong and where,
    without the quoted snippet and caret lines of its own text."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    if mark is None or not problem:
        detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        return f"config: not valid YAML: {detail}"
    context = getattr(error, "context", None)
    return (f"config: not valid YAML: {context + ', ' if context else ''}{problem} "
            f"(line {mark.line + 1}, column {mark.column + 1})")


_DISK_FULL = (28, 27, 122)  # ENOSPC, EFBIG, EDQUOT


def io_error(error: BaseException, doing: str) -> "DartsError | None":
    """A failed read or write (OSError, or safetensors' SafetensorError, which wraps one in its text) as
    one line naming the file and what to do; None for any other exception."""
    import re

    if isinstance(error, OSError):
        full = error.errno in _DISK_FULL
        # shutil's copies name the source first and the destination second: a full disk is the destination's
        where = (error.filename2 if full and error.filename2 else error.filename) or ""
        reason = error.strerror or first_line(error)
    elif type(error).__name__ == "SafetensorError":
        # e.g. "Error while serializing: I/O error: File too large (os error 27)", or with the Rust
        # debug form "IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"
        text = first_line(error)
        found = re.search(r'message: "([^"]+)"', text) or re.search(r"I/O error: (.+?) \(os error", text)
        where, reason = "", found.group(1) if found else text
        code = re.search(r"(?:code: |os error )(\d+)", text)
        full = bool(code and int(code.group(1)) in _DISK_FULL) or "space" in reason.lower()
    else:
        return None
    hint = "; free disk space (or choose a folder on a disk with room) and run again" if full else ""
    return DartsError(f"{doing}: {where + ': ' if where else ''}{reason}{hint}")


def one_line_error(error: BaseException, command: str) -> "DartsError | None":
    """What a command reports for an exception that is not ours: a failed read/write (``io_error``) or a
    loader's ValueError (a config the emitted model cannot read, ...) becomes one line naming the command;
    anything else stays a traceback (a bug). MERGEKIT_DARTS_TRACEBACK=1 keeps every traceback."""
    import os

    if os.environ.get("MERGEKIT_DARTS_TRACEBACK", "").strip() in ("1", "true", "yes"):
        return None
    failed = io_error(error, command)
    if failed is None and isinstance(error, ValueError):
        failed = DartsError(f"{command}: {first_line(error)}")
    return failed


def to_click_error(error: Exception):
    """A library error as the one-line ``Error: ...`` that click commands (``mergekit-yaml`` too)
    print, with exit status 2. Only the command line and the mergekit hook call this."""
    import click

    class DartsClickError(click.ClickException):
        exit_code = 2

    return DartsClickError(str(error))


class SweepConfigError(DartsError, ValueError):
    """A sweep YAML (its ``sweep:`` block, or a cell it expands to) is invalid."""


def format_validation_error(error, prefix: str) -> str:
    """A pydantic ``ValidationError`` as one line per problem, each naming its path under ``prefix``."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in (prefix, *item["loc"]) if part != "")
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; docs/options.md lists the supported keys)"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        elif item["type"] in ("int_type", "float_type", "int_from_float") and "input" in item:
            msg = f"{msg} (got {item['input']!r}; write a plain number)"
        elif item["type"] in ("less_than_equal", "less_than", "greater_than", "greater_than_equal") and "input" in item:
            msg = f"{msg} (got {item['input']!r})"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)
