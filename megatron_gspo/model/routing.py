"""Routing replay and routing capture over megatron-core's own `RouterReplay`.

Naming (as in megatron's `TopKRouter`): the *routing* of a token in one MoE layer is the set
of k expert ids its router picked, stored as `[tokens, k]`; a *per-layer* routing is a list
with one such tensor per local MoE layer, in layer order. Expert ids are global (the router
weight is replicated, so expert parallelism never renumbers them).

Token order. Megatron's hidden states are `[S, B, H]`; for a packed batch `[R, L]` the
router sees `S = L` positions of `B = R` rows flattened position-major: token index
`l * R + r`. Under sequence parallelism each TP rank holds the contiguous positions
`[tp_rank * L / tp, (tp_rank + 1) * L / tp)`, so its local tokens are `(L / tp) * R`.
Both packing layouts follow from the segments `(row, start, n)`:
- "mask": token t of sample b at row `row`, position `start + t`: index `(start + t) * R + row`;
- "thd" (R = 1, the hidden states are `[T, 1, H]`): index `cu_seqlens_padded[b] + t`, the
  token's position in the THD row; a sequence's padding and the row's tail are filler.

- `RoutingReplay` owns this model's per-layer `RouterReplay` handles (megatron keeps them in
  a class-level list): `recording()` captures the routing of one forward pass, `replaying()`
  forces the routing of the next forward (and of its backward recompute), `close()` returns
  megatron's class-level state to empty; `select` / `start_recording` / `take_recording` do
  the same per micro-batch of a schedule run (`model/routing_hooks.py` keys them).
- `RoutingCapture` records the routing a forward actually used with forward hooks on every
  `TopKRouter` (works with or without replay; the drift metrics use it).
- `routing_from_rollout` / `routing_to_samples` convert between the rollout engine's
  per-sample routed experts `[P + R - 1, layers, k]` and the packed token order of a rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_gspo.model.distributed import unwrap_model
from megatron_gspo.model.packing import PackedBatch


class RoutingError(ValueError):
    """Routing data does not fit the model or the packed batch."""


class RoutingLengthError(RoutingError):
    """A sample's routed experts do not have one row per routed position (P + R - 1)."""


class RoutingLayerError(RoutingError):
    """Routing data covers a different number of MoE layers (or experts per token) than the model."""


def index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype holding every expert id: uint8 up to 256 experts, int16 otherwise."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise RoutingError(f"{num_experts} experts do not fit the int16 routing storage")


