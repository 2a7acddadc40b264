"""Routing record / replay / capture per micro-batch of a schedule run (`model/pipeline.py`).

Under a pipeline schedule the forwards of several micro-batches run before their backwards,
and activation recompute re-runs each layer's forward inside the backward. Routing state is
therefore keyed by the micro-batch index the schedule hands to the hooks, never by the order
of calls: `KeyedReplay` selects micro-batch i's routing right before i's forward and again
right before i's backward (where the recompute replays it); `KeyedRecording` and
`KeyedCapture` file what a forward routed under the index of the micro-batch it belonged to.
Routing is per local MoE layer of this stage; `RoutingReplay.layer_numbers` gives the global
layer of each.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_gspo.model.micro_batch_hooks import MicroBatchHooks
from megatron_gspo.model.routing import LayerRouting, RoutingCapture, RoutingReplay


class KeyedReplay(MicroBatchHooks):
    """Replay `targets(i)` in micro-batch i's forward and in its backward recompute.

    Args:
        replay: the model's `RoutingReplay`.
        targets: per micro-batch index, its routing (per local layer `[local_tokens, k]`);
            asked once per micro-batch and checked against the model then.
    """

    def __init__(self, replay: RoutingReplay, targets: Callable[[int], LayerRouting]) -> None:
        self.replay, self._targets = replay, targets
        self._cache: dict[int, LayerRouting] = {}

    def layers(self, i: int) -> LayerRouting:
        """Micro-batch i's routing (converted and checked on first use)."""
        if i not in self._cache:
            routing = self._targets(i)
            self.replay.check(routing.layers)
            self._cache[i] = routing
        return self._cache[i]

    def before_forward(self, i: int) -> None:
        """Replay micro-batch i's routing in its forward."""
        self.replay.select(self.layers(i).layers)

    def after_forward(self, i: int) -> None:
        """Stop replaying: another micro-batch's forward or backward comes next."""
        self.replay.reset()

    def before_backward(self, i: int) -> None:
        """Replay micro-batch i's routing again in its backward recompute."""
        self.replay.select(self.layers(i).layers)


class KeyedRecording(MicroBatchHooks):
    """Record the routing of every micro-batch's forward; `routing[i]` per local layer."""

    def __init__(self, replay: RoutingReplay) -> None:
        self.replay = replay
        self.routing: dict[int, LayerRouting] = {}

    def before_forward(self, i: int) -> None:
        """Record micro-batch i's forward."""
        self.replay.start_recording()

    def after_forward(self, i: int) -> None:
        """File what micro-batch i routed."""
        self.routing[i] = self.replay.take_recording()


class KeyedCapture(MicroBatchHooks):
    """`RoutingCapture` of every micro-batch's forward (recompute ignored); `routing[i]` per local layer.

    Use inside the capture's `with` block.
    """

    def __init__(self, capture: RoutingCapture) -> None:
        self.capture = capture
        self.routing: dict[int, LayerRouting] = {}

    def before_forward(self, i: int) -> None:
        """Start micro-batch i's capture empty."""
        self.capture.clear()

    def after_forward(self, i: int) -> None:
        """File what micro-batch i's routers chose."""
        self.routing[i] = self.capture.routing()
        self.capture.clear()
