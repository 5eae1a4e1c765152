"""Per-call cost of the code sandbox (it runs once per generated code sample).

Three variants, interleaved and repeated on the same honest HumanEval-style program:
- ``bare``: ``python -I -S -c program`` in a subprocess, no limits (the floor any sandbox pays);
- ``before``: the sandbox as of commit 1c8d35e (in-process nonce, one plain child process);
- ``after``: the current sandbox (namespaces + unprivileged user where permitted, audit-hook guard).
Headline: median per-round ratio after / bare and after / before. Writes benchmarks/results/bench_sandbox.json.
"""

import argparse
import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import interleaved, machine_info, median, paired_ratio, print_table, write_json  # noqa: E402

from mergekit_darts.evaluation import sandbox, sandbox_launch  # noqa: E402

BEFORE_COMMIT = "1c8d35e"
PROGRAM = ("def add(a, b):\n    return a + b\n\nimport math\n"
           "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert math.isclose(add(0.1, 0.2), 0.3)\n")


def load_before():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:mergekit_darts/evaluation/sandbox.py"], cwd=repo,
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("sandbox_before")
    exec(compile(source, "sandbox_before.py", "exec"), module.__dict__)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    before = load_before()
    launch = sandbox_launch.chosen_launch()
    assert sandbox.run_program(PROGRAM).passed and before.run_program(PROGRAM).passed
    variants = {
        "bare": lambda: subprocess.run([sys.executable, "-I", "-S", "-c", PROGRAM], check=True),
        "before": lambda: before.run_program(PROGRAM),
        "after": lambda: sandbox.run_program(PROGRAM),
    }
    times = interleaved(variants, args.repeats)
    rows = [[name, median(times[name]) * 1000] for name in variants]
    print_table(f"sandbox per call (mode {launch.name}), ms, median of {args.repeats}", ["variant", "ms"], rows)
    ratios = {"after/bare": paired_ratio(times["after"], times["bare"]),
              "after/before": paired_ratio(times["after"], times["before"]),
              "before/bare": paired_ratio(times["before"], times["bare"])}
    print_table("paired ratios (median, min..max)", ["ratio", "median", "min", "max"],
                [[k, v["median"], v["min"], v["max"]] for k, v in ratios.items()])
    write_json("bench_sandbox", {
        "settings": {"repeats": args.repeats, "program": PROGRAM, "before_commit": BEFORE_COMMIT,
                     "launch_mode": launch.name, "launch_command": launch.command("...")},
        "machine": machine_info(),
        "ms_median": {name: median(times[name]) * 1000 for name in variants},
        "ratios": ratios,
        "raw_seconds": times,
    })


if __name__ == "__main__":
    main()
