"""The code reward: run a program on a problem's tests in the sandbox, and score many in a pool.

`score_program` runs one program: stdin/stdout tests one sandboxed process per test (the
input on standard input, the output compared by `outputs_match`); function-call tests one
sandboxed process for all of them (`function_harness.py` calls the function with a CPU timer
per test, the parent compares the returned values by `values_match`). The reward is the share
of tests passed (`reward="fraction"`) or 1.0 only when all pass (`reward="all"`, which stops at
the first failure). It never raises: no program, a compile error, a crash or a timeout is a
failed test, and the result's `outcome` says which came first. The result also keeps each
test's outcome and time (`tests`, the tests that ran) and what the first failing test did
(`failure`: its output and standard error, truncated), for `megatron-gspo score` and the
samples log; neither changes the reward.

A program that does not compile is an error without being run, when the sandbox's interpreter
is this one's version (its syntax is then this one's).

`CodeScorer` scores a batch in a bounded thread pool (each thread waits on its own sandboxed
process; the same program for the same problem runs once) and reports the outcomes' shares as
`reward/code_*` metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from megatron_gspo.tasks.code.cases import TestSuite
from megatron_gspo.tasks.code.compare import COMPARE_MODES, outputs_match, values_match
from megatron_gspo.tasks.code.sandbox import CODE_DIR, Limits, RunStatus, sandbox_runner

logger = logging.getLogger(__name__)

REWARD_MODES = ("fraction", "all")
HARNESS = Path(__file__).with_name("function_harness.py")
DETAIL_CHARS = 2000
"""Most characters of a failing test's output or standard error a result keeps."""


class Outcome(StrEnum):
    """What a program's run came to: the first failure's kind, or PASS when every test passed."""

    PASS = "pass"
    WRONG = "wrong"  # ran, wrong output
    ERROR = "error"  # compile error, crash, memory limit, missing function
    TIMEOUT = "timeout"  # CPU or wall-clock limit
    NO_PROGRAM = "no_program"  # the completion holds no program


@dataclass(frozen=True)
class TestRun:
    """One test's result.

    Attributes:
        index: the test's position in its suite (from 0).
        outcome: PASS, WRONG, ERROR or TIMEOUT.
        time_s: seconds it took: the sandboxed run's wall time (stdin tests), or the
            function call's inside the harness (function-call tests; None when it died).
    """

    index: int
    outcome: Outcome
    time_s: float | None


@dataclass(frozen=True)
class Failure:
    """What the first failing test did (or what stopped the program before any test).

    Attributes:
        test: its index in the suite; None when no test ran (no program, a compile error).
        actual: its standard output or returned value (JSON), truncated; None when it gave none.
        stderr: its standard error or the error it raised, truncated (the tail: a traceback's
            last lines say what broke).
    """

    test: int | None
    actual: str | None
    stderr: str


@dataclass(frozen=True)
class CodeResult:
    """The score of one program.

    Attributes:
        reward: share of tests passed ("fraction") or 1.0 / 0.0 ("all").
        passed: tests passed.
        total: tests of the problem.
        outcome: the first failure's kind, or PASS.
        tests: the tests that ran, in order (reward="all" stops at the first failure; a
            function-call run that died has none after it). Not part of equality.
        failure: the first failure's detail; None when every test passed. Not part of equality.
    """

    reward: float
    passed: int
    total: int
    outcome: Outcome
    tests: tuple[TestRun, ...] = field(default=(), compare=False)
    failure: Failure | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ScoringOptions:
    """How programs are run and judged.

    Attributes:
        reward: "fraction" of tests passed, or "all" (1.0 only when every test passes).
        limits: the sandbox's limits per run (`cpu_s` is also each function-call test's budget).
        compare: "tokens" (whitespace-insensitive lines) or "exact" standard-output comparison.
        float_tolerance: absolute-or-relative tolerance for numbers (None: exact spelling/value).
        sandbox: "bwrap" or "none" (no isolation; see `sandbox.py`).
        python: the interpreter programs run with (None: the system's python3).
        prelude: function-call programs run after the standard imports (LiveCodeBench's habit:
            `List[int]` without `from typing import List` is not an error).
    """

    reward: str = "fraction"
    limits: Limits = Limits()
    compare: str = "tokens"
    float_tolerance: float | None = None
    sandbox: str = "bwrap"
    python: str | None = None
    prelude: bool = True

    def __post_init__(self):
        if self.reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {self.reward!r}")
        if self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {COMPARE_MODES}, got {self.compare!r}")
        if self.float_tolerance is not None and not self.float_tolerance >= 0:
            raise ValueError(f"float_tolerance must be >= 0, got {self.float_tolerance}")


