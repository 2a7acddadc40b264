"""A code task's rollout batch: scored at once through the sandbox, with its outcomes in the step's metrics.

The client is the stand-in at the HTTP boundary of tests/training/test_rollout_step.py; each
response is a program (the demo's form, the whole completion), so the rewards are known by hand.
"""

import json
import sys

import pytest
from rollout_standin import TOKENIZER, VOCAB, generate_response

from megatron_gspo.config import RolloutConfig
from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.code.sandbox import sandbox_runner
from megatron_gspo.training.step.metrics import rollout_metrics
from megatron_gspo.training.step.rollouts import RolloutEngine

ROW = {  # f(x) = (x+3)*2 on five inputs
    "question": "add 3 mul 2",
    "input_output": {"inputs": [[0], [1], [2], [5], [-3]], "outputs": [6, 8, 10, 16, 0], "fn_name": "f"},
}
PROGRAMS = {  # response of row r -> (program, reward)
    0: ("def f(x): return (x+3)*2", 1.0),
    1: ("def f(x): return x+3*2", 0.2),  # 6, 7, 8, 11, 3: right at x = 0 only
    2: ("def f(x): return (x+3)*2", 1.0),  # the same program again: scored once, same reward
    3: ("def f(x) return x", 0.0),  # does not compile
}


class ProgramResponses:
    def generate_batched(self, bodies):
        out = []
        for row, body in enumerate(bodies):
            ids = TOKENIZER.encode(PROGRAMS[row][0]) + [TOKENIZER.eos_token_id]
            out.append(generate_response(body, ids, "0", {"type": "stop", "matched": TOKENIZER.eos_token_id}))
        return out


def test_code_batch_rewards_and_metrics(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    task = get_task("code", path=str(path), extract="whole", function_template="{problem}=", time_limit_s=1,
                    max_prompt_len=12, max_answer_len=24)  # fmt: skip
    cfg = RolloutConfig(group_size=4, rollout_batch_size=1, max_new_tokens=25)
    engine = RolloutEngine(ProgramResponses(), task, TOKENIZER, cfg, vocab_size=VOCAB)
    batch = engine.sample_groups(task.all_problems(), seed=1, step=1, weight_version=0)
    assert batch.rewards.tolist() == pytest.approx([PROGRAMS[r][1] for r in range(4)])
    metrics = rollout_metrics(batch)
    assert metrics["reward/code_pass_frac"] == 0.5
    assert metrics["reward/code_wrong_frac"] == 0.25
    assert metrics["reward/code_error_frac"] == 0.25
    assert metrics["reward/code_tests_passed_frac"] == (5 + 1 + 5 + 0) / 20
    assert metrics["time/reward_s"] == batch.stats["reward_s"] >= 0.0


def test_code_sample_rows_carry_the_outcome_and_first_failure(tmp_path):
    """samples.jsonl rows of a code batch: each program's outcome, tests passed and first failing
    test (worked out by hand from PROGRAMS); a row of another task keeps its four fields only."""
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    task = get_task("code", path=str(path), extract="whole", function_template="{problem}=", time_limit_s=1,
                    max_prompt_len=12, max_answer_len=24)  # fmt: skip
    cfg = RolloutConfig(group_size=4, rollout_batch_size=1, max_new_tokens=25)
    engine = RolloutEngine(ProgramResponses(), task, TOKENIZER, cfg, vocab_size=VOCAB, samples_per_step=4)
    rows = engine.sample_groups(task.all_problems(), seed=1, step=1, weight_version=0).stats["sample_rows"]
    assert [(r["outcome"], r["tests_passed"]) for r in rows] == [
        ("pass", "5/5"), ("wrong", "1/5"), ("pass", "5/5"), ("error", "0/5")
    ]  # fmt: skip
    assert rows[0]["first_failure"] is None
    # x + 3*2 at x = 1 is 7, where (1+3)*2 = 8 was expected
    assert rows[1]["first_failure"] == {
        "test": 2,
        "input": "[1]",
        "expected": "8",
        "actual": "7",
        "stderr": "",
    }
    compile_error = rows[3]["first_failure"]
    if sandbox_runner("bwrap", None).version == sys.version_info[:2]:  # compiled before any sandbox run
        assert compile_error["test"] is None and compile_error["stderr"].startswith("SyntaxError")
    else:  # another Python in the sandbox (the 3.12 stage's runs the system's 3.11): test 1 fails on it
        assert compile_error["test"] == 1 and "SyntaxError" in compile_error["stderr"]
    assert json.loads(json.dumps(rows)) == rows  # what samples.jsonl writes reads back the same


def test_other_tasks_sample_rows_are_unchanged():
    from rollout_standin import ANSWER, generate_response

    from megatron_gspo.tasks.arithmetic import AdditionTask

    stop = {"type": "stop", "matched": TOKENIZER.eos_token_id}

    class Sevens:
        def generate_batched(self, bodies):
            return [generate_response(b, list(ANSWER), "0", stop) for b in bodies]

    task = AdditionTask(max_digits=1)
    cfg = RolloutConfig(group_size=2, rollout_batch_size=1, max_new_tokens=4)
    engine = RolloutEngine(Sevens(), task, TOKENIZER, cfg, vocab_size=VOCAB, samples_per_step=2)
    problem = task.heldout(1)[0]
    rows = engine.sample_groups([problem], seed=1, step=1, weight_version=0).stats["sample_rows"]
    assert [sorted(r) for r in rows] == [["answer", "completion", "prompt", "reward"]] * 2
