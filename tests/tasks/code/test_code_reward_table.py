"""Correct and wrong programs for stdin/stdout and function-call problems score as the table says.

Every row runs in the real sandbox; the whole table is scored in one pooled batch (as a rollout
batch is), so the pool's ordering and de-duplication are checked too. The tests are spelled as
APPS, LiveCodeBench (including its packed private tests) and LeetCode hold them, and each of the
rows marked "mutation:" fails when that one-line change is made to the scorer.
"""

import base64
import dataclasses
import json
import pickle
import time
import tracemalloc
import zlib

import pytest

from megatron_gspo.tasks.code import reward as code_reward
from megatron_gspo.tasks.code.cases import parse_tests
from megatron_gspo.tasks.code.compare import outputs_match
from megatron_gspo.tasks.code.reward import CodeResult, CodeScorer, Outcome, ScoringOptions, outcome_metrics
from megatron_gspo.tasks.code.sandbox import Limits

LIMITS = Limits(cpu_s=1, wall_s=3.0, memory_mb=256)

SUM = parse_tests({"inputs": ["1 2\n", "10 -4\n", "0 0\n"], "outputs": ["3\n", "6\n", "0\n"]})
GRID = parse_tests({"input": ["2\n"], "output": ["1 2\n3 4\n"]})  # CodeContests spelling
HALF = parse_tests({"inputs": ["1\n", "3\n"], "outputs": ["0.5\n", "1.5\n"]})
ADD = parse_tests(
    {"inputs": [[1, 2], [5, 7]], "outputs": [[3], [12]], "fn_name": "add"}
)  # APPS wraps outputs
PAIR = parse_tests({"inputs": [[3]], "outputs": [[0, 3]], "fn_name": "pair"})
MEAN = parse_tests(
    [{"input": "[1, 2]", "output": "1.5", "testtype": "functional"},
     {"input": "[1, 2, 4]", "output": "2.3333333", "testtype": "functional"}],
    fn_name="mean",
)  # fmt: skip

# APPS stdin row: the first line a count, then the values (problem 4000-style)
APPS_MAX = parse_tests(json.dumps({"inputs": ["3\n1 5 2\n", "1\n-7\n"], "outputs": ["5\n", "-7\n"]}))
# APPS call-based row: fn_name inside input_output, outputs wrapped in a list
APPS_CALL = parse_tests(
    json.dumps({"fn_name": "count_vowels", "inputs": [["hello"], ["sky"]], "outputs": [[2], [0]]})
)
# LiveCodeBench stdin tests (public_test_cases as a JSON string)
LCB_STDIN = parse_tests(json.dumps([
    {"input": "2\n3 4\n", "output": "7\n", "testtype": "stdin"},
    {"input": "1\n10\n", "output": "10\n", "testtype": "stdin"},
]))  # fmt: skip
# LiveCodeBench functional tests: one JSON argument per line; the fn_name from metadata
TWO_SUM = parse_tests(json.dumps([
    {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
    {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"},
]), fn_name="twoSum")  # fmt: skip
# LiveCodeBench private_test_cases: base64(zlib(pickle(json string)))
PACKED = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([
    {"input": "5\n", "output": "25\n", "testtype": "stdin"},
    {"input": "-3\n", "output": "9\n", "testtype": "stdin"},
])))).decode()  # fmt: skip
LCB_PRIVATE = parse_tests(PACKED)
BIG = parse_tests({"inputs": ["\n"], "outputs": ["1000000\n"]})
ZERO = parse_tests({"inputs": ["\n"], "outputs": ["0.0\n"]})
TWO_FLOATS = parse_tests({"inputs": ["\n"], "outputs": ["2.0 0.5\n"]})
PAIR_LINE = parse_tests({"inputs": ["\n"], "outputs": ["3 4\n"]})
SQUARE = parse_tests({"inputs": ["2\n", "3\n"], "outputs": ["4\n", "9\n"]})
SQUARE_FN = parse_tests({"inputs": [[2], [3]], "outputs": [4, 9], "fn_name": "square"})
ZERO_FN = parse_tests({"inputs": [[0]], "outputs": [0.0], "fn_name": "tiny"})
BIG_FN = parse_tests({"inputs": [[0]], "outputs": [1000000], "fn_name": "big"})
YES = parse_tests({"inputs": ["4\n", "3\n"], "outputs": ["YES\n", "NO\n"]})
# a row's own tolerance: none on a row of a task with one, and one on a row of an exact task
HALF_OWN_EXACT = dataclasses.replace(HALF, float_tolerance=None, own_tolerance=True)
HALF_OWN_LOOSE = dataclasses.replace(HALF, float_tolerance=1e-3, own_tolerance=True)