_FAIL_STATUS = {RunStatus.ERROR: Outcome.ERROR, RunStatus.TIMEOUT: Outcome.TIMEOUT}


def head(text: str, limit: int = DETAIL_CHARS) -> str:
    """The first `limit` characters of `text`, saying how many were cut."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


def tail(text: str, limit: int = DETAIL_CHARS) -> str:
    """The last `limit` characters of `text`, saying how many were cut."""
    return text if len(text) <= limit else f"[{len(text) - limit} characters before] ...{text[-limit:]}"


def _result(runs: list[TestRun], total: int, failure: Failure | None, options: ScoringOptions) -> CodeResult:
    passed = sum(r.outcome is Outcome.PASS for r in runs)
    first = next((r.outcome for r in runs if r.outcome is not Outcome.PASS), None)
    if options.reward == "all":
        reward = 1.0 if passed == total else 0.0
    else:
        reward = passed / total
    return CodeResult(reward, passed, total, first or Outcome.PASS, tuple(runs), failure)


def _tolerance(tests: TestSuite, options: ScoringOptions) -> float | None:
    """The row's own tolerance when it has one, else the task's."""
    return tests.float_tolerance if tests.own_tolerance else options.float_tolerance


def _compile_error(program: str) -> str | None:
    """Why `program` does not compile, or None (compiling executes none of its code: nothing runs here)."""
    try:
        compile(program, "main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def score_program(program: str | None, tests: TestSuite, options: ScoringOptions) -> CodeResult:
    """Run `program` on `tests` in the sandbox and score it (see the module docstring); never raises."""
    if program is None:
        return CodeResult(0.0, 0, len(tests), Outcome.NO_PROGRAM, failure=Failure(None, None, ""))
    runner = sandbox_runner(options.sandbox, options.python)
    if runner.version == sys.version_info[:2]:
        error = _compile_error(program)
        if error is not None:  # no need to start a sandbox to learn that
            return CodeResult(0.0, 0, len(tests), Outcome.ERROR, failure=Failure(None, None, tail(error)))
    if tests.fn_name is not None:
        return _score_function(runner, program, tests, options)
    runs, failure = [], None
    for index, (stdin, expected) in enumerate(zip(tests.inputs, tests.outputs)):
        run = runner.run(
            {"main.py": program}, [runner.python, f"{CODE_DIR}/main.py"], stdin.encode(), options.limits
        )
        got = run.stdout.decode("utf-8", "replace")
        if run.status is RunStatus.OK:
            ok = outputs_match(
                got, expected, mode=options.compare, float_tolerance=_tolerance(tests, options)
            )
            outcome = Outcome.PASS if ok else Outcome.WRONG
        else:
            outcome = _FAIL_STATUS[run.status]
        runs.append(TestRun(index, outcome, run.wall_s))
        if outcome is not Outcome.PASS:
            failure = failure or Failure(index, head(got), tail(run.stderr))
            if options.reward == "all":
                break
    return _result(runs, len(tests), failure, options)


def _score_function(runner, program: str, tests: TestSuite, options: ScoringOptions) -> CodeResult:
    stop = "1" if options.reward == "all" else "0"
    argv = [runner.python, f"{CODE_DIR}/harness.py", f"{CODE_DIR}/main.py", tests.fn_name]
    argv += [str(options.limits.cpu_s), stop, "1" if options.prelude else "0"]
    files = {"main.py": program, "harness.py": HARNESS.read_text(encoding="utf-8")}
    per_test = options.limits
    extra = per_test.cpu_s * (len(tests) - 1)  # the whole run's budget: every test's
    total_limits = dataclasses.replace(per_test, cpu_s=per_test.cpu_s + extra, wall_s=per_test.wall_s + extra)
    run = runner.run(files, argv, json.dumps([list(a) for a in tests.inputs]).encode(), total_limits)
    lines = iter(run.stdout.split(b"\n"))
    runs, failure = [], None
    tolerance = _tolerance(tests, options)
    for index, expected in enumerate(tests.outputs):
        line = next(lines, b"")
        # a value far longer than the expected one is wrong without parsing it (bounded memory);
        # the margin covers the harness's own fields ("time_s")
        too_long = len(line) > 2 * len(json.dumps(expected)) + 256 + 32
        try:
            record = None if too_long else json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            record = None
        if not isinstance(record, dict) and not too_long:  # the harness died (or never ran the test)
            runs.append(TestRun(index, _FAIL_STATUS.get(run.status, Outcome.ERROR), None))
            failure = failure or Failure(index, None, tail(run.stderr))
            break
        actual, error = None, ""
        if too_long:
            outcome = Outcome.WRONG
            actual = f"{line[:DETAIL_CHARS].decode('utf-8', 'replace')}... [{len(line)} bytes in all]"
        elif "value" in record:
            ok = values_match(record["value"], expected, float_tolerance=tolerance)
            outcome = Outcome.PASS if ok else Outcome.WRONG
            if not ok:
                actual = head(json.dumps(record["value"]))
        else:
            outcome = Outcome.TIMEOUT if record.get("timeout") else Outcome.ERROR
            error = str(record.get("error", ""))
        time_s = record.get("time_s") if isinstance(record, dict) else None
        runs.append(TestRun(index, outcome, time_s if isinstance(time_s, int | float) else None))
        if outcome is not Outcome.PASS:
            stderr = "\n".join(text for text in (error, run.stderr) if text)
            failure = failure or Failure(index, actual, tail(stderr))
            if options.reward == "all":
                break
    return _result(runs, len(tests), failure, options)


def outcome_metrics(results: Sequence[CodeResult]) -> dict[str, float]:
    """`reward/code_<outcome>_frac` (share of programs per outcome) and `reward/code_tests_passed_frac`."""
    counts = Counter(r.outcome for r in results)
    n = max(len(results), 1)
    metrics = {f"reward/code_{o.value}_frac": counts[o] / n for o in Outcome}
    tests = sum(r.total for r in results)
    metrics["reward/code_tests_passed_frac"] = sum(r.passed for r in results) / max(tests, 1)
    return metrics


class CodeScorer:
    """Scores many programs at once in a bounded pool of threads, each driving one sandboxed run.

    Args:
        options: how programs are run and judged.
        workers: most programs running at once (a sandboxed run mostly waits on its process;
            about the machine's cores is right).
    """

    def __init__(self, options: ScoringOptions, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.options, self.workers = options, workers
        self._pool: ThreadPoolExecutor | None = None

    def score_many(self, jobs: Sequence[tuple[str | None, TestSuite]]) -> list[CodeResult]:
        """Results of (program, tests) jobs, in order; identical jobs run once."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="code-scorer")
        futures = {}
        for program, tests in jobs:
            key = (program, id(tests))
            if key not in futures:
                futures[key] = self._pool.submit(score_program, program, tests, self.options)
        return [self._result(futures[(program, id(tests))], tests) for program, tests in jobs]

    @staticmethod
    def _result(future, tests: TestSuite) -> CodeResult:
        """The job's result; a failure of the machinery itself (e.g. a full temp dir) is logged, scored 0."""
        try:
            return future.result()
        except Exception as err:  # the reward never raises; the log says what broke
            logger.warning(
                "scoring a program failed outside the program (%s: %s); reward 0", type(err).__name__, err
            )
            return CodeResult(0.0, 0, len(tests), Outcome.ERROR, failure=Failure(None, None, tail(str(err))))

    def close(self) -> None:
        """Stop the pool's threads (the running programs finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
