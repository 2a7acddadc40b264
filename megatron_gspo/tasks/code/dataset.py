"""Programming problems from a data file, rewarded by running the program on their tests in a sandbox."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

from megatron_gspo.tasks.base import Problem, register_task
from megatron_gspo.tasks.code.cases import extract_program, fence, parse_tests
from megatron_gspo.tasks.code.explain import sample_fields
from megatron_gspo.tasks.code.reward import CodeResult, CodeScorer, ScoringOptions, outcome_metrics
from megatron_gspo.tasks.code.sandbox import Limits, SandboxUnavailableError, sandbox_runner
from megatron_gspo.tasks.data_files import chat_messages, field, read_rows
from megatron_gspo.tasks.file_task import FileTask

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "{problem}\n\nWrite a Python 3 program that solves the problem. Give the complete program in one "
    "```python code block at the end of your answer."
)
FUNCTION_TEMPLATE = (
    "{problem}\n\nWrite a Python 3 function `{fn_name}` that solves the problem, starting from:\n"
    "```python\n{starter_code}\n```\nGive the complete code in one ```python code block at the end of "
    "your answer."
)
BAD_ROW_MODES = ("raise", "skip")


@register_task("code")
class CodeTask(FileTask):
    """One programming problem per row; the reward runs the completion's program on the row's tests.

    The data set is a JSON-lines file, a Parquet file or a `datasets` `save_to_disk` directory
    (`task.options.path`). Each row has a problem statement (`prompt_key`, text or chat
    messages) and tests (`tests_key`, in any form `parse_tests` reads: APPS/verl
    `{"inputs", "outputs", "fn_name"}`, CodeContests `{"input", "output"}`, LiveCodeBench test
    lists; a JSON string column is parsed). Every row's tests are checked when the file is read.

    The prompt is `template` with "{problem}" (and "{fn_name}", "{starter_code}" for
    function-call problems) filled in, then the tokenizer's chat template when `chat_template`
    says so. The program is the last fenced code block of the completion
    (`extract="last_block"`), or the whole completion (`extract="whole"`). Every program runs
    in the sandbox (`sandbox.py`, bubblewrap); a run refuses to start without one unless
    `sandbox: none`, which runs model-written code on the host.

    Args:
        path: the data set.
        prompt_key: field holding the problem statement.
        tests_key: field holding the tests.
        fn_name_key: field holding the function name when the tests do not carry one (read only
            for rows whose tests are function calls; a dotted key reaches into JSON strings).
        solution_key: field holding a reference program (cold-start SFT targets); None: none. A
            list of programs, or a JSON string of one (APPS `solutions`), gives its first.
        starter_code_key: field holding the function's starter code ("{starter_code}"); a row
            without it (or None) gets `def fn_name(arg1, ...):` with the tests' argument count.
        float_tolerance_key: field holding a row's own float tolerance (null: exact); rows
            without the field use `float_tolerance`.
        on_bad_row: "raise" (a bad row stops the run, naming it) or "skip" (it is left out,
            logged and counted in `reward/code_rows_skipped`).
        prelude: run function-call programs after the standard imports (`typing`'s names,
            `collections`, `heapq`, `math`, ...) as LiveCodeBench's harness does.
        template: prompt text for stdin/stdout problems.
        function_template: prompt text for function-call problems.
        chat_template: apply the tokenizer's chat template (None: when the tokenizer has one).
        extract: "last_block" or "whole".
        reward: "fraction" of tests passed, or "all" (1.0 only when every test passes).
        compare: "tokens" (whitespace-insensitive lines) or "exact".
        float_tolerance: absolute-or-relative tolerance for numbers in outputs (None: exact).
        time_limit_s: CPU seconds per test.
        wall_limit_s: wall-clock seconds per run (None: 2 x time_limit_s + 2).
        memory_mb: address-space limit per run.
        max_tests: run at most this many tests per problem (the first ones; None: all).
        sandbox: "bwrap" (bubblewrap) or "none" (no isolation; logged as a warning).
        python: the interpreter programs run with (None: the system's python3).
        workers: programs scored at once (threads, each waiting on one sandboxed process).
        max_prompt_len: prompt budget in tokens (checked at start-up).
        max_answer_len: response budget in tokens.
    """

    def __init__(
        self,
        path: str,
        prompt_key: str = "question",
        tests_key: str = "input_output",
        fn_name_key: str | None = None,
        solution_key: str | None = None,
        starter_code_key: str | None = "starter_code",
        float_tolerance_key: str | None = None,
        on_bad_row: str = "raise",
        prelude: bool = True,
        template: str = DEFAULT_TEMPLATE,
        function_template: str = FUNCTION_TEMPLATE,
        chat_template: bool | None = None,
        extract: str = "last_block",
        reward: str = "fraction",
        compare: str = "tokens",
        float_tolerance: float | None = None,
        time_limit_s: int = 2,
        wall_limit_s: float | None = None,
        memory_mb: int = 512,
        max_tests: int | None = None,
        sandbox: str = "bwrap",
        python: str | None = None,
        workers: int = 4,
        max_prompt_len: int = 2048,
        max_answer_len: int = 4096,
    ):
        for name, text in (("template", template), ("function_template", function_template)):
            if "{problem}" not in text:
                raise ValueError(f"{name} must contain '{{problem}}', got {text!r}")
        if extract not in ("last_block", "whole"):
            raise ValueError(f"extract must be 'last_block' or 'whole', got {extract!r}")
        if on_bad_row not in BAD_ROW_MODES:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_MODES}, got {on_bad_row!r}")
        if prelude not in (True, False):
            raise ValueError(f"prelude must be true or false, got {prelude!r}")
        if chat_template not in (None, True, False):
            raise ValueError(f"chat_template must be true, false or unset, got {chat_template!r}")
        wall = wall_limit_s if wall_limit_s is not None else 2.0 * time_limit_s + 2.0
        self.options = ScoringOptions(
            reward=reward,
            limits=Limits(cpu_s=time_limit_s, wall_s=wall, memory_mb=memory_mb),
            compare=compare,
            float_tolerance=float_tolerance,
            sandbox=sandbox,
            python=python,
            prelude=prelude,
        )
        if sandbox == "none":
            logger.warning(
                "task.options.sandbox=none: MODEL-WRITTEN PROGRAMS RUN ON THIS HOST WITHOUT ISOLATION "
                "(only CPU, memory, file-size and process limits); they can read and write your files "
                "and reach the network. Use it only on a throwaway machine."
            )
        try:  # refuse now, naming what to install, rather than at the first reward
            sandbox_runner(sandbox, python)
        except SandboxUnavailableError as err:
            raise ValueError(
                f"task.options.sandbox={sandbox}: {err}; task.options.sandbox=none runs programs without "
                "isolation (unsafe)"
            ) from None
        self.keys = {"prompt_key": prompt_key, "tests_key": tests_key}
        self.fn_name_key, self.solution_key, self.max_tests = fn_name_key, solution_key, max_tests
        self.starter_code_key, self.float_tolerance_key = starter_code_key, float_tolerance_key
        self.on_bad_row, self.rows_skipped = on_bad_row, 0
        self.template, self.function_template, self.extract = template, function_template, extract
        self.chat_template = chat_template
        self.max_prompt_len, self.max_answer_len = max_prompt_len, max_answer_len
        self.scorer = CodeScorer(self.options, workers)
        self._load(path)

    def _value(self, row: dict, key: str, name: str, where: str):
        try:
            return field(row, key)
        except KeyError:
            raise ValueError(
                f"{where} has no field for task.options.{name}={key!r}; its fields: {sorted(row)}"
            ) from None

    def _read(self, path: str, option: str) -> list[Problem]:
        unit, rows = read_rows(path, option)
        problems, skipped = [], []
        for number, row in rows:
            where = f"{path} {unit} {number}"
            try:
                problems.append(self.row_problem(row, number, where))
            except ValueError as err:
                if self.on_bad_row == "raise":
                    raise
                skipped.append(str(err))
        if skipped:  # one line for the count, the first reasons for what to fix
            self.rows_skipped += len(skipped)
            logger.warning(
                "%s=%s: skipped %d bad row(s) of %d (task.options.on_bad_row=skip); first: %s",
                option, path, len(skipped), len(rows), " | ".join(skipped[:3]),
            )  # fmt: skip
        if not problems:
            raise ValueError(f"{option}={path} holds no problems")
        return problems

    def row_problem(self, row: dict, number: int, where: str) -> Problem:
        """The problem of one data row (`number` as `where` names it, e.g. "data.jsonl line 3").

        Raises:
            ValueError: a field missing or of the wrong shape, naming `where` and the option.
        """
        statement = self._value(row, self.keys["prompt_key"], "prompt_key", where)
        raw_tests = self._value(row, self.keys["tests_key"], "tests_key", where)
        fn_name = None
        if self.fn_name_key is not None:  # only function-call rows need it: a stdin row may lack it
            try:
                fn_name = field(row, self.fn_name_key) or None
            except KeyError:
                pass
        try:
            tests = parse_tests(raw_tests, fn_name, self.max_tests)
        except ValueError as err:
            hint = ""
            if "function name" in str(err) and self.fn_name_key is not None:
                hint = f" (task.options.fn_name_key={self.fn_name_key!r} is not in the row)"
            raise ValueError(
                f"{where} (task.options.tests_key={self.keys['tests_key']!r}): {err}{hint}"
            ) from None
        if self.float_tolerance_key is not None:
            try:
                tolerance = field(row, self.float_tolerance_key)
            except KeyError:
                tolerance = ...
            if tolerance is not ...:
                if tolerance is not None and not (isinstance(tolerance, int | float) and tolerance >= 0):
                    raise ValueError(
                        f"{where}: task.options.float_tolerance_key={self.float_tolerance_key!r} holds "
                        f"{tolerance!r}; expected a number >= 0 or null"
                    )
                tests = dataclasses.replace(tests, float_tolerance=tolerance, own_tolerance=True)
        solution = ""
        if self.solution_key is not None:
            solution = _solution(self._value(row, self.solution_key, "solution_key", where), where)
        metadata = {"line": number, "tests": tests}
        messages = chat_messages(statement)
        if messages is not None:
            metadata["messages"] = messages
            return Problem("\n".join(f"{m['role']}: {m['content']}" for m in messages), solution, metadata)
        if tests.fn_name is None:
            return Problem(self.template.replace("{problem}", str(statement)), solution, metadata)
        prompt = self.function_template.replace("{problem}", str(statement)).replace(
            "{fn_name}", tests.fn_name
        )
        return Problem(prompt.replace("{starter_code}", self._starter(row, tests)), solution, metadata)

    def _starter(self, row: dict, tests) -> str:
        """The row's starter code, or a signature with the tests' argument count."""
        if self.starter_code_key is not None:
            try:
                code = field(row, self.starter_code_key)
            except KeyError:
                code = None
            if isinstance(code, str) and code.strip():
                return code.rstrip()
        args = ", ".join(f"arg{i + 1}" for i in range(len(tests.inputs[0])))
        return f"def {tests.fn_name}({args}):"

    def program(self, completion: str) -> str | None:
        """The program in `completion` (`extract`), or None."""
        return extract_program(completion, self.extract)

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[CodeResult]:
        """Each completion's program run on its problem's tests, in the pool."""
        jobs = [(self.program(c), p.metadata["tests"]) for p, c in zip(problems, completions, strict=True)]
        return self.scorer.score_many(jobs)

    def reward(self, problem: Problem, completion: str) -> float:
        """Share of tests passed (or 1.0 / 0.0 with reward="all"); 0.0 without a program."""
        return self.score([problem], [completion])[0].reward

    def score_batch(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards of a batch, scored in the pool, and its `reward/code_*` outcome shares."""
        rewards, metrics, _ = self.score_rows(problems, completions)
        return rewards, metrics

    def score_rows(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, float], list[dict]]:
        """`score_batch`, and each row's outcome, tests passed and first failure (`explain.sample_fields`)."""
        results = self.score(problems, completions)
        metrics = outcome_metrics(results)
        metrics["reward/code_rows_skipped"] = float(self.rows_skipped)
        fields = [sample_fields(r, p.metadata["tests"]) for r, p in zip(results, problems, strict=True)]
        return [r.reward for r in results], metrics, fields

    def judge_batch(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], list[bool]]:
        """(rewards, every test passed) of one completion per problem, each program run once."""
        results = self.score(problems, completions)
        return [r.reward for r in results], [r.passed == r.total for r in results]

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """Correct means every test passed."""
        result = self.score([problem], [completion])[0]
        return result.passed == result.total

    def has_answer(self, completion: str) -> bool:
        """Whether the completion holds a program."""
        return self.program(completion) is not None

    def sft_example(self, problem: Problem) -> tuple[str | list[dict[str, str]], str]:
        """(prompt or chat messages, the reference program in the form `extract` reads)."""
        if not problem.answer:
            raise ValueError(
                "cold-start SFT on the code task needs reference programs: set task.options.solution_key"
            )
        target = problem.answer if self.extract == "whole" else fence(problem.answer)
        return problem.metadata.get("messages") or problem.prompt, target


def _solution(value, where: str) -> str:
    """A reference program: text, or the first of a list of programs (APPS: a JSON string of one)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # a program that happens to start with "[" is a program
    if isinstance(value, list | tuple):
        programs = [p for p in value if isinstance(p, str) and p.strip()]
        if not programs or len(programs) != len(value):
            raise ValueError(
                f"{where}: task.options.solution_key holds a list of {len(value)} item(s) that are not all "
                "non-empty program texts"
            )
        return programs[0]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{where}: task.options.solution_key holds {type(value).__name__} {str(value)[:40]!r}, "
            "not a program"
        )
    return value
