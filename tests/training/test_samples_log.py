"""samples.jsonl and TensorBoard text rows, their resume truncation, and the zero-reward warning."""

import json
import logging

import pytest

from megatron_gspo.errors import ConfigError
from megatron_gspo.tasks import Problem
from megatron_gspo.training.metrics import MetricsLogger, ZeroRewardWatch, read_metrics
from megatron_gspo.training.step.rollouts import sample_rows


def test_sample_rows_take_one_per_group_first():
    scored = [(Problem(f"p{i // 3}", str(i // 3)), f"c{i}", float(i % 2)) for i in range(9)]  # 3 groups of 3
    rows = sample_rows(scored, 4, group_size=3)
    assert [r["completion"] for r in rows] == ["c0", "c3", "c6", "c1"]
    assert rows[1] == {"prompt": "p1", "answer": "1", "completion": "c3", "reward": 1.0}
    assert sample_rows(scored, 0, group_size=3) == []


def test_samples_jsonl_and_tensorboard_text_survive_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"prompt": "1+1=", "answer": "2", "completion": "\\boxed{2}", "reward": 1.0}]
    log = MetricsLogger(tmp_path, total_steps=3, progress_bar=False)
    for step in (1, 2, 3):
        log.log(step, {"rollout/reward_mean": 1.0})
        log.log_samples(step, rows)
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2, 3]
    assert "\\boxed{2}" in texts[0].tensor_proto.string_val[0].decode()
    MetricsLogger(tmp_path, total_steps=3, first_step=3, progress_bar=False, tensorboard=False).close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the resumed run rewrites step 3


def test_a_resume_drops_a_torn_last_record_and_names_a_damaged_one(tmp_path, caplog):
    """A run killed mid-append leaves a torn last line: the resume drops it (that step re-runs);
    a damaged line before it is named by its number, not a JSONDecodeError traceback."""
    metrics = tmp_path / "metrics.jsonl"
    records = "".join(json.dumps({"step": s, "actor/pg_loss": 0.1}) + "\n" for s in range(4))
    metrics.write_text(records + '{"step": 4, "actor/pg_')
    with caplog.at_level(logging.WARNING):
        MetricsLogger(tmp_path, total_steps=5, first_step=4, progress_bar=False, tensorboard=False).close()
    assert "metrics.jsonl line 5 is torn" in caplog.text
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1, 2, 3]
    metrics.write_text(records.replace('{"step": 2', '{"step: 2') + json.dumps({"step": 4}) + "\n")
    with pytest.raises(
        ConfigError, match=r"metrics.jsonl line 3 is not a JSON record .*repair or delete that line"
    ):
        MetricsLogger(tmp_path, total_steps=5, first_step=4, progress_bar=False, tensorboard=False)
    with pytest.raises(ValueError, match=r"line 3 is not a JSON record"):
        read_metrics(metrics)


def test_zero_reward_warning_after_k_steps(caplog):
    watch = ZeroRewardWatch(3)
    rewards = [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with caplog.at_level(logging.WARNING):
        fired = [watch.update(s, {"rollout/reward_mean": r, "rollout/no_answer_frac": 1.0})
                 for s, r in enumerate(rewards, 1)]  # fmt: skip
    assert fired == [False, False, False, False, False, True, False, False, True]
    assert (
        "exactly 0 for 3 steps in a row" in caplog.text
        and "100% of the completions have no answer" in caplog.text
    )
    # samples.jsonl is written only with logging.samples_per_step > 0: the warning says to set it
    assert "Set logging.samples_per_step (e.g. 4) and look at run_dir/samples.jsonl" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert ZeroRewardWatch(1, samples_per_step=4).update(1, {"rollout/reward_mean": 0.0})
    assert "Look at run_dir/samples.jsonl to see" in caplog.text and "Set logging" not in caplog.text
    off = ZeroRewardWatch(0)
    assert not any(off.update(s, {"rollout/reward_mean": 0.0}) for s in range(20))
