import pytest

from megatron_gspo.tasks import Problem, evaluate_accuracy, get_task

PROBLEMS = [Problem("1+1=", "2"), Problem("2+3=", "5"), Problem("9+9=", "18"), Problem("4+0=", "4")]
COMPLETIONS = ["2", " 5", "17", "four"]


def test_exact_match_task_reward_equals_accuracy():
    metrics = evaluate_accuracy(get_task("addition"), PROBLEMS, COMPLETIONS)
    assert metrics == {"mean_reward": 0.5, "accuracy": 0.5, "count": 4.0}


def test_partial_credit_raises_reward_but_not_accuracy():
    metrics = evaluate_accuracy(get_task("addition", format_reward=0.2), PROBLEMS, COMPLETIONS)
    assert metrics["mean_reward"] == pytest.approx((1 + 1 + 0.2 + 0) / 4)
    assert metrics["accuracy"] == 0.5


def test_mismatched_or_empty_inputs_are_rejected():
    with pytest.raises(ValueError, match="4 problems but 3 completions"):
        evaluate_accuracy(get_task("addition"), PROBLEMS, COMPLETIONS[:3])
    with pytest.raises(ValueError, match="at least one"):
        evaluate_accuracy(get_task("addition"), [], [])
