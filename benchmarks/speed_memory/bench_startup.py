"""Start-up cost of the ``mergekit_darts_hook.pth`` file (issue 13): what every Python process in an
environment with mergekit-darts installed pays.

Builds throw-away virtual environments (no pip, nothing installed) that differ only in their
site-packages: ``plain`` has a path file making this checkout importable, ``hook`` adds this
checkout's ``hooks/mergekit_darts_hook.pth``, ``before`` adds the hook line and ``_startup.py`` of
the commit given by ``--before`` (the version the issue measured). Then it times ``python -c pass``
in each, interleaved, as wall time and as the child's CPU time (steadier on a shared machine), and
reads ``-X importtime``'s cumulative microseconds of ``mergekit_darts._startup`` (which includes the
package ``__init__``). Writes ``benchmarks/results/bench_startup.json``.

``--cli`` measures the command line instead (issue 26): the wall time of ``mergekit-darts CMD
--help`` for every command, and of ``info`` / ``report`` on a freshly repaired offline example
(``report`` once with the figure up to date, once forced to re-draw it with ``--plot``),
run through this environment's installed ``mergekit-darts`` script (the start-up hook included),
interleaved with the same commands of the package as it was at ``--cli-before`` (on PYTHONPATH,
which wins over the editable install). Targets: every ``--help`` < 0.5 s, ``info``/``report``
< 1.5 s. Writes ``benchmarks/results/bench_startup_cli.json``.

    python benchmarks/speed_memory/bench_startup.py [--runs 60] [--before 1c8d35e]
    python benchmarks/speed_memory/bench_startup.py --cli [--runs 10] [--cli-before e5d7838] [--before-runs 2]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import REPO, median, print_table, write_json  # noqa: E402

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


def _repaired_example(root: str, env: dict) -> str:
    """The README's offline example (`mergekit-darts example`, then mergekit-yaml) repaired under ``root``."""
    bin_dir = os.path.dirname(sys.executable)
    subprocess.run([os.path.join(bin_dir, "mergekit-darts"), "example"], env=env, check=True, capture_output=True,
                   cwd=root)
    subprocess.run([os.path.join(bin_dir, "mergekit-yaml"), "tiny_offline.yml", "tiny_out"], env=env, check=True,
                   capture_output=True, cwd=root)
    return os.path.join(root, "tiny_out")


def cli_main(args) -> None:
    from mergekit_darts.cli import COMMANDS

    script = os.path.join(os.path.dirname(sys.executable), "mergekit-darts")
    root = tempfile.mkdtemp(prefix="bench-cli-")
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HOME": root,
               "MPLCONFIGDIR": os.path.join(root, "mpl")}
        env.pop("PYTHONPATH", None)
        out = _repaired_example(root, env)
        cases = {f"{name} --help": [name, "--help"] for name in COMMANDS}
        cases.update({"info OUT": ["info", out], "report OUT": ["report", out],
                      "report OUT --plot": ["report", out, "--plot"]})
        variants = {"now": env}
        argvs = {"now": cases}
        if args.cli_before:
            variants["before"] = {**env, "PYTHONPATH": _old_checkout(root, args.cli_before)}
            # the old package: commands it had; its report always re-drew the figure (no --plot)
            old = {case: (["report", out] if case == "report OUT --plot" else argv) for case, argv in cases.items()
                   if case != "report OUT" and argv[0] in _old_commands(variants["before"]["PYTHONPATH"])}
            argvs["before"] = old
        for variant, env_variant in variants.items():  # warm the page cache and __pycache__
            for case, argv in argvs[variant].items():
                if variant == "now" or case in ("run --help", "info OUT", "report OUT --plot"):
                    _child_run(script, env_variant, argv)
        times = {variant: {case: [] for case in argvs[variant]} for variant in variants}
        for round_index in range(args.runs):
            for case in cases:
                for variant in (list(variants) if round_index % 2 == 0 else list(variants)[::-1]):
                    if case not in argvs[variant] or (variant == "before" and round_index >= args.before_runs):
                        continue
                    times[variant][case].append(_child_run(script, variants[variant], argvs[variant][case])[0])
        summary = {variant: {case: median(values) for case, values in cases_.items()} for variant, cases_ in times.items()}
        rows = [[case, summary["now"][case], summary.get("before", {}).get(case, float("nan")) or float("nan"),
                 "-" if case == "report OUT --plot" else (0.5 if case.endswith("--help") else 1.5)] for case in cases]
        print_table(f"wall seconds, medians ({args.runs} runs now, {args.before_runs} before = {args.cli_before})",
                    ["command", "now s", "before s", "target s"], rows)
        write_json("bench_startup_cli", {
            "settings": {"runs": args.runs, "before": args.cli_before, "before_runs": args.before_runs,
                         "python": sys.version.split()[0], "load_average": os.getloadavg(),
                         "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "target": "every `mergekit-darts CMD --help` < 0.5 s; `info` and `report` < 1.5 s (wall, medians); "
                      "`report --plot` (a forced re-draw of the figure: matplotlib) is measured, not targeted",
            "met": all(summary["now"][case] < (0.5 if case.endswith("--help") else 1.5) for case in cases
                       if case != "report OUT --plot"),
            "summary_s": summary, "raw_s": times,
        })
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _old_commands(src: str) -> set:
    code = "from mergekit_darts.cli import COMMANDS; print(' '.join(COMMANDS))"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src,
                            "MERGEKIT_DARTS_DISABLE": "1"}, capture_output=True, text=True, check=True, cwd=src)
    return set(result.stdout.split())


def _old_checkout(root: str, commit: str) -> str:
    """The whole package as it was at ``commit`` (git archive), for PYTHONPATH."""
    folder = os.path.join(root, f"src-{commit}")
    os.makedirs(folder)
    archive = subprocess.run(["git", "-C", REPO, "archive", commit, "mergekit_darts"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="runs per variant (default 60; with --cli 10)")
    parser.add_argument("--before", default="1c8d35e", help="commit whose hook is measured as 'before' ('' = skip)")
    parser.add_argument("--cli", action="store_true", help="measure the command line instead of the hook")
    parser.add_argument("--cli-before", default="e5d7838", help="with --cli: commit measured as 'before' ('' = skip)")
    parser.add_argument("--before-runs", type=int, default=2, help="with --cli: runs of each 'before' command (slow)")
    args = parser.parse_args()
    if args.cli:
        args.runs = args.runs or 10
        cli_main(args)
        return
    args.runs = args.runs or 60

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
