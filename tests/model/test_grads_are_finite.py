"""`grads_are_finite` flags exactly the NaN / inf gradients, also where finite values overflow the norm."""

import pytest

from megatron_gspo.model.optim import grads_are_finite, wrap_ddp


@pytest.fixture(scope="module")
def ddp_model(world_one_model):
    return wrap_ddp(world_one_model)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize(
    "value,finite",
    [(0.0, True), (-3.0e38, True), *((v, False) for v in NON_FINITE)],
    ids=["zero", "most-negative-fp32", "nan", "inf", "-inf"],
)
@pytest.mark.parametrize("fill", [1.0, 3.0e38], ids=["small", "largest-fp32"])  # fp32 norm finite / inf
def test_grads_are_finite_flags_exactly_the_non_finite_values(ddp_model, fill, value, finite):
    buffers = [b.grad_data for b in ddp_model.buffers + ddp_model.expert_parallel_buffers]
    assert buffers
    for grad in buffers:
        grad.fill_(fill)
        assert grads_are_finite(ddp_model)
        grad.view(-1)[grad.numel() // 2] = value
        assert grads_are_finite(ddp_model) is finite
        grad.zero_()