EXACT = {"reward": "fraction"}
ALL = {"reward": "all"}
TOL = {"float_tolerance": 1e-6}

PASS, WRONG, ERROR, TIMEOUT, NO_PROGRAM = (
    Outcome(o) for o in ("pass", "wrong", "error", "timeout", "no_program")
)

# (note, tests, program, options, expected reward, expected outcome)
CASES = [
    ("stdin correct", SUM, "a, b = map(int, input().split())\nprint(a + b)", EXACT, 1.0, PASS),
    ("stdin trailing spaces and no final newline", SUM,
     "import sys\na, b = map(int, input().split())\nsys.stdout.write(str(a + b) + '   ')", EXACT, 1.0, PASS),
    ("stdin extra blank lines at the end", SUM,
     "a, b = map(int, input().split())\nprint(a + b)\nprint()\nprint()",
     EXACT, 1.0, PASS),
    ("stdin CRLF line ends", GRID, "import sys\nsys.stdout.write('1 2\\r\\n3 4\\r\\n')", EXACT, 1.0, PASS),
    ("stdin several spaces between tokens", GRID, "print('1   2')\nprint('3\\t4')", EXACT, 1.0, PASS),
    ("stdin tokens split over other lines", GRID, "print('1 2 3 4')", EXACT, 0.0, WRONG),
    ("stdin wrong on one test of three", SUM, "a, b = map(int, input().split())\nprint(abs(a) + abs(b))",
     EXACT, 2 / 3, WRONG),
    ("stdin wrong on one, all-or-nothing", SUM, "a, b = map(int, input().split())\nprint(abs(a) + abs(b))",
     ALL, 0.0, WRONG),
    ("stdin always wrong", SUM, "print(42)", EXACT, 0.0, WRONG),
    ("stdin float exact spelling", HALF, "print(int(input()) / 2)", EXACT, 1.0, PASS),
    ("stdin float other spelling without tolerance", HALF, "print(f'{int(input()) / 2:.4f}')", EXACT, 0.0,
     WRONG),
    ("stdin float other spelling within tolerance", HALF, "print(f'{int(input()) / 2:.9f}')", TOL, 1.0,
     PASS),
    ("stdin float off by more than the tolerance", HALF, "print(int(input()) / 2 + 1e-3)", TOL, 0.0, WRONG),
    ("stdin syntax error", SUM, "print(1 +", EXACT, 0.0, ERROR),
    ("stdin crash on one test", SUM,
     "a, b = map(int, input().split())\nassert b >= 0\nprint(a + b)", EXACT, 2 / 3, ERROR),
    ("stdin infinite loop", SUM, "while True:\n    pass", ALL, 0.0, TIMEOUT),
    ("stdin no output", SUM, "pass", EXACT, 0.0, WRONG),
    ("no program", SUM, None, EXACT, 0.0, NO_PROGRAM),
    ("function correct", ADD, "def add(a, b):\n    return a + b", EXACT, 1.0, PASS),
    ("function printing as it goes", ADD, "def add(a, b):\n    print('debug', a)\n    return a + b", EXACT,
     1.0,
     PASS),
    ("function as a Solution method", ADD, "class Solution:\n    def add(self, a, b):\n        return a + b",
     EXACT, 1.0, PASS),
    ("function wrong on one test", ADD, "def add(a, b):\n    return 3", EXACT, 0.5, WRONG),
    ("function missing", ADD, "def plus(a, b):\n    return a + b", EXACT, 0.0, ERROR),
    ("function raising", ADD, "def add(a, b):\n    return a + b + None", EXACT, 0.0, ERROR),
    ("function raising once, all-or-nothing", ADD, "def add(a, b):\n    assert a > 1\n    return a + b", ALL,
     0.0,
     ERROR),
    ("function returning a tuple for a list", PAIR, "def pair(n):\n    return (0, n)", EXACT, 1.0, PASS),
    ("function timing out", ADD, "def add(a, b):\n    while True:\n        pass", ALL, 0.0, TIMEOUT),
    ("function float within tolerance", MEAN, "def mean(xs):\n    return sum(xs) / len(xs)", TOL, 1.0, PASS),
    ("function float without tolerance", MEAN, "def mean(xs):\n    return sum(xs) / len(xs)", EXACT, 0.5,
     WRONG),
    ("function calling sys.exit", ADD, "import sys\ndef add(a, b):\n    sys.exit(0)", EXACT, 0.0, ERROR),
    # real data set shapes
    ("APPS stdin: count then values", APPS_MAX, "input()\nprint(max(map(int, input().split())))", EXACT,
     1.0, PASS),
    ("APPS stdin: reading all of stdin at once", APPS_MAX,
     "import sys\ndata = sys.stdin.read().split()\nprint(max(map(int, data[1:])))", EXACT, 1.0, PASS),
    ("APPS call-based: wrapped outputs", APPS_CALL,
     "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)", EXACT, 1.0, PASS),
    ("APPS call-based: off by one", APPS_CALL,
     "def count_vowels(s):\n    return sum(c in 'aeiouy' for c in s)", EXACT, 0.5, WRONG),
    ("LCB stdin: sum of the list", LCB_STDIN, "input()\nprint(sum(map(int, input().split())))", EXACT, 1.0,
     PASS),
    ("LCB functional: LeetCode class Solution", TWO_SUM,
     "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
     "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
     "                return [seen[target - x], i]\n            seen[x] = i", EXACT, 1.0, PASS),
    ("LCB private tests, packed, decoded and run", LCB_PRIVATE, "print(int(input()) ** 2)", EXACT, 1.0, PASS),
    ("stdin YES/NO spelling matters", YES, "print('Yes' if int(input()) % 2 == 0 else 'No')", EXACT, 0.0,
     WRONG),
    ("stdin YES/NO right", YES, "print('YES' if int(input()) % 2 == 0 else 'NO')", EXACT, 1.0, PASS),
    # mutation: no standard import prelude for function-call programs (List is a NameError)
    ("LeetCode annotations without the typing import", TWO_SUM,
     "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
     "        d = defaultdict(int)\n        for i, x in enumerate(nums):\n"
     "            if target - x in d:\n                return [d[target - x], i]\n            d[x] = i",
     EXACT, 1.0, PASS),
    ("LeetCode heapq and Counter without imports", SQUARE_FN,
     "def square(n):\n    h = []\n    heappush(h, n * n)\n"
     "    return Counter([heappop(h)]).most_common(1)[0][0]",
     EXACT, 1.0, PASS),
    ("prelude keeps the builtin pow (three arguments)", SQUARE_FN,
     "def square(n):\n    return pow(n, 2, 1000)", EXACT, 1.0, PASS),
    # mutation: tolerance applied to integers (1000001 within 1e-6 of 1000000)
    ("stdin integer one off, with a tolerance", BIG, "print(1000001)", TOL, 0.0, WRONG),
    ("stdin integer right, with a tolerance", BIG, "print(1000000)", TOL, 1.0, PASS),
    ("function integer one off, with a tolerance", BIG_FN, "def big(x):\n    return 1000001", TOL, 0.0,
     WRONG),
    ("stdin integer for a float, with a tolerance: integers are exact", TWO_FLOATS, "print(2, 0.5)", TOL, 0.0,
     WRONG),
    ("stdin two floats within a tolerance", TWO_FLOATS, "print('2.0000001 0.49999999')", TOL, 1.0, PASS),
    # mutation: abs_tol dropped (1e-9 is not within a relative 1e-6 of 0.0)
    ("stdin 1e-9 for 0.0, with a tolerance", ZERO, "print(1e-9)", TOL, 1.0, PASS),
    ("function 1e-9 for 0.0, with a tolerance", ZERO_FN, "def tiny(x):\n    return 1e-9", TOL, 1.0, PASS),
    # mutation: the all-or-nothing early stop applied to fraction (right on test 2 of 2 only)
    ("stdin wrong on the first test, right on the second", SQUARE,
     "n = int(input())\nprint(n * n if n == 3 else 0)", EXACT, 0.5, WRONG),
    ("function raising on the first test, right on the second", SQUARE_FN,
     "def square(n):\n    assert n == 3\n    return n * n", EXACT, 0.5, ERROR),
    ("function wrong on the first test, right on the second", SQUARE_FN,
     "def square(n):\n    return 9", EXACT, 0.5, WRONG),
    # mutation: tokens compared with zip (the first token of a multi-token line passes)
    ("stdin only the first token of the line", PAIR_LINE, "print(3)", EXACT, 0.0, WRONG),
    ("stdin a token too many on the line", PAIR_LINE, "print(3, 4, 5)", EXACT, 0.0, WRONG),
    ("stdin the right tokens", PAIR_LINE, "print(3, 4)", EXACT, 1.0, PASS),
    # a row's own tolerance wins over the task's
    ("row tolerance none in a task with one", HALF_OWN_EXACT, "print(f'{int(input()) / 2:.9f}')", TOL, 0.0,
     WRONG),
    ("row tolerance 1e-3 in an exact task", HALF_OWN_LOOSE, "print(int(input()) / 2 + 1e-4)", EXACT, 1.0,
     PASS),
]  # fmt: skip


