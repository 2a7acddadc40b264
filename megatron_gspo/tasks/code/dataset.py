"""Programming problems from a data file, rewarded by running the program on their tests in a sandbox."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from megatron_gspo.tasks.base import Problem, register_task
from megatron_gspo.tasks.code.cases import extract_program, fence, parse_tests
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
    "{problem}\n\nWrite a Python 3 function `{fn_name}` that solves the problem. Give the complete code "
    "in one ```python code block at the end of your answer."
)


@register_task("code")
class CodeTask(FileTask):
    """One programming problem per row; the reward runs the completion's program on the row's tests.

    The data set is a JSON-lines file, a Parquet file or a `datasets` `save_to_disk` directory
    (`task.options.path`). Each row has a problem statement (`prompt_key`, text or chat
    messages) and tests (`tests_key`, in any form `parse_tests` reads: APPS/verl
    `{"inputs", "outputs", "fn_name"}`, CodeContests `{"input", "output"}`, LiveCodeBench test
    lists; a JSON string column is parsed). Every row's tests are checked when the file is read.

    The prompt is `template` with "{problem}" (and "{fn_name}" for function-call problems) filled
    in, then the tokenizer's chat template when `chat_template` says so. The program is the last
    fenced code block of the completion (`extract="last_block"`), or the whole completion
    (`extract="whole"`). Every program runs in the sandbox (`sandbox.py`, bubblewrap); a run
    refuses to start without one unless `sandbox: none`, which runs model-written code on the host.

    Args:
        path: the data set.
        prompt_key: field holding the problem statement.
        tests_key: field holding the tests.
        fn_name_key: field holding the function name when the tests do not carry one.
        solution_key: field holding a reference program (cold-start SFT targets); None: none.
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
        problems = []
        for number, row in rows:
            where = f"{path} {unit} {number}"
            statement = self._value(row, self.keys["prompt_key"], "prompt_key", where)
            fn_name = None
            if self.fn_name_key is not None:
                fn_name = self._value(row, self.fn_name_key, "fn_name_key", where) or None
            try:
                tests = parse_tests(
                    self._value(row, self.keys["tests_key"], "tests_key", where), fn_name, self.max_tests
                )
            except ValueError as err:
                raise ValueError(
                    f"{where} (task.options.tests_key={self.keys['tests_key']!r}): {err}"
                ) from None
            solution = ""
            if self.solution_key is not None:
                solution = str(self._value(row, self.solution_key, "solution_key", where))
            metadata = {"line": number, "tests": tests}
            messages = chat_messages(statement)
            if messages is not None:
                prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
                metadata["messages"] = messages
            else:
                template = self.template if tests.fn_name is None else self.function_template
                prompt = template.replace("{problem}", str(statement)).replace(
                    "{fn_name}", tests.fn_name or ""
                )
            problems.append(Problem(prompt, solution, metadata))
        if not problems:
            raise ValueError(f"{option}={path} holds no problems")
        return problems

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
        results = self.score(problems, completions)
        return [r.reward for r in results], outcome_metrics(results)

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