@dataclass
class LayerRouting:
    """Expert ids per MoE layer for one set of tokens, stored compactly.

    Attributes:
        layers: per layer `[tokens, k]` expert ids (uint8 when experts <= 256, int16 otherwise).
    """

    layers: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        """Number of MoE layers covered."""
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        """Tokens per layer."""
        return self.layers[0].shape[0] if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Storage in bytes."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of routing kept per token (layers x k x itemsize)."""
        return sum(t.shape[1] * t.element_size() for t in self.layers)

    def as_int64(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Per layer `[tokens, k]` int64 (what megatron's top-k returns and replay consumes)."""
        return [t.to(device=device or t.device, dtype=torch.long) for t in self.layers]

    def stacked(self) -> torch.Tensor:
        """`[tokens, layers, k]` int64 (the layout of the drift metrics)."""
        return torch.stack(self.as_int64(), dim=1)

    def to(self, device: torch.device | str) -> LayerRouting:
        """A copy on `device` (e.g. keep recorded routing on the host between mini-batches)."""
        return LayerRouting([t.to(device) for t in self.layers])


def compact(indices: Sequence[torch.Tensor], num_experts: int) -> LayerRouting:
    """Per-layer int64 top-k indices -> `LayerRouting` in the smallest dtype."""
    dtype = index_dtype(num_experts)
    return LayerRouting([t.detach().to(dtype) for t in indices])


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's `TopKRouter` modules in layer order (this rank's layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in unwrap_model(model).modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise RoutingError("the model has no MoE router (TopKRouter) to record or replay")
    return routers


class RoutingReplay:
    """Record and replay the expert routing of one Megatron model.

    Build the model with `build_model(..., routing_replay=True)`, then create one
    `RoutingReplay(model)`; it gathers the model's per-layer `RouterReplay` handles in layer
    order and only ever drives those. Use it as a context manager (or call `close()`) so
    megatron's class-level replay state is cleared when the model goes away.

        with RoutingReplay(model) as replay:
            with replay.recording() as recorded:      # pi_old forward
                forward(model, batch)
            with replay.replaying(recorded.routing):  # training forward + backward
                loss = forward(model, batch); loss.backward()

    Under activation recompute the backward re-runs each layer's forward; run the backward
    inside the `replaying()` block so the recompute replays the same indices. Under a
    pipeline schedule several micro-batches are in flight, so the routing is chosen per
    micro-batch instead: `select(routing)` right before that micro-batch's forward and again
    right before its backward (`KeyedReplay` does both, keyed by micro-batch), and
    `start_recording()` / `take_recording()` around each forward. Megatron's `REPLAY_BACKWARD`
    queue (replay in call order) is never used.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        routers = moe_routers(model)
        config = routers[0].config
        if config.moe_router_fusion:
            raise RoutingError(
                "moe_router_fusion=True takes a fused top-k path that silently bypasses routing "
                "replay; build the model with moe_router_fusion=False"
            )
        missing = [i for i, r in enumerate(routers) if getattr(r, "router_replay", None) is None]
        if not config.moe_enable_routing_replay or missing:
            raise RoutingError(
                "the model was built without routing replay (moe_enable_routing_replay); "
                "build it with build_model(..., routing_replay=True)"
            )
        self.instances = [r.router_replay for r in routers]
        self.layer_numbers: list[int] = [r.layer_number for r in routers]
        """Global 1-based layer number of each local MoE layer (megatron's, pipeline offset included)."""
        self.num_experts: int = config.num_moe_experts
        self.topk: int = config.moe_router_topk
        # Whether the backward runs the routers again: full recompute, or selective with the MoE block.
        self.recompute: bool = config.recompute_granularity == "full" or (
            config.recompute_granularity == "selective" and "moe" in config.recompute_modules
        )
        self._closed = False
        self._busy = False

    @property
    def num_layers(self) -> int:
        """Local MoE layers driven by this object."""
        return len(self.instances)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of compact routing per token for this model's local layers."""
        return (
            self.num_layers * self.topk * torch.empty((), dtype=index_dtype(self.num_experts)).element_size()
        )

    def _set_action(self, action) -> None:
        for instance in self.instances:
            instance.set_router_replay_action(action)

    def _reset(self) -> None:
        for instance in self.instances:
            instance.clear_router_replay_action()
            instance.clear_indices()

    @contextlib.contextmanager
    def _active(self, what: str) -> Iterator[None]:
        if self._closed:
            raise RoutingError(f"{what}: this RoutingReplay was closed")
        if self._busy:
            raise RoutingError(f"{what}: another recording/replaying block is already open")
        self._busy = True
        try:
            yield
        finally:
            self._reset()
            self._busy = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Record the routing of the forward pass run inside the block.

        Yields:
            A `Recording`; after the block, `.routing` holds per local layer `[local_tokens, k]`
            (compact dtype) and `.as_int64()` the int64 indices megatron produced.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        recording = Recording()
        with self._active("recording"):
            self._set_action(RouterReplayAction.RECORD)
            yield recording
            indices = [instance.get_recorded_indices() for instance in self.instances]
            if any(t is None for t in indices):
                layers = [i for i, t in enumerate(indices) if t is None]
                raise RoutingError(f"recording: no forward pass reached MoE layers {layers} in the block")
            recording.routing = compact(indices, self.num_experts)

    @contextlib.contextmanager
    def replaying(self, routing: LayerRouting | Sequence[torch.Tensor]) -> Iterator[None]:
        """Force the routing of the forward pass (and its backward recompute) run inside the block.

        Router probabilities are still computed by the current router (`scores.gather(idx)`),
        so the router keeps receiving gradients.

        Args:
            routing: per local layer `[local_tokens, k]` expert ids (any integer dtype).

        Raises:
            RoutingLayerError: wrong number of layers or of experts per token.
            RoutingError: expert ids out of range or repeated within a token.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        layers = routing.layers if isinstance(routing, LayerRouting) else list(routing)
        self.check(layers)
        with self._active("replaying"):
            for instance, indices in zip(self.instances, layers):
                instance.set_target_indices(indices.to(torch.long))
            self._set_action(RouterReplayAction.REPLAY_FORWARD)
            yield

    def select(self, layers: Sequence[torch.Tensor]) -> None:
        """Replay `layers` (per local layer `[local_tokens, k]`, checked) in the next forward or recompute."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._closed:
            raise RoutingError("select: this RoutingReplay was closed")
        for instance, indices in zip(self.instances, layers, strict=True):
            instance.clear_indices()
            instance.set_target_indices(indices.to(torch.long))
        self._set_action(RouterReplayAction.REPLAY_FORWARD)

    def start_recording(self) -> None:
        """Record the routing of the next forward (read it with `take_recording`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._closed:
            raise RoutingError("start_recording: this RoutingReplay was closed")
        self._reset()
        self._set_action(RouterReplayAction.RECORD)

    def take_recording(self) -> LayerRouting:
        """The routing recorded since `start_recording` (per local layer), and stop recording."""
        indices = [instance.get_recorded_indices() for instance in self.instances]
        self._reset()
        if any(t is None for t in indices):
            layers = [i for i, t in enumerate(indices) if t is None]
            raise RoutingError(f"recording: no forward pass reached MoE layers {layers}")
        return compact(indices, self.num_experts)

    def reset(self) -> None:
        """Stop recording or replaying (the router routes by itself again)."""
        self._reset()

    def check(self, layers: Sequence[torch.Tensor]) -> None:
        """Validate per-layer routing against this model (layer count, k, expert range, repeats)."""
        if len(layers) != self.num_layers:
            raise RoutingLayerError(
                f"routing has {len(layers)} layers, the model has {self.num_layers} MoE layers"
            )
        tokens = {t.shape[0] for t in layers}
        for i, t in enumerate(layers):
            if t.ndim != 2 or t.shape[1] != self.topk:
                raise RoutingLayerError(
                    f"layer {i}: routing shape {tuple(t.shape)}, expected [tokens, {self.topk}]"
                )
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise RoutingError(f"layer {i}: routing dtype {t.dtype} is not an integer type")
        if len(tokens) != 1:
            raise RoutingError(f"layers disagree in token count: {sorted(tokens)}")
        for i, t in enumerate(layers):
            wide = t.to(torch.long)
            if wide.numel() and (wide.min() < 0 or wide.max() >= self.num_experts):
                raise RoutingError(f"layer {i}: expert ids outside [0, {self.num_experts})")
            if self.topk > 1 and (wide.sort(dim=1).values.diff(dim=1) == 0).any():
                raise RoutingError(f"layer {i}: a token is routed to the same expert twice")

    def close(self) -> None:
        """Clear this model's replay state and megatron's class-level instance list (idempotent)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self._closed:
            return
        self._reset()
        mine = {id(i) for i in self.instances}
        RouterReplay.global_router_replay_instances[:] = [
            i for i in RouterReplay.global_router_replay_instances if id(i) not in mine
        ]
        self._closed = True

    def __enter__(self) -> RoutingReplay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Recording:
    """Filled when a `RoutingReplay.recording()` block exits.

    Attributes:
        routing: per local layer `[local_tokens, k]` compact expert ids.
    """

    routing: LayerRouting | None = None

    def as_int64(self) -> list[torch.Tensor]:
        """Per local layer `[local_tokens, k]` int64."""
        if self.routing is None:
            raise RoutingError("the recording block has not finished")
        return self.routing.as_int64()


class RoutingCapture:
    """Capture the routing every `TopKRouter` of a model used, with forward hooks.

    `source="used"` records the experts the forward actually used (under replay: the replayed
    ones); `source="router"` records the router's own choice, the top-k of its logits, even
    while replay overrides it (one extra [tokens, H] x [H, E] product per layer) - what drift
    measurement needs. Passes run during a backward (activation recompute) are ignored, so
    each forward counts once.

        with RoutingCapture(model) as capture:
            forward(model, batch)
        routing = capture.routing()   # LayerRouting, tokens of all captured forwards in order
    """

    def __init__(self, model: torch.nn.Module, *, source: str = "used") -> None:
        if source not in ("used", "router"):
            raise ValueError(f"RoutingCapture source must be 'used' or 'router', got {source!r}")
        routers = moe_routers(model)
        config = routers[0].config
        if source == "router" and (config.moe_router_enable_expert_bias or config.moe_router_group_topk):
            raise RoutingError(
                "RoutingCapture(source='router') takes the top-k of the router logits; it does not model "
                "expert bias or group-limited routing"
            )
        self.source = source
        self.topk: int = routers[0].topk
        self.num_experts: int = routers[0].config.num_moe_experts
        self._routers = routers
        self._layers: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles: list = []

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if torch._C._current_graph_task_id() != -1:  # recompute inside a backward pass
                return
            if self.source == "router":
                with torch.no_grad():
                    logits = module.gating(inputs[0]).view(-1, self.num_experts)
                    # softmax is monotonic: top-k of logits == top-k of scores (no expert bias here)
                    chosen = logits.topk(self.topk, dim=-1).indices.sort(dim=-1).values
            else:
                chosen = routing_map_to_indices(output[1], self.topk)
            self._layers[layer].append(chosen)

        return hook

    def __enter__(self) -> RoutingCapture:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def routing(self) -> LayerRouting:
        """Per local layer `[captured_tokens, k]` expert ids (ascending within a token)."""
        if not self._layers[0]:
            raise RoutingError("RoutingCapture: no forward pass was captured")
        return compact([torch.cat(chunks) for chunks in self._layers], self.num_experts)

    def clear(self) -> None:
        """Forget what was captured."""
        self._layers = [[] for _ in self._routers]


def routing_map_to_indices(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """`[tokens, experts]` bool routing map -> `[tokens, topk]` int64 expert ids in ascending order.

    Raises:
        RoutingError: a token is routed to a number of experts other than `topk` (token dropping).
    """
    counts = routing_map.sum(dim=1)
    if (counts != topk).any():
        raise RoutingError(f"routing map rows route to {counts.unique().tolist()} experts, expected {topk}")
    return routing_map.nonzero()[:, 1].view(-1, topk)


def filler_routing(num_tokens: int, topk: int, num_experts: int, *, offset: int = 0) -> torch.Tensor:
    """Deterministic routing for tokens that have none: `[num_tokens, topk]` int64.

    Token t (counted from `offset`) goes to experts `(t * k + j) mod E`, j < k: distinct within
    a token and spread evenly over the experts, so padding adds no hot expert. Without token
    dropping (no capacity factor) a token's expert choice changes only that token's output,
    and padding / last-token positions are never attended to by real tokens, so the filler
    cannot change any real token's result.
    """
    t = torch.arange(offset, offset + num_tokens, dtype=torch.long).unsqueeze(1)
    return (t * topk + torch.arange(topk)) % num_experts


def _router_positions(
    packed: PackedBatch, tp_rank: int, tp_size: int, sequence_parallel: bool, cp_size: int, cp_rank: int
) -> torch.Tensor | slice:
    """Row positions this rank's router sees, in its order: the CP partition, then the SP slice."""
    length = packed.tokens.shape[1]
    if cp_size == 1:
        return _local_positions(length, tp_rank, tp_size, sequence_parallel)
    from megatron_gspo.model.context_parallel import partition_index

    index = partition_index(packed.cu_seqlens_padded(), cp_size, cp_rank)
    return index[_local_positions(len(index), tp_rank, tp_size, sequence_parallel)]


def _local_positions(length: int, tp_rank: int, tp_size: int, sequence_parallel: bool) -> slice:
    if not sequence_parallel or tp_size == 1:
        return slice(0, length)
    if length % tp_size:
        raise RoutingError(f"row length {length} is not divisible by tensor_parallel={tp_size} under SP")
    per_rank = length // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def routing_token_mask(
    packed: PackedBatch,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """`[local_tokens]` bool: True where the rollout engine routed the token (not padding, not last).

    Token order as the router sees it on this rank (position-major; CP partition, SP slice).
    """
    rows, length = packed.tokens.shape
    mask = torch.zeros(length, rows, dtype=torch.bool)
    for row, start, n in packed.segments:
        mask[start : start + n - 1, row] = True
    return mask[_router_positions(packed, tp_rank, tp_size, sequence_parallel, cp_size, cp_rank)].reshape(-1)


def routing_from_rollout(
    packed: PackedBatch,
    routed_experts: Sequence[torch.Tensor],
    *,
    num_experts: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    layers: Sequence[int] | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> LayerRouting:
    """The rollout engine's per-sample routing in this rank's packed router order (for R3).

    Args:
        packed: the micro-batch as packed for the forward (`packed.segments[b]` is sample b).
        routed_experts: per sample `[P + R - 1, num_layers, k]`; row t is the routing of the
            token at position t of the sample (the last token has none).
        num_experts: experts per MoE layer (range check and filler).
        tp_rank: this rank's tensor-parallel rank.
        tp_size: tensor-parallel size.
        sequence_parallel: whether positions are split over TP ranks.
        layers: the global MoE layers this rank holds, in order (default: all of them).
        cp_size: context-parallel size (THD only): the row is first cut as the model's input is
            (`context_parallel.partition_index`), then split over TP under SP.
        cp_rank: this rank's context-parallel rank.

    Returns:
        Per local layer `[local_tokens, k]` expert ids, local_tokens = (L / (cp x tp)) * R
        under SP, L / cp * R otherwise (THD: R = 1, L = total padded length). Padding and each sample's
        last token get `filler_routing`.

    Raises:
        RoutingLengthError: a sample's row count is not its packed length - 1, or the sample
            count differs.
        RoutingLayerError: layer count or k differ between samples, or `layers` is out of range.
    """
    if len(routed_experts) != packed.num_samples:
        raise RoutingLengthError(
            f"routed experts for {len(routed_experts)} samples, the packed batch has {packed.num_samples}"
        )
    first = routed_experts[0]
    if first.ndim != 3:
        raise RoutingLayerError(
            f"sample 0: routed experts shape {tuple(first.shape)}, expected [T-1, layers, k]"
        )
    num_layers, topk = first.shape[1], first.shape[2]
    layers = list(range(num_layers)) if layers is None else list(layers)
    if any(not 0 <= i < num_layers for i in layers):
        raise RoutingLayerError(f"layers {layers} outside the {num_layers} layers of the routed experts")
    rows, length = packed.tokens.shape
    # [L, R, layers, k] in the router's position-major order, filler everywhere first.
    full = filler_routing(length * rows, topk, num_experts).view(length, rows, 1, topk)
    full = full.expand(length, rows, len(layers), topk).clone()
    for b, ((row, start, n), routes) in enumerate(zip(packed.segments, routed_experts)):
        if routes.ndim != 3 or routes.shape[1:] != (num_layers, topk):
            raise RoutingLayerError(
                f"sample {b}: routed experts shape {tuple(routes.shape)}, expected [*, {num_layers}, {topk}]"
            )
        if routes.shape[0] != n - 1:
            raise RoutingLengthError(
                f"sample {b}: {routes.shape[0]} routed rows for {n} tokens, expected {n - 1} (T - 1)"
            )
        full[start : start + n - 1, row] = routes[:, layers].to(torch.long)
    if full.numel() and (full.min() < 0 or full.max() >= num_experts):
        raise RoutingError(f"routed experts hold ids outside [0, {num_experts})")
    positions = _router_positions(packed, tp_rank, tp_size, sequence_parallel, cp_size, cp_rank)
    local = full[positions].reshape(-1, len(layers), topk)
    return compact(list(local.unbind(dim=1)), num_experts)


def routing_to_samples(
    packed: PackedBatch, routing: LayerRouting | Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Inverse of `routing_from_rollout` on full rows: per sample `[n - 1, layers, k]`.

    Args:
        packed: the packed batch the routing was computed on.
        routing: per layer `[L * R, k]` for all positions (gather the SP slices first, see
            `gather_sequence_parallel`).
    """
    layers = routing.layers if isinstance(routing, LayerRouting) else list(routing)
    rows, length = packed.tokens.shape
    if any(t.shape[0] != rows * length for t in layers):
        raise RoutingLengthError(
            f"routing covers {layers[0].shape[0]} tokens, the packed batch has {rows} x {length} positions"
        )
    full = torch.stack(list(layers), dim=1).view(length, rows, len(layers), -1)
    return [full[start : start + n - 1, row].clone() for row, start, n in packed.segments]


def gather_sequence_parallel(routing: LayerRouting, group=None) -> LayerRouting:
    """All-gather the per-rank SP slices of routing over the TP group: full-row token order."""
    import torch.distributed as dist

    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1:
        return routing
    gathered = []
    for t in routing.layers:
        wide = t.to(torch.int32).contiguous()  # gloo has no uint8 all_gather on every build
        parts = [torch.empty_like(wide) for _ in range(world)]
        dist.all_gather(parts, wide, group=group)
        gathered.append(torch.cat(parts).to(t.dtype))
    return LayerRouting(gathered)
