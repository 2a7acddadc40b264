"""Routine and reshardable checkpoint steps from the trainer's settings."""

import pytest

from megatron_gspo.checkpoint.schedule import checkpoint_due
from megatron_gspo.config import ConfigError, RunConfig, validate


def _schedule(steps: int, **trainer) -> dict[int, str]:
    cfg = RunConfig()
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    kinds = {}
    for step in range(1, steps + 1):
        save, reshardable = checkpoint_due(step, last=step == steps, trainer=cfg.trainer)
        if save:
            kinds[step] = "reshardable" if reshardable else "routine"
    return kinds


def test_routine_saves_with_reshardable_ones_on_request_and_at_the_end():
    assert _schedule(10, save_every=2, reshardable_every=0) == {
        2: "routine",
        4: "routine",
        6: "routine",
        8: "routine",
        10: "reshardable",
    }
    assert _schedule(7, save_every=2, reshardable_every=3, reshardable_at_end=False) == {
        2: "routine",
        3: "reshardable",
        4: "routine",
        6: "reshardable",
        7: "routine",
    }
    assert _schedule(3, save_every=0) == {3: "reshardable"}


def test_negative_reshardable_every_is_refused_by_name():
    cfg = RunConfig()
    cfg.trainer.reshardable_every = -1
    with pytest.raises(ConfigError, match="trainer.reshardable_every must be >= 0"):
        validate(cfg, world_size=1)