def test_table_is_large_and_has_both_kinds():
    assert len(CASES) >= 40
    assert {c[1].fn_name is None for c in CASES} == {True, False}
    assert sum(c[4] == 0.0 for c in CASES) >= 8 and sum(c[4] == 1.0 for c in CASES) >= 8


def test_every_case_scores_as_expected():
    by_options: dict[tuple, list[int]] = {}
    for i, case in enumerate(CASES):
        by_options.setdefault(tuple(sorted(case[3].items())), []).append(i)
    got = {}
    for options, rows in by_options.items():
        scorer = CodeScorer(ScoringOptions(limits=LIMITS, **dict(options)), workers=2)
        try:
            results = scorer.score_many([(CASES[i][2], CASES[i][1]) for i in rows])
        finally:
            scorer.close()
        got.update(zip(rows, results))
    wrong = [
        f"{CASES[i][0]}: got {got[i].reward} {got[i].outcome}, expected {CASES[i][4]} {CASES[i][5]}"
        for i in range(len(CASES))
        if got[i].reward != pytest.approx(CASES[i][4]) or got[i].outcome is not CASES[i][5]
    ]
    assert wrong == []


def test_identical_jobs_run_once_and_keep_their_order(monkeypatch):
    calls = []

    def counting(program, tests, options):
        calls.append((program, tests.fn_name))
        return CodeResult(float(len(program)), 0, 1, Outcome.WRONG)

    monkeypatch.setattr(code_reward, "score_program", counting)
    scorer = CodeScorer(ScoringOptions(limits=LIMITS), workers=2)
    try:
        results = scorer.score_many([("a", SUM), ("bb", SUM), ("a", SUM), ("a", ADD)])
    finally:
        scorer.close()
    assert [r.reward for r in results] == [1.0, 2.0, 1.0, 1.0]
    assert sorted(calls, key=str) == sorted([("a", None), ("bb", None), ("a", "add")], key=str)


