"""The progress bar counts RL steps (the cold-start record is not one) and names the configured loss."""

import io

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.training import metrics as metrics_module
from megatron_gspo.training.metrics import MetricsLogger
from megatron_gspo.training.step.metrics import progress_label


@pytest.mark.parametrize(
    ("overrides", "label"),
    [
        ([], "GSPO"),
        (["algorithm.loss_type=grpo", "algorithm.routing_replay=r2"], "GRPO+R2"),
        (["algorithm.loss_type=sapo"], "SAPO"),
    ],
)
def test_label_follows_the_loss(overrides, label):
    assert progress_label(load_config("configs/tiny_moe_cpu.yaml", overrides)) == label


@pytest.mark.parametrize(("first_step", "logged"), [(0, [0, 1, 2, 3]), (3, [3])])
def test_bar_ends_at_total(tmp_path, monkeypatch, first_step, logged):
    """3 steps (+ the step-0 record of a fresh run) end at 3/3; a run resumed at step 3 also does."""
    stream = io.StringIO()
    real_tqdm = metrics_module.tqdm
    monkeypatch.setattr(metrics_module, "tqdm", lambda **kw: real_tqdm(file=stream, **kw))
    log = MetricsLogger(tmp_path, total_steps=3, first_step=first_step, tensorboard=False, label="GRPO+R2")
    for step in logged:
        log.log(step, {"rollout/reward_mean": 0.5})
    assert log._bar.n == 3 and log._bar.total == 3
    log.close()
    assert "GRPO+R2" in stream.getvalue() and "3/3" in stream.getvalue()
