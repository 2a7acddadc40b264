"""A program's score as plain data: each test's outcome and time, and what its first failing test did.

`megatron-gspo score` prints it (or writes it as JSON) and the samples log keeps its short form
for code rows. Tests are numbered from 1 here, as a person counts them; the input and expected
output come from the problem's `TestSuite`, the actual output and standard error from the
`CodeResult`, every text cut to `limit` characters (the head of an input or output, the tail of
standard error, where a traceback says what broke).
"""

from __future__ import annotations

import json
from typing import Any

from megatron_gspo.tasks.code.cases import TestSuite
from megatron_gspo.tasks.code.reward import CodeResult, head, tail


def as_text(value: Any, fn_name: str | None) -> str:
    """A test's input or expected output as text: stdin/stdout text as is, function values as JSON."""
    return value if fn_name is None and isinstance(value, str) else json.dumps(value)


def first_failure(result: CodeResult, tests: TestSuite, limit: int) -> dict[str, Any] | None:
    """{"test", "input", "expected", "actual", "stderr"} of the first failing test, cut to `limit`.

    "test" is None (and so are "input" and "expected") when no test ran: no program, or one
    that does not compile. None when every test passed.
    """
    failure = result.failure
    if failure is None:
        return None
    record: dict[str, Any] = {"test": None, "input": None, "expected": None}
    if failure.test is not None:
        record = {
            "test": failure.test + 1,
            "input": head(as_text(tests.inputs[failure.test], tests.fn_name), limit),
            "expected": head(as_text(tests.outputs[failure.test], tests.fn_name), limit),
        }
    record["actual"] = None if failure.actual is None else head(failure.actual, limit)
    record["stderr"] = tail(failure.stderr, limit)
    return record


def result_record(result: CodeResult, tests: TestSuite, limit: int) -> dict[str, Any]:
    """The whole result: outcome, reward, each test that ran, the tests not run, the first failure."""
    return {
        "outcome": result.outcome.value,
        "reward": result.reward,
        "passed": result.passed,
        "total": result.total,
        "tests": [
            {"test": run.index + 1, "outcome": run.outcome.value, "time_s": run.time_s}
            for run in result.tests
        ],
        "not_run": result.total - len(result.tests),
        "first_failure": first_failure(result, tests, limit),
    }


def sample_fields(result: CodeResult, tests: TestSuite, limit: int = 300) -> dict[str, Any]:
    """The samples log's fields of a code row: outcome, tests passed of all, the first failure."""
    return {
        "outcome": result.outcome.value,
        "tests_passed": f"{result.passed}/{result.total}",
        "first_failure": first_failure(result, tests, limit),
    }