def test_outcome_metrics_are_shares():
    results = [
        CodeResult(1.0, 3, 3, Outcome.PASS),
        CodeResult(0.0, 0, 3, Outcome.TIMEOUT),
        CodeResult(1 / 3, 1, 3, Outcome.ERROR),
        CodeResult(0.0, 0, 3, Outcome.NO_PROGRAM),
    ]
    metrics = outcome_metrics(results)
    assert metrics["reward/code_pass_frac"] == 0.25
    assert metrics["reward/code_timeout_frac"] == 0.25
    assert metrics["reward/code_error_frac"] == 0.25
    assert metrics["reward/code_no_program_frac"] == 0.25
    assert metrics["reward/code_wrong_frac"] == 0.0
    assert metrics["reward/code_tests_passed_frac"] == 4 / 12


def test_a_failure_of_the_machinery_scores_zero_and_is_logged(monkeypatch, caplog):
    def broken(program, tests, options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(code_reward, "score_program", broken)
    scorer = CodeScorer(ScoringOptions(limits=LIMITS), workers=1)
    try:
        (result,) = scorer.score_many([("print(1)", SUM)])
    finally:
        scorer.close()
    assert result == CodeResult(0.0, 0, 3, ERROR)
    assert "No space left on device" in caplog.text


def _peak_mib_and_seconds(fn):
    tracemalloc.start()
    start = time.process_time()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20, time.process_time() - start
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "flood",
    ["1\n" * (8 << 20), "1 " * (8 << 20), "\n" * (16 << 20) + "2"],
    ids=["16 MiB of short lines", "one 16 MiB line of tokens", "16 MiB of blank lines then a token"],
)
def test_comparing_a_flood_costs_bounded_memory_and_time(flood):
    """The comparison stops at the first difference: memory and CPU do not grow with the flood.

    (Splitting 16 MiB of "1 " into tokens first costs ~0.5 GB and seconds; the walk is lazy.)"""
    assert outputs_match("1\n" + flood, "1\n") is False  # not vacuous: the flood is a mismatch
    mib, seconds = _peak_mib_and_seconds(lambda: outputs_match(flood, "1\n1\n"))
    assert mib < 2 and seconds < 0.5, (mib, seconds)


def test_a_function_flooding_its_result_costs_bounded_memory():
    """A returned value far longer than the expected one is wrong without being parsed."""
    tests = parse_tests({"inputs": [[0]], "outputs": [[1, 2, 3]], "fn_name": "f"})
    options = ScoringOptions(limits=Limits(cpu_s=2, wall_s=6.0, memory_mb=512))
    program = "def f(x):\n    return list(range(1_500_000))"  # ~11 MiB of JSON, under the 16 MiB cap
    holder = []
    mib, _ = _peak_mib_and_seconds(lambda: holder.append(code_reward.score_program(program, tests, options)))
    assert (holder[0].reward, holder[0].outcome) == (0.0, WRONG)
    assert mib < 40, mib  # the output itself (<= 16 MiB), not a 1.5-million-item list (~55 MiB)
