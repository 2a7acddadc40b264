"""Correct and wrong programs for stdin/stdout and function-call problems score as the table says.

Every row runs in the real sandbox; the whole table is scored in one pooled batch (as a rollout
batch is), so the pool's ordering and de-duplication are checked too.
"""

import pytest

from megatron_gspo.tasks.code import reward as code_reward
from megatron_gspo.tasks.code.cases import parse_tests
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
]  # fmt: skip


def test_table_is_large_and_has_both_kinds():
    assert len(CASES) >= 20
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
