"""Accuracy of completions on a fixed problem set (held-out evaluation): greedy pass@1 and sampled pass@k."""

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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from `n` samples of which `c` are correct (Chen et al. 2021).

    pass@k = 1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without
    replacement hold a correct one, computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i): no
    factorials, so no overflow or cancellation for large n.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def evaluate_pass_at_k(
    task: Task, problems: Sequence[Problem], samples: Sequence[Sequence[str]], ks: Sequence[int]
) -> dict[str, float]:
    """Mean unbiased pass@k over problems, for each k, from n sampled completions per problem.

    Args:
        task: judges the completions (`judge_batch`; the code task runs each program once).
        problems: [N] problems.
        samples: [N][n] completions, `samples[i]` answering `problems[i]`, the same n for all.
        ks: the k of each pass@k, each in [1, n].

    Returns:
        {"pass@k": mean over problems} for each k in `ks`.
    """
    if len(problems) != len(samples) or not problems:
        raise ValueError(f"{len(problems)} problems but {len(samples)} sample lists (need one each, >= 1)")
    n = len(samples[0])
    if any(len(s) != n for s in samples):
        raise ValueError(
            f"every problem needs the same number of samples; got {sorted({len(s) for s in samples})}"
        )
    flat_problems = [p for p, group in zip(problems, samples) for _ in group]
    _, correct = task.judge_batch(flat_problems, [c for group in samples for c in group])
    counts = [sum(correct[i * n : (i + 1) * n]) for i in range(len(problems))]
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in counts) / len(problems) for k in ks}
