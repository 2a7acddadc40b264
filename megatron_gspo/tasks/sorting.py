"""Digit sorting, a second demo task: prompt "3141:", answer "1134"."""

from __future__ import annotations

import numpy as np

from megatron_gspo.tasks.base import Problem, Task, register_task


@register_task("sort_digits")
class SortDigitsTask(Task):
    """A string of digits followed by ":" -> the same digits in ascending order; exact-match reward.

    Args:
        min_length: fewest digits in a prompt (>= 1).
        max_length: most digits in a prompt (<= 12).
    """

    def __init__(self, min_length: int = 2, max_length: int = 5):
        if not 1 <= min_length <= max_length <= 12:
            raise ValueError(f"need 1 <= min_length <= max_length <= 12, got {min_length}, {max_length}")
        self.min_length, self.max_length = min_length, max_length
        self.max_prompt_len = max_length + 1
        self.max_answer_len = max_length

    def draw_problem(self, rng: np.random.Generator) -> Problem:
        """A uniform length, then independent uniform digits (repeats allowed)."""
        length = int(rng.integers(self.min_length, self.max_length + 1))
        digits = "".join(str(d) for d in rng.integers(0, 10, size=length))
        return Problem(prompt=f"{digits}:", answer="".join(sorted(digits)))

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the stripped completion is exactly the sorted digits, else 0.0."""
        return 1.0 if completion.strip() == problem.answer else 0.0
