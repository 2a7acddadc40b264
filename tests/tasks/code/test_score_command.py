"""`megatron-gspo score` on an APPS-style stdin row and a LiveCodeBench-style function row.

Each program runs in the real sandbox through the CLI's own `main`; what a right, a wrong and a
crashing program print and exit with is known by hand (the wrong program's output is worked out
from its source below).
"""

import json
import sys

import pytest
from cli_in_process import run_cli_in_process

from megatron_gspo.tasks.code.cases import parse_tests
from megatron_gspo.tasks.code.reward import Outcome, ScoringOptions, score_program
from megatron_gspo.tasks.code.sandbox import Limits, sandbox_runner

APPS_ROW = {  # APPS: the tests as a JSON string column, an integer problem id
    "problem_id": 4000,
    "question": "Print the sum of two integers.",
    "input_output": json.dumps({"inputs": ["1 2\n", "10 -4\n", "0 0\n"], "outputs": ["3\n", "6\n", "0\n"]}),
}
LCB_ROW = {  # LiveCodeBench: functional tests as JSON lines, the function name inside `metadata`
    "question_id": "abc301_a",
    "question_content": "Return the larger of a and b.",
    "public_test_cases": json.dumps([
        {"input": "1\n2", "output": "2", "testtype": "functional"},
        {"input": "7\n3", "output": "7", "testtype": "functional"},
    ]),
    "metadata": json.dumps({"func_name": "larger"}),
}  # fmt: skip
LCB_OPTIONS = [
    "--task-option", "prompt_key=question_content", "--task-option", "tests_key=public_test_cases",
    "--task-option", "fn_name_key=metadata.func_name",
]  # fmt: skip
SUM_RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_WRONG = "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)\n"  # 10 -4 -> 14
SUM_CRASH = "a, b = map(int, input().split())\nprint(a // (b - b))\n"
LARGER_RIGHT = "class Solution:\n    def larger(self, a: int, b: int) -> int:\n        return max(a, b)\n"
# min, not max; `List` without its import (the prelude gives it, as LiveCodeBench's harness does)
LARGER_WRONG = "class Solution:\n    def larger(self, a: List[int], b):\n        return min(a, b)\n"
LARGER_CRASH = "def larger(a, b):\n    return {}[a]\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "apps.jsonl").write_text(json.dumps(APPS_ROW) + "\n")
    (tmp_path / "lcb.jsonl").write_text("\n" + json.dumps(LCB_ROW) + "\n")  # its row is line 2
    return tmp_path


def score(*args: str):
    return run_cli_in_process("score", *args)


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_apps_row_right_wrong_and_crashing(files):
    data = str(files / "apps.jsonl")
    right = score(data, "--row", "1", "--program", write(files / "right.py", SUM_RIGHT))
    assert right.returncode == 0, right.stderr
    assert "outcome: pass  passed 3/3  reward 1" in right.stdout

    wrong = score(data, "--id", "4000", "--program", write(files / "wrong.py", SUM_WRONG), "--json")
    assert wrong.returncode == 1, wrong.stderr
    record = json.loads(wrong.stdout)
    assert [t["outcome"] for t in record["tests"]] == ["pass", "wrong", "pass"]
    assert all(t["time_s"] > 0 for t in record["tests"])
    assert (record["outcome"], record["passed"], record["total"]) == ("wrong", 2, 3)
    assert record["reward"] == pytest.approx(2 / 3)
    assert record["first_failure"] == {
        "test": 2, "input": "10 -4\n", "expected": "6\n", "actual": "14\n", "stderr": ""
    }  # fmt: skip

    crash = score(data, "--row", "1", "--program", write(files / "crash.py", SUM_CRASH))
    assert crash.returncode == 1, crash.stderr
    assert "outcome: error  passed 0/3" in crash.stdout
    assert "first failure: test 1" in crash.stdout
    assert "ZeroDivisionError: integer division or modulo by zero" in crash.stdout


def test_lcb_function_row_right_wrong_and_crashing(files):
    data = str(files / "lcb.jsonl")
    completion = write(files / "response.txt", f"Here:\n```python\n{LARGER_RIGHT}```\n")
    right = score(data, "--id", "abc301_a", "--completion", completion, *LCB_OPTIONS)
    assert right.returncode == 0, right.stderr
    assert "lcb.jsonl line 2: function larger problem, 2 test(s)" in right.stdout
    assert "outcome: pass  passed 2/2" in right.stdout

    wrong = score(
        data, "--row", "2", "--program", write(files / "w.py", LARGER_WRONG), "--json", *LCB_OPTIONS
    )
    assert wrong.returncode == 1, wrong.stderr
    record = json.loads(wrong.stdout)
    assert [t["outcome"] for t in record["tests"]] == ["wrong", "wrong"]  # min, not max
    assert record["first_failure"] == {
        "test": 1,
        "input": "[1, 2]",
        "expected": "2",
        "actual": "1",
        "stderr": "",
    }

    crash = score(data, "--row", "2", "--program", write(files / "c.py", LARGER_CRASH), *LCB_OPTIONS)
    assert crash.returncode == 1, crash.stderr
    assert "KeyError: 1" in crash.stdout and "outcome: error" in crash.stdout


def compiled_by_the_caller() -> bool:
    """Whether `score_program` compiles a program before any sandbox run (same Python inside and out)."""
    return sandbox_runner("bwrap", None).version == sys.version_info[:2]


def test_a_completion_without_a_program_and_one_that_does_not_compile(files):
    data = str(files / "apps.jsonl")
    none = score(
        data, "--row", "1", "--completion", write(files / "none.txt", "I cannot solve it."), "--json"
    )
    assert none.returncode == 1
    record = json.loads(none.stdout)
    assert record["outcome"] == "no_program" and record["not_run"] == 3 and record["tests"] == []
    bad = score(data, "--row", "1", "--program", write(files / "bad.py", "print(1"))
    assert bad.returncode == 1 and "SyntaxError" in bad.stdout
    # The scorer compiles a program itself only where the sandbox's Python is its own version
    # (the 3.12 stage's sandbox runs the system's 3.11): else test 1 shows the sandbox's traceback.
    first = "before any test ran" if compiled_by_the_caller() else "test 1"
    assert f"first failure: {first}" in bad.stdout


def test_per_test_detail_does_not_change_the_reward():
    """The same result fields as before the detail was added; the detail says which test failed how."""
    tests = parse_tests({"inputs": ["1 2\n", "10 -4\n"], "outputs": ["3\n", "6\n"]})
    options = ScoringOptions(reward="all", limits=Limits(cpu_s=1, wall_s=3.0, memory_mb=256))
    result = score_program("print(3)", tests, options)
    assert (result.reward, result.passed, result.total, result.outcome) == (0.0, 1, 2, Outcome.WRONG)
    assert [(r.index, r.outcome) for r in result.tests] == [(0, Outcome.PASS), (1, Outcome.WRONG)]
    assert (result.failure.test, result.failure.actual) == (1, "3\n")
