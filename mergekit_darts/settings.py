"""Run settings resolved once, at the entrance, from the ``surgery:`` block and mergekit's options."""

from dataclasses import dataclass
from typing import Optional

from mergekit_darts.config import SurgeryConfig


@dataclass(frozen=True)
class RunSettings:
    """What every step of one run needs besides the surgery block itself."""

    seed: int
    device: str  # "auto", "cpu", "cuda", "cuda:N", "mps"
    dtype: str  # the capture dtype: "auto", "bfloat16", "float16", "float32"
    trust_remote_code: bool
    progress: bool
    quiet: bool
    # stderr is not a terminal (a log file): no progress bars, whose \r updates flood a file, but one
    # line per stage instead
    stage_lines: bool = False

    @classmethod
    def resolve(cls, surgery: SurgeryConfig, options=None, progress: Optional[bool] = None) -> "RunSettings":
        """``options`` is mergekit's ``MergeOptions`` (or None). The surgery block wins where it sets a
        value; otherwise mergekit's --random-seed, --cuda/--device, --trust-remote-code and --quiet."""
        seed = surgery.seed
        if seed is None:
            random_seed = getattr(options, "random_seed", None)
            seed = int(random_seed) if random_seed is not None else 0
        device = surgery.device
        if device == "auto" and options is not None:
            chosen = getattr(options, "device", None)
            if chosen and str(chosen).startswith("cuda"):
                device = str(chosen)
            elif getattr(options, "cuda", False):
                device = "cuda"
        quiet = bool(getattr(options, "quiet", False))
        terminal = stderr_is_terminal()
        return cls(
            seed=seed,
            device=device,
            dtype=surgery.dtype,
            trust_remote_code=bool(getattr(options, "trust_remote_code", False)),
            progress=(not quiet and terminal) if progress is None else bool(progress),
            quiet=quiet,
            stage_lines=progress is None and not quiet and not terminal,
        )


def stderr_is_terminal() -> bool:
    """Whether progress bars (which write to stderr) reach a person rather than a file or a pipe."""
    import sys

    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
