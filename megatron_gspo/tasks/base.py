"""What a verifiable task is: problems, a reward, a fixed held-out split, and a registry.

A task draws `Problem`s (prompt text + reference answer) from a space of problems, scores a
completion with `reward`, and splits its space deterministically into training and held-out
problems by hashing the prompt, so the split never depends on a seed, on the sampling order or
on which options (e.g. digit counts) a run used: a held-out prompt is held out everywhere.
"""

from __future__ import annotations

import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    Attributes:
        prompt: text given to the policy (without BOS; the caller adds special tokens).
        answer: reference answer text; for the demo tasks also the exact expected completion.
        metadata: task-specific details (e.g. the operands); not part of equality or hashing.
    """

    prompt: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


def stable_bucket(key: str, buckets: int) -> int:
    """Bucket of `key` in [0, buckets) from an unkeyed BLAKE2b hash, identical on every machine.

    Python's `hash(str)` is salted per process, so it cannot define a split.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


class Task(ABC):
    """A verifiable task: problem sampling, reward, held-out split, cold-start SFT targets.

    Subclasses implement `draw_problem` (one uniform draw from the whole problem space, held-out
    problems included) and `reward`, and set `name`, `max_prompt_len` and `max_answer_len`
    (in characters, which is tokens for the char-level tokenizer). The split is by prompt hash:
    a prompt is held out when `stable_bucket(prompt, heldout_buckets) == 0`.
    """

    name: str = ""
    max_prompt_len: int = 0
    max_answer_len: int = 0
    heldout_buckets: int = 10  # one prompt in 10 is held out
    chat_template: bool | None = None  # prompts through the tokenizer's chat template (None: if it has one)

    @abstractmethod
    def draw_problem(self, rng: np.random.Generator) -> Problem:
        """One problem drawn from the full space (training and held-out alike)."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Scalar reward of `completion` (decoded text after the prompt, special tokens removed)."""

    def score_batch(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards of a batch's completions (one per problem, in order) and the task's own metrics.

        The default calls `reward` on each; a task whose reward is costly (running programs)
        scores the batch at once and reports its outcomes as metrics (e.g. `reward/code_*`).
        """
        return [float(self.reward(p, c)) for p, c in zip(problems, completions, strict=True)], {}

    def score_rows(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, float], list[dict[str, Any]]]:
        """`score_batch`, and per completion the fields its samples-log row adds (none by default).

        A task whose reward has parts worth reading beside the completion (the code task: the
        outcome and the first failing test) returns them here, from the same scoring.
        """
        rewards, metrics = self.score_batch(problems, completions)
        return rewards, metrics, [{} for _ in rewards]

    def judge_batch(
        self, problems: Sequence[Problem], completions: Sequence[str]
    ) -> tuple[list[float], list[bool]]:
        """(rewards, correct) of one completion per problem, for evaluation (`reward`, `is_correct`)."""
        pairs = list(zip(problems, completions, strict=True))
        return [float(self.reward(p, c)) for p, c in pairs], [self.is_correct(p, c) for p, c in pairs]

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """Exact match of the stripped completion with the reference answer."""
        return completion.strip() == problem.answer

    def has_answer(self, completion: str) -> bool:
        """Whether `completion` states an answer at all (`rollout/no_answer_frac` counts those without)."""
        return bool(completion.strip())

    def all_problems(self) -> list[Problem] | None:
        """Every problem of a file-backed task (checked at start-up); None for generated ones."""
        return None

    def is_heldout(self, problem: Problem) -> bool:
        """Whether `problem` belongs to the held-out split (a pure function of its prompt)."""
        return stable_bucket(problem.prompt, self.heldout_buckets) == 0

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """`n` training problems (held-out ones rejected), i.i.d. given `rng`.

        Args:
            n: number of problems.
            rng: generator consumed by the draws; the same generator state gives the same list.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        problems = []
        for _ in range(100 * n + 10_000):  # ~1.1 draws per problem; the cap only stops a degenerate space
            if len(problems) == n:
                return problems
            problem = self.draw_problem(rng)
            if not self.is_heldout(problem):
                problems.append(problem)
        if len(problems) == n:
            return problems
        raise ValueError(
            f"task {self.name!r} found almost no training problems: its space is nearly all held out"
        )

    def heldout(self, n: int, seed: int = 0) -> list[Problem]:
        """`n` distinct held-out problems, the same list for the same (`n`, `seed`).

        Raises:
            ValueError: if fewer than `n` distinct held-out problems are found, which happens
                when the problem space is too small (e.g. one-digit addition has ~10).
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = np.random.default_rng([seed, 0x4E1D])  # distinct stream from any training seed
        found: dict[str, Problem] = {}
        for _ in range(200 * n + 10_000):  # ~10 draws per held-out problem, plenty of margin
            if len(found) == n:
                break
            problem = self.draw_problem(rng)
            if self.is_heldout(problem):
                found.setdefault(problem.prompt, problem)
        if len(found) < n:
            raise ValueError(
                f"task {self.name!r} has only about {len(found)} distinct held-out problems with "
                f"these options, {n} were asked for; ask for fewer or widen the problem space"
            )
        return list(found.values())

    def sft_example(self, problem: Problem) -> tuple[str, str]:
        """(prompt, target) for cold-start SFT; the caller appends EOS to the target tokens."""
        return problem.prompt, problem.answer


_TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator adding a task to the registry under `name` (duplicate names rejected)."""

    def decorate(cls: type[Task]) -> type[Task]:
        if name in _TASKS:
            raise ValueError(f"task {name!r} is already registered by {_TASKS[name].__qualname__}")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return decorate


def available_tasks() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_TASKS)


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as `name` with keyword `options` (its constructor arguments).

    Raises:
        KeyError: unknown name (the message lists the registered ones).
        TypeError: an option the task does not take (the message lists the ones it takes).
    """
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(available_tasks())}")
    cls = _TASKS[name]
    accepted = list(inspect.signature(cls.__init__).parameters)[1:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"task {name!r} does not take option(s) {unknown}; it takes {accepted}")
    return cls(**options)
