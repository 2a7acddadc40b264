"""Accuracy of completions on a fixed problem set (held-out evaluation)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_gspo.tasks.base import Problem, Task


def evaluate_accuracy(
    task: Task, problems: Sequence[Problem], completions: Sequence[str]
) -> dict[str, float]:
    """Mean reward and exact-match accuracy of one completion per problem.

    Args:
        task: scores the completions (`judge_batch`: `reward`, `is_correct`).
        problems: [N] problems.
        completions: [N] decoded completions, `completions[i]` answering `problems[i]`.

    Returns:
        {"mean_reward", "accuracy", "count"}; accuracy is the fraction with `is_correct`.
    """
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    if not problems:
        raise ValueError("evaluate_accuracy needs at least one problem")
    rewards, correct = task.judge_batch(problems, completions)
    n = len(problems)
    return {"mean_reward": sum(rewards) / n, "accuracy": sum(correct) / n, "count": float(n)}
