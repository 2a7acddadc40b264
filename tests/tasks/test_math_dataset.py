import json

import numpy as np
import pytest

from megatron_gspo.tasks import evaluate_accuracy, get_task


@pytest.fixture
def math_file(tmp_path):
    rows = [
        {"problem": f"What is {i} + {i}?", "answer": str(2 * i), "source": "synthetic"} for i in range(200)
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    return path


def test_rows_become_problems_in_the_template(math_file):
    task = get_task("math_jsonl", path=str(math_file), template="Q: {problem} A: \\boxed{}")
    assert len(task.problems) == 200
    assert task.problems[3].prompt == "Q: What is 3 + 3? A: \\boxed{}" and task.problems[3].answer == "6"


def test_reward_uses_the_boxed_answer(math_file):
    task = get_task("math_jsonl", path=str(math_file))
    problem = task.problems[5]
    assert "put your final answer within \\boxed{}" in problem.prompt
    assert task.reward(problem, "5 + 5 = \\boxed{10}") == 1.0
    assert task.reward(problem, "\\boxed{10.0}") == 1.0 and task.is_correct(problem, "\\boxed{10.0}")
    assert task.reward(problem, "10") == 0.0 and task.reward(problem, "\\boxed{11}") == 0.0
    metrics = evaluate_accuracy(task, [problem, problem], ["\\boxed{10}", "\\boxed{1}"])
    assert metrics["accuracy"] == metrics["mean_reward"] == 0.5


def test_heldout_rows_are_never_sampled_for_training(math_file):
    task = get_task("math_jsonl", path=str(math_file))
    heldout = {p.prompt for p in task.heldout(8)}
    training = {p.prompt for p in task.sample_prompts(2000, np.random.default_rng(0))}
    assert heldout and not heldout & training
    assert len(heldout) + len(training) <= 200


def test_bad_rows_and_templates_are_named(tmp_path, math_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1 has no field\(s\) \['answer'\]"):
        get_task("math_jsonl", path=str(bad))
    with pytest.raises(ValueError, match="template must contain"):
        get_task("math_jsonl", path=str(math_file), template="no placeholder")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no problems"):
        get_task("math_jsonl", path=str(empty))
