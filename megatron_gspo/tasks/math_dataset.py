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

    The field names follow the data set (`problem`/`answer` by default, as MATH and DAPO-style
    sets; e.g. `prompt_key="question"` for GSM8K-style rows). The problem text is placed in
    `template`; the prompt then goes through the tokenizer's chat template as one user turn
    when `chat_template` says so (`tasks.tokenizer.encode_prompt`). The held-out split is the
    usual prompt-hash split over the file's rows.

    Args:
        path: JSON-lines file, one object per line.
        prompt_key: field holding the problem text.
        answer_key: field holding the reference answer (bare or in \boxed{}).
        template: prompt text; "{problem}" is replaced by the problem (other braces are literal).
        chat_template: apply the tokenizer's chat template (None: when the tokenizer has one).
        max_prompt_len: prompt budget in tokens, for the rollout and packing configuration.
        max_answer_len: response budget in tokens.
    """

    def __init__(
        self,
        path: str,
        prompt_key: str = "problem",
        answer_key: str = "answer",
        template: str = DEFAULT_TEMPLATE,
        chat_template: bool | None = None,
        max_prompt_len: int = 1024,
        max_answer_len: int = 4096,
    ):
        if "{problem}" not in template:
            raise ValueError(f"template must contain '{{problem}}', got {template!r}")
        if chat_template not in (None, True, False):
            raise ValueError(f"chat_template must be true, false or unset, got {chat_template!r}")
        self.chat_template = chat_template
        self.max_prompt_len, self.max_answer_len = max_prompt_len, max_answer_len
        self.problems: list[Problem] = []
        keys = {"prompt_key": prompt_key, "answer_key": answer_key}
        with Path(path).open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} line {number} is not JSON: {err.msg}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path} line {number} is a JSON {type(row).__name__}, not an object")
                missing = [f"{option}={key!r}" for option, key in keys.items() if key not in row]
                if missing:
                    raise ValueError(
                        f"{path} line {number} has no field for task.options.{', '.join(missing)}; "
                        f"its fields: {sorted(row)}"
                    )
                prompt = template.replace("{problem}", str(row[prompt_key]))
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
