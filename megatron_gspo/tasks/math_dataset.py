r"""Math problems from a JSON-lines file, scored by the \boxed{} answer reward (for real runs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_gspo.tasks.base import Problem, Task, register_task
from megatron_gspo.tasks.math_reward import math_reward

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


@register_task("math_jsonl")
class MathJsonlTask(Task):
    r"""One problem per JSON line; reward 1.0 when the completion's last \boxed{} matches the answer.

    Prompts are the raw text placed in `template` (a chat template, if any, is the rollout
    side's business). The held-out split is the usual prompt-hash split over the file's rows.

    Args:
        path: JSON-lines file, one object per line.
        problem_key: field holding the problem text.
        answer_key: field holding the reference answer (bare or in \boxed{}).
        template: prompt text; "{problem}" is replaced by the problem (other braces are literal).
        max_prompt_len: prompt budget in tokens, for the rollout and packing configuration.
        max_answer_len: response budget in tokens.
    """

    def __init__(
        self,
        path: str,
        problem_key: str = "problem",
        answer_key: str = "answer",
        template: str = DEFAULT_TEMPLATE,
        max_prompt_len: int = 1024,
        max_answer_len: int = 4096,
    ):
        if "{problem}" not in template:
            raise ValueError(f"template must contain '{{problem}}', got {template!r}")
        self.max_prompt_len, self.max_answer_len = max_prompt_len, max_answer_len
        self.problems: list[Problem] = []
        with Path(path).open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = [key for key in (problem_key, answer_key) if key not in row]
                if missing:
                    raise ValueError(f"{path} line {number} has no field(s) {missing}; it has {sorted(row)}")
                prompt = template.replace("{problem}", str(row[problem_key]))
                self.problems.append(Problem(prompt, str(row[answer_key]), {"line": number}))
        if not self.problems:
            raise ValueError(f"{path} holds no problems")

    def draw_problem(self, rng: np.random.Generator) -> Problem:
        """A uniformly chosen row."""
        return self.problems[int(rng.integers(len(self.problems)))]

    def reward(self, problem: Problem, completion: str) -> float:
        r"""1.0 if the last \boxed{} of `completion` matches the reference answer, else 0.0."""
        return math_reward(completion, problem.answer).reward

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """Correct means full reward (the boxed answer matches)."""
        return self.reward(problem, completion) == 1.0
