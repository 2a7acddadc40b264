"""Tasks over the rows of a data file: held-out rows by prompt hash, or from a separate eval file."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from megatron_gspo.tasks.base import Problem, Task


class FileTask(Task):
    """A task over the rows of `task.options.path`; held-out rows by prompt hash or from `eval.path`.

    A subclass reads a file into problems (`_read`) and calls `_load` from its `__init__`.
    """

    problems: list[Problem]
    eval_problems: list[Problem] | None = None

    def _load(self, path: str) -> None:
        self.problems = self._read(path, "task.options.path")
        self.eval_problems = None

    @abstractmethod
    def _read(self, path: str, option: str) -> list[Problem]:
        """The problems of the file at `path`; a bad row is refused naming `option` and the row."""

    def use_eval_file(self, path: str) -> None:
        """Take held-out problems from `path` (same keys and templates) and train on every training row."""
        self.eval_problems = self._read(path, "eval.path")

    def is_heldout(self, problem: Problem) -> bool:
        """The prompt-hash split, or never for a training row once a separate eval file is used."""
        return False if self.eval_problems is not None else super().is_heldout(problem)

    def heldout(self, n: int, seed: int = 0) -> list[Problem]:
        """The first `n` rows of the eval file (all of them when it has fewer), else the hash split."""
        if self.eval_problems is None:
            return super().heldout(n, seed)
        return self.eval_problems[:n]

    def all_problems(self) -> list[Problem]:
        """Every problem the run can see: training rows and eval-file rows."""
        return self.problems + (self.eval_problems or [])

    def draw_problem(self, rng: np.random.Generator) -> Problem:
        """A uniformly chosen row."""
        return self.problems[int(rng.integers(len(self.problems)))]
