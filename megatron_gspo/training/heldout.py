"""Held-out evaluation through the rollout engine: greedy pass@1 and, when asked, sampled pass@k.

`eval/accuracy` is the share of held-out problems whose greedy answer is correct (pass@1 of
greedy decoding); with `eval.samples_per_problem: n` each problem also gets n answers sampled
at `eval.temperature`, and `eval/pass@k` is the unbiased estimator of Chen et al. 2021
(`tasks.evaluation.pass_at_k`) averaged over problems, for each k of `eval.pass_k`.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_gspo.config import EvalConfig
from megatron_gspo.tasks import Problem, Task
from megatron_gspo.tasks.evaluation import evaluate_accuracy, evaluate_pass_at_k
from megatron_gspo.training.step.rollouts import RolloutEngine


def pass_ks(cfg: EvalConfig) -> list[int]:
    """The k of each pass@k an evaluation logs: `eval.pass_k`, else 1 and samples_per_problem."""
    return sorted(set(cfg.pass_k or (1, cfg.samples_per_problem)))


def heldout_metrics(
    engine: RolloutEngine, task: Task, problems: Sequence[Problem], cfg: EvalConfig, *, seed: int
) -> dict[str, float]:
    """`eval/accuracy`, `eval/mean_reward` (greedy) and, with samples_per_problem > 0, `eval/pass@k`."""
    greedy = evaluate_accuracy(task, problems, engine.greedy_completions(problems))
    out = {"eval/accuracy": greedy["accuracy"], "eval/mean_reward": greedy["mean_reward"]}
    if cfg.samples_per_problem:
        samples = engine.sampled_completions(
            problems, cfg.samples_per_problem, temperature=cfg.temperature, seed=seed
        )
        pass_rates = evaluate_pass_at_k(task, problems, samples, pass_ks(cfg))
        out.update({f"eval/{name}": rate for name, rate in pass_rates.items()})
    return out
