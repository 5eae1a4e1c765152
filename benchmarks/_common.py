"""Small helpers shared by the benchmark scripts: machine info, medians, tables, JSON output.

Every figure the benchmarks report is a ratio of two quantities measured in the same run,
interleaved and repeated (the machines these run on are shared and noisy), so the helpers here
are about pairing measurements and summarising them with medians.

The scripts live in one folder per question (benchmarks/README.md is the map). Each starts with

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from _common import ...

and importing this module puts every benchmark folder on ``sys.path`` (appended, so nothing installed
is shadowed), so a script imports its siblings by module name wherever they live
(``from real_model_check import save_base``, ``from bench_training import preset_flops``).
``REPO``, ``RESULTS_DIR`` and ``DATA_DIR`` are the paths scripts read and write: none depends on the
folder a script sits in.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
RESULTS_DIR = os.path.join(BENCHMARKS, "results")
DATA_DIR = os.path.join(BENCHMARKS, "data")
# the folders that hold scripts (not results/ or data/): every one on sys.path, see the docstring
FOLDERS = sorted(name for name in os.listdir(BENCHMARKS)
                 if not name.startswith((".", "_")) and os.path.isdir(os.path.join(BENCHMARKS, name))
                 and any(f.endswith(".py") for f in os.listdir(os.path.join(BENCHMARKS, name))))
for _folder in FOLDERS:
    if os.path.join(BENCHMARKS, _folder) not in sys.path:
        sys.path.append(os.path.join(BENCHMARKS, _folder))


def machine_info() -> Dict[str, object]:
    import torch

    info: Dict[str, object] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # the vector kernels torch dispatches to (AVX2, AVX512, ...): float results, and so the demo's
        # trained family, differ between them (docs/results.md#the-demo); ATEN_CPU_CAPABILITY overrides it
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    return info


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


CLOCKS = {
    # wall: what a user waits. cpu: CPU seconds this process used (all its threads); on a shared,
    # oversubscribed machine it leaves out the time spent waiting for a core, so ratios of CPU
    # times are much steadier than ratios of wall times. Use wall on a GPU (the CPU mostly waits).
    "wall": time.perf_counter,
    "cpu": time.process_time,
}


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None, clock: str = "wall") -> float:
    """Seconds of one call of ``fn`` on ``clock`` (``sync`` e.g. torch.cuda.synchronize before each read)."""
    now = CLOCKS[clock]
    sync()
    start = now()
    fn()
    sync()
    return now() - start


def interleaved(variants: Dict[str, Callable[[], object]], repeats: int,
                sync: Callable[[], None] = lambda: None, clock: str = "wall") -> Dict[str, List[float]]:
    """Time each variant ``repeats`` times, interleaved (ABAB…, order flipped every round so neither
    variant always runs right after the other); returns name -> list of seconds, one per round."""
    names = list(variants)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(variants[name], sync, clock))
    return times


def paired_ratio(numerator: List[float], denominator: List[float]) -> Dict[str, float]:
    """Median, min and max of per-round ratios numerator[i] / denominator[i]."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:.3e}"
    return str(value)


def write_json(name: str, data: Dict[str, object], path: str = None, overwrite: bool = False) -> str:
    """Write ``data`` as JSON and return the path.

    ``path`` given (``--out``): written there, replacing what is there (it was asked for). Otherwise
    ``results/<name>.json``, unless that file exists (the committed results the README quotes) and
    ``overwrite`` (``--overwrite``) is not set: then a new ``results/<name>-<date>T<time>.json``, so
    that running a benchmark never silently replaces the published numbers.
    """
    if path is None:
        path = os.path.join(RESULTS_DIR, f"{name}.json")
        if os.path.exists(path) and not overwrite:
            stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
            path = os.path.join(RESULTS_DIR, f"{name}-{stamp}.json")
            print(f"\nresults/{name}.json exists (committed results); writing a new file instead "
                  "(--overwrite replaces it, --out PATH chooses the file)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
    print(f"\nwrote {path}")
    return path


def add_output_options(parser) -> None:
    """``--out PATH`` and ``--overwrite`` for every benchmark script (see ``write_json``)."""
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<name>.json, or a new time-stamped file there if that exists)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace benchmarks/results/<name>.json (the committed results) instead of "
                             "writing a new time-stamped file next to it")


def run_json_child(cmd: Sequence[str], what: str, **env: str) -> Dict[str, object]:
    """Run one measurement in a fresh interpreter (so its peak memory is its own) and return the JSON
    object it prints on its last stdout line; ``env`` is added to the offline environment."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child {what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
