"""Multi-digit addition, the CPU demo task: prompt "37+5=", answer "42"."""

from __future__ import annotations

import re

import numpy as np

from megatron_gspo.tasks.base import Problem, Task, register_task

_INTEGER = re.compile(r"-?\d+")


def draw_number(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
    """A number whose digit count is uniform in [min_digits, max_digits], uniform within that count.

    One-digit numbers include 0; longer ones have no leading zero.
    """
    digits = int(rng.integers(min_digits, max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


@register_task("addition")
class AdditionTask(Task):
    """Addition: prompt "a+b=", answer the sum in decimal; exact-match reward.

    Drawing the digit count first (rather than the number) keeps short operands frequent, a
    curriculum a ~100k-parameter policy needs to get non-trivial cold-start accuracy.

    Args:
        min_digits: fewest digits of an operand (>= 1).
        max_digits: most digits of an operand (<= 9).
        format_reward: reward of a wrong answer that is still a bare integer (partial credit for
            the format); 0.0 makes the reward pure exact match.
    """

    def __init__(self, min_digits: int = 1, max_digits: int = 2, format_reward: float = 0.0):
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(
                f"format_reward must be in [0, 1) so a correct answer pays more, got {format_reward}"
            )
        self.min_digits, self.max_digits, self.format_reward = min_digits, max_digits, format_reward
        self.max_prompt_len = 2 * max_digits + 2  # "a+b="
        self.max_answer_len = max_digits + 1  # the carry can add a digit

    def draw_problem(self, rng: np.random.Generator) -> Problem:
        """A uniform draw of both operands (see `draw_number`)."""
        a = draw_number(rng, self.min_digits, self.max_digits)
        b = draw_number(rng, self.min_digits, self.max_digits)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), metadata={"a": a, "b": b})

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the stripped completion is exactly the sum, else `format_reward` for an integer, else 0."""
        text = completion.strip()
        if text == problem.answer:
            return 1.0
        return self.format_reward if _INTEGER.fullmatch(text) else 0.0
