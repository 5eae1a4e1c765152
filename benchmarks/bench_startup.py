"""Start-up cost of the ``mergekit_darts_hook.pth`` file (issue 13): what every Python process in an
environment with mergekit-darts installed pays.

Builds throw-away virtual environments (no pip, nothing installed) that differ only in their
site-packages: ``plain`` has a path file making this checkout importable, ``hook`` adds this
checkout's ``hooks/mergekit_darts_hook.pth``, ``before`` adds the hook line and ``_startup.py`` of
the commit given by ``--before`` (the version the issue measured). Then it times ``python -c pass``
in each, interleaved, as wall time and as the child's CPU time (steadier on a shared machine), and
reads ``-X importtime``'s cumulative microseconds of ``mergekit_darts._startup`` (which includes the
package ``__init__``). Writes ``benchmarks/results/bench_startup.json``.

    python benchmarks/bench_startup.py [--runs 60] [--before 1c8d35e]
"""

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK_FILE = os.path.join(REPO, "hooks", "mergekit_darts_hook.pth")


def _venv(root: str, name: str) -> tuple:
    path = os.path.join(root, name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, site


def _old_package(root: str, commit: str) -> str:
    """The package __init__ and _startup.py of ``commit`` (all the old hook imported)."""
    package = os.path.join(root, "before_src", "mergekit_darts")
    os.makedirs(package)
    for name in ("__init__.py", "_startup.py"):
        text = subprocess.run(["git", "-C", REPO, "show", f"{commit}:mergekit_darts/{name}"],
                              capture_output=True, text=True, check=True).stdout
        with open(os.path.join(package, name), "w") as handle:
            handle.write(text)
    return os.path.dirname(package)


def _child_run(python: str, env: dict, args=("-c", "pass")) -> tuple:
    """(wall seconds, child CPU seconds, stderr) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([python, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if result.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(args)} failed: {result.stderr[-500:]}")
    return wall, cpu, result.stderr


def _importtime_us(stderr: str, module: str):
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)$", line)
        if match and match.group(3) == module:
            return int(match.group(2))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60, help="runs of `python -c pass` per variant")
    parser.add_argument("--before", default="1c8d35e", help="commit whose hook is measured as 'before' ('' = skip)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="bench-startup-")
    try:
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": root}
        variants = {}
        python, site = _venv(root, "plain")
        with open(os.path.join(site, "checkout.pth"), "w") as handle:
            handle.write(REPO + "\n")
        variants["plain"] = (python, base_env)
        python, site = _venv(root, "hook")
        with open(os.path.join(site, "checkout.pth"), "w") as handle:
            handle.write(REPO + "\n")
        shutil.copyfile(HOOK_FILE, os.path.join(site, "mergekit_darts_hook.pth"))
        variants["hook"] = (python, base_env)
        variants["hook_disabled"] = (python, {**base_env, "MERGEKIT_DARTS_DISABLE": "1"})
        if args.before:
            python, site = _venv(root, "before")
            with open(os.path.join(site, "checkout.pth"), "w") as handle:
                handle.write(_old_package(root, args.before) + "\n")
            old_line = "import mergekit_darts._startup as _mergekit_darts_startup; _mergekit_darts_startup.install()\n"
            with open(os.path.join(site, "mergekit_darts_hook.pth"), "w") as handle:
                handle.write(old_line)
            variants["before"] = (python, base_env)

        check = subprocess.run(
            [variants["hook"][0], "-c", "import sys; print(any(type(f).__name__ == '_MergekitFinder' for f in sys.meta_path))"],
            env=variants["hook"][1], capture_output=True, text=True).stdout.strip()
        if check != "True":
            raise RuntimeError("the hook did not install itself in the 'hook' environment")

        for python, env in variants.values():  # warm the page cache and __pycache__
            for _ in range(3):
                _child_run(python, env)
        times = {name: {"wall": [], "cpu": []} for name in variants}
        names = list(variants)
        for round_index in range(args.runs):
            for name in (names if round_index % 2 == 0 else names[::-1]):
                wall, cpu, _ = _child_run(*variants[name])
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)

        importtime = {}
        for name in ("hook", "before"):
            if name not in variants:
                continue
            values = []
            for _ in range(max(10, args.runs // 3)):
                _, _, stderr = _child_run(variants[name][0], variants[name][1], ("-X", "importtime", "-c", "pass"))
                values.append(_importtime_us(stderr, "mergekit_darts._startup"))
            importtime[name] = {"median_us": median(values), "min_us": min(values), "max_us": max(values)}

        summary = {}
        rows = []
        for name in names:
            wall_ms, cpu_ms = median(times[name]["wall"]) * 1e3, median(times[name]["cpu"]) * 1e3
            extra_wall = [(a - b) * 1e3 for a, b in zip(times[name]["wall"], times["plain"]["wall"])]
            extra_cpu = [(a - b) * 1e3 for a, b in zip(times[name]["cpu"], times["plain"]["cpu"])]
            summary[name] = {"wall_ms_median": wall_ms, "cpu_ms_median": cpu_ms,
                             "extra_wall_ms_median": median(extra_wall), "extra_cpu_ms_median": median(extra_cpu)}
            rows.append([name, wall_ms, cpu_ms, median(extra_wall), median(extra_cpu)])
        print_table(f"python -c pass, {args.runs} interleaved runs each (medians; extra = paired difference to plain)",
                    ["variant", "wall ms", "cpu ms", "extra wall ms", "extra cpu ms"], rows)
        print_table("-X importtime: cumulative us of mergekit_darts._startup",
                    ["variant", "median us", "min us", "max us"],
                    [[k, v["median_us"], v["min_us"], v["max_us"]] for k, v in importtime.items()])
        write_json("bench_startup", {
            "settings": {"runs": args.runs, "before": args.before, "python": sys.version.split()[0],
                         "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
                         "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "target": "hook adds <= 3 ms to `python -c pass` (-X importtime cumulative of mergekit_darts._startup)",
            "summary": summary, "importtime_startup_us": importtime, "raw": times,
        })
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
