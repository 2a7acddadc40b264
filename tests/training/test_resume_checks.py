"""Resume refusals decided from meta.json before any heavy work: a routine checkpoint's layout."""

from megatron_gspo.checkpoint.resume_checks import resume_incompatibilities
from megatron_gspo.config import RunConfig


def _meta(sharding: str) -> dict:
    layout = {
        "world_size": 2,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "expert_parallel": 1,
        "expert_tensor_parallel": 1,
        "data_parallel": 2,
        "distributed_optimizer": True,
    }
    return {"layout": layout, "optimizer_sharding": sharding, "optimizer_state": True, "trainer_state": None}


def test_a_routine_checkpoint_at_another_layout_is_refused_before_loading():
    cfg = RunConfig()
    cfg.parallel.distributed_optimizer = True  # this process: world 1, DP 1
    (problem,) = resume_incompatibilities(_meta("dp_reshardable"), cfg)
    assert problem.startswith("the parallel layout world=2 TP=1 PP=1 EP=1 ETP=1 DP=2 distributed_optimizer")
    assert "this run has world=1 TP=1 PP=1 EP=1 ETP=1 DP=1" in problem
    assert "trainer.reshardable_every" in problem
    assert resume_incompatibilities(_meta("fully_reshardable"), cfg) == []
