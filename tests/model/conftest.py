import pytest

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, init_distributed


@pytest.fixture(scope="module")
def world_one_model():
    """A tiny policy at TP=EP=1 in this process (a world of one), with sharp init."""
    parallel = ParallelConfig()
    init_distributed(parallel, seed=1234)
    model = build_model(tiny(vocab_size=64, init_std=0.2), parallel)
    model.eval()
    return model
