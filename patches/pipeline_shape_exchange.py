"""Megatron's pipeline shape exchange crosses its two directions when both neighbours are one rank.

With `variable_seq_lengths` every transfer between stages is preceded by
`P2PCommunicator._communicate_shapes`, which posts send-prev, recv-prev, send-next, recv-next
on every rank, in that order. At two stages the previous and the next stage are the same rank,
so in a call that sends both ways (the interleaved schedule's steady state sends an activation
forward and a gradient backward at once) rank 0's first message, its gradient's shape, meets
rank 1's first receive, which expects an activation's shape: the shapes cross and the next
chunk runs on a buffer of the wrong length. The tensors themselves go through `_p2p_ops`, which
orders the messages by even / odd rank for this reason; the shapes do not. NCCL matches
messages between two ranks in posting order as gloo does, so GPUs need the fix too. The patch
exchanges the forward direction's shapes first and the backward direction's after, when the
previous and the next rank are the same; other layouts take megatron's path unchanged.
"""

import inspect

from packaging.specifiers import SpecifierSet

from ._base import Patch, require

_ORIGINAL = "_megatron_gspo_original_communicate_shapes"


def _check() -> None:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    original = getattr(P2PCommunicator, _ORIGINAL, P2PCommunicator._communicate_shapes)
    source = inspect.getsource(original)
    params = list(inspect.signature(original).parameters)
    require(
        params == ["self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next"],
        "pipeline_shape_exchange",
        f"P2PCommunicator._communicate_shapes takes {params}",
    )
    require(
        source.index("send_prev_op") < source.index("send_next_op")
        and "self.prev_rank" in source
        and "self.next_rank" in source,
        "pipeline_shape_exchange",
        "_communicate_shapes no longer posts send-prev before send-next to self.prev_rank / self.next_rank",
    )


def _apply() -> None:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if hasattr(P2PCommunicator, _ORIGINAL):
        return
    original = P2PCommunicator._communicate_shapes

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        both_ways = (tensor_send_next is not None or recv_prev) and (
            tensor_send_prev is not None or recv_next
        )
        if self.prev_rank != self.next_rank or not both_ways:
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        forward, _ = original(self, tensor_send_next, None, recv_prev, False)
        _, backward = original(self, None, tensor_send_prev, False, recv_next)
        return forward, backward

    setattr(P2PCommunicator, _ORIGINAL, original)
    P2PCommunicator._communicate_shapes = _communicate_shapes


PATCH = Patch(
    name="pipeline_shape_exchange",
    fixes="at two pipeline stages the interleaved schedule's shape exchange crosses forward and backward",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="always",
    check=_check,
    apply=_apply,
)
