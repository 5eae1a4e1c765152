"""Seconds and peak memory of each stage of a run (merge, capture, training per domain, router,
export): ``darts_report.json``'s ``stages`` and the run's last console line.

Peak RSS is the process's peak so far (``ru_maxrss`` never falls), so a stage's figure includes
the stages before it; on a GPU the peak of allocated memory is reset at each stage's start, so it
is that stage's own. The export writes darts_report.json, so the file's ``stages`` end at the
router; the report the run returns, and its console line, have the export as well.
"""

import contextlib
import resource
import sys
import time
from typing import Dict, List, Optional

import torch

RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT / 2 ** 30, 3)


class StageClock:
    """``with clock.stage("capture"): ...`` records the stage's wall seconds and memory peaks."""

    def __init__(self, device: Optional[str] = None):
        self.cuda = torch.cuda.is_available() and not str(device or "auto").startswith(("cpu", "mps"))
        self.stages: Dict[str, dict] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            yield
        finally:
            entry = {"seconds": round(time.perf_counter() - started, 3), "peak_rss_gib_so_far": peak_rss_gib()}
            if self.cuda:
                entry["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
            self.stages[name] = entry

    def as_report(self) -> Dict[str, dict]:
        return {name: dict(entry) for name, entry in self.stages.items()}


def stage_line(stages: Optional[Dict[str, dict]]) -> List[str]:
    """``stages: merge 12 s, capture 80 s, train math 20 s, ..., export 1 s; peak RSS 5.1 GiB``."""
    if not stages:
        return []
    parts = [f"{name.replace('train:', 'train ')} {entry['seconds']:.0f} s" for name, entry in stages.items()]
    peak = max(entry.get("peak_rss_gib_so_far", 0.0) for entry in stages.values())
    line = "stages: " + ", ".join(parts) + f"; peak RSS {peak:.1f} GiB"
    cuda = [entry["cuda_peak_gib"] for entry in stages.values() if "cuda_peak_gib" in entry]
    return [line + (f", GPU peak {max(cuda):.1f} GiB" if cuda else "")]
