"""Routing in the RL step: Routing Replay (R2 / R3) and expert-activation drift metrics.

`StepRouting` is created by the trainer with the model and lives as long as it does. Each
pass over a mini-batch (pi_old, training) is one schedule run (`model/pipeline.py`);
`old_pass` / `train_pass` give the hooks for it, which record, replay and capture routing
keyed by micro-batch (`model/routing_hooks.py`), so the backward recompute of micro-batch i
replays i's routing however many micro-batches a pipeline has in flight. Each stage handles
its own MoE layers (R3 picks them out of the rollout's routing by global layer number). Under a
virtual pipeline each model chunk has its own `RoutingReplay` and hooks (`PerChunkHooks`), so
routing is keyed by (chunk, micro-batch).

- R2 (`routing_replay: r2`): the pi_old pass - a no-grad forward of every micro-batch with the
  rollout weights, before the first update (the same pass as `old_logprobs: recompute` when
  that is on) - records the routing, and every training forward replays it.
- R3 (`routing_replay: r3`): every training forward replays the routing the rollout engine
  returned (`routed_experts`, converted to the packed token order of this rank); no extra pass.
- Drift (`drift.enabled`): the pi_old pass captures the router's choice on every token; each
  training forward captures the router's own choice again (even under replay, where it is
  overridden), giving old->new drift per mini-batch (mini-batch m runs after m updates, so m = 0
  measures nothing but numerics); when the rollouts carry routed experts, the pi_old pass is
  also compared with them: inference->training drift on identical weights.

Metrics (keys): `drift/old_new/{mean,layer_i,tokens_changed,load_shift_mean}` over mini-batches
1..M-1 together, `drift/old_new_mb{m}/mean` per mini-batch, `drift/infer_train/...`, and
`routing/replay_bytes_per_token`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_gspo.algorithms.drift import DriftCounts, drift_counts
from megatron_gspo.model.chunks import model_chunks
from megatron_gspo.model.context_parallel import context_parallel_state
from megatron_gspo.model.distributed import all_reduce, compute_device
from megatron_gspo.model.micro_batch_hooks import MicroBatchHooks, PerChunkHooks
from megatron_gspo.model.routing import (
    LayerRouting,
    RoutingCapture,
    RoutingReplay,
    moe_routers,
    routing_from_rollout,
    routing_token_mask,
)
from megatron_gspo.model.routing_hooks import KeyedCapture, KeyedRecording, KeyedReplay
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.training.step.forward import MicroBatch
from megatron_gspo.training.step.scatter import RankRows


def every_kth(mask: torch.Tensor, k: int) -> torch.Tensor:
    """`mask` ([N] bool) keeping only its 1st, (k+1)-th, ... True entries: a deterministic sample."""
    if k <= 1:
        return mask
    keep = torch.zeros_like(mask)
    keep[mask.nonzero().flatten()[::k]] = True
    return keep


def sample_stride(tokens: int, budget: int) -> int:
    """The stride k: every k-th of `tokens` tokens stays within about `budget` (0: all, k = 1)."""
    return max(1, -(-tokens // budget)) if budget else 1


class StepRouting:
    """Replay targets and drift sums of the current step, for one model.

    Args:
        model: the (DDP-wrapped) policy; built with `routing_replay=True` unless `mode` is none.
        mode: none, r2 or r3.
        drift: measure drift (on the steps `drift_every` selects; see `begin_step`).
        drift_every: measure on steps 1, 1 + drift_every, ...
        drift_sample_tokens: compare about this many tokens per step on this rank (0: all).
        tp_rank: tensor-parallel rank.
        tp_size: tensor-parallel size.
        sequence_parallel: positions split over TP ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str,
        drift: bool,
        drift_every: int = 1,
        drift_sample_tokens: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        if mode not in ("none", "r2", "r3"):
            raise ValueError(f"routing_replay must be none, r2 or r3, got {mode!r}")
        self.model, self.mode = model, mode
        self.drift_enabled, self.drift_every = drift, drift_every
        self.drift_sample_tokens = drift_sample_tokens
        self.drift = drift  # this step measures drift (set per step by `set_step`)
        self._stride = 1  # every k-th routed token is compared (drift.sample_tokens)
        chunks = model_chunks(model)
        self.replays = [RoutingReplay(chunk) for chunk in chunks] if mode != "none" else []
        self.replay = self.replays[0] if self.replays else None
        routers = moe_routers(model)
        if drift and routers[0].config.pipeline_model_parallel_size > 1:
            raise ValueError(
                "drift metrics under pipeline parallelism are not supported: each stage holds only its "
                "own layers, and a token's 'changed in any layer' spans stages"
            )
        cp_size, cp_rank, _ = context_parallel_state()
        if drift and cp_size > 1:
            raise ValueError(
                f"drift metrics under context parallelism (parallel.context_parallel={cp_size}) are not "
                "supported: each rank routes only its part of every sequence; set drift.enabled=false"
            )
        self.num_experts, self.num_layers = routers[0].config.num_moe_experts, len(routers)
        self.layers = [r.layer_number - 1 for r in routers]  # global MoE layers of this stage
        self.chunk_layers = [[r.layer_number - 1 for r in moe_routers(chunk)] for chunk in chunks]
        self.tp = {"tp_rank": tp_rank, "tp_size": tp_size, "sequence_parallel": sequence_parallel}
        self.tp |= {"cp_size": cp_size, "cp_rank": cp_rank}  # the router's rows: CP partition, then SP
        self._batch: RolloutBatch | RankRows | None = None
        self._old: dict[int, LayerRouting] = {}
        self._targets: dict[int | tuple[int, int], LayerRouting] = {}  # by micro-batch (and chunk)
        self._old_new: dict[int, DriftCounts] = {}
        self._infer: DriftCounts | None = None

    def measures_drift(self, step: int) -> bool:
        """Whether RL step `step` (from 1) measures drift: no extra forward on the others."""
        return self.drift_enabled and (step - 1) % self.drift_every == 0

    def set_step(self, step: int) -> None:
        """Select what RL step `step` does (before `active` / `needs_old_pass` are read)."""
        self.drift = self.measures_drift(step)

    @property
    def needs_old_pass(self) -> bool:
        """Whether a no-grad pi_old forward must run before the first update."""
        return self.mode == "r2" or self.drift

    @property
    def active(self) -> bool:
        """Whether anything routing-related happens in a step."""
        return self.mode != "none" or self.drift

    def begin_step(self, batch: RolloutBatch | RankRows) -> None:
        """Forget the last step; keep the batch's routed experts (R3 targets, inference drift)."""
        if self.mode == "r3" and batch.routed_experts is None:
            raise ValueError("routing_replay=r3 needs rollouts with routed_experts (return_routed_experts)")
        self._batch = batch
        self._old, self._targets, self._old_new, self._infer = {}, {}, {}, None
        tokens = int((batch.prompt_lengths + batch.response_lengths).sum())
        self._stride = sample_stride(tokens, self.drift_sample_tokens)

    def _rollout_routing(self, micro: MicroBatch, layers: list[int] | None = None) -> LayerRouting:
        routes = [self._batch.routed_experts[i] for i in micro.indices]
        layers = self.layers if layers is None else layers
        return routing_from_rollout(
            micro.packed, routes, num_experts=self.num_experts, layers=layers, **self.tp
        )

    def _mask(self, micro: MicroBatch) -> torch.Tensor:
        return every_kth(routing_token_mask(micro.packed, **self.tp), self._stride)

    @contextlib.contextmanager
    def old_pass(self, micro_batches: list[MicroBatch]) -> Iterator[list[MicroBatchHooks]]:
        """Hooks for the pi_old schedule run over `micro_batches`: record (R2) and capture (drift).

        Yields the hooks to hand to `run_micro_batches`; what they saw is filed per micro-batch
        when the block ends.
        """
        if len(self.replays) > 1:
            yield from self._chunked_old_pass(micro_batches)
            return
        with contextlib.ExitStack() as stack:
            recording = KeyedRecording(self.replay) if self.mode == "r2" else None
            capture = None
            if self.drift:
                capture = KeyedCapture(stack.enter_context(RoutingCapture(self.model, source="router")))
            if self.replay is not None:
                stack.callback(self.replay.reset)
            yield [h for h in (recording, capture) if h is not None]
        for i, micro in enumerate(micro_batches):
            if recording is not None and i in recording.routing:
                self._targets[id(micro)] = recording.routing[i]
            if capture is not None and i in capture.routing:
                old = capture.routing[i]
                self._old[id(micro)] = old
                if self._batch is not None and self._batch.routed_experts is not None:
                    counts = self._counts(self._rollout_routing(micro), old, micro)
                    self._infer = counts if self._infer is None else self._infer + counts

    def _chunked_old_pass(self, micro_batches: list[MicroBatch]) -> Iterator[list[MicroBatchHooks]]:
        """`old_pass` under a virtual pipeline: R2 records per (chunk, micro-batch); no drift."""
        recordings = [KeyedRecording(replay) for replay in self.replays] if self.mode == "r2" else []
        try:
            yield [PerChunkHooks([[r] for r in recordings])] if recordings else []
        finally:
            for replay in self.replays:
                replay.reset()
        for c, recording in enumerate(recordings):
            for i, micro in enumerate(micro_batches):
                if i in recording.routing:
                    self._targets[(c, id(micro))] = recording.routing[i]

    @contextlib.contextmanager
    def train_pass(self, mini_batch: int, micro_batches: list[MicroBatch]) -> Iterator[list[MicroBatchHooks]]:
        """Hooks for the training schedule run of one mini-batch: replay (keyed), capture for drift."""
        if len(self.replays) > 1:
            try:
                yield [
                    PerChunkHooks([[self._chunk_replay(c, micro_batches)] for c in range(len(self.replays))])
                ]
            finally:
                for replay in self.replays:
                    replay.reset()
            return
        with contextlib.ExitStack() as stack:
            hooks: list[MicroBatchHooks] = []
            if self.mode == "r2":
                hooks.append(KeyedReplay(self.replay, lambda i: self._targets[id(micro_batches[i])]))
            elif self.mode == "r3":
                hooks.append(KeyedReplay(self.replay, lambda i: self._rollout_routing(micro_batches[i])))
            capture = None
            if self.drift:
                capture = KeyedCapture(stack.enter_context(RoutingCapture(self.model, source="router")))
                hooks.append(capture)
            if self.replay is not None:
                stack.callback(self.replay.reset)
            yield hooks
        if capture is None:
            return
        for i, micro in enumerate(micro_batches):
            if i in capture.routing and id(micro) in self._old:
                counts = self._counts(self._old[id(micro)], capture.routing[i], micro)
                previous = self._old_new.get(mini_batch)
                self._old_new[mini_batch] = counts if previous is None else previous + counts

    def _chunk_replay(self, c: int, micro_batches: list[MicroBatch]) -> KeyedReplay:
        """Chunk c's replay of each micro-batch: its R2 recording, or the rollout's routes of its layers."""
        if self.mode == "r2":
            return KeyedReplay(self.replays[c], lambda i: self._targets[(c, id(micro_batches[i]))])
        layers = self.chunk_layers[c]
        return KeyedReplay(self.replays[c], lambda i: self._rollout_routing(micro_batches[i], layers))

    def _counts(self, a: LayerRouting, b: LayerRouting, micro: MicroBatch) -> DriftCounts:
        """Drift sums of routing b against a, on the compute device (they are all-reduced later)."""
        device = compute_device()
        return drift_counts(
            a.stacked().to(device),
            b.stacked().to(device),
            num_experts=self.num_experts,
            mask=self._mask(micro).to(device),
        )

    def _reduce(self, counts: DriftCounts) -> DriftCounts:
        flat = counts.as_tensor().to(compute_device())
        all_reduce(flat)  # every (token, layer) lives on exactly one rank
        return DriftCounts.from_tensor(flat, self.num_layers, self.num_experts)

    def step_metrics(self) -> dict[str, float]:
        """The step's drift metrics, reduced over all ranks (collective; same keys everywhere)."""
        out: dict[str, float] = {}
        if self.replays:
            out["routing/replay_bytes_per_token"] = float(sum(r.bytes_per_token for r in self.replays))
        if not self.drift:
            return out
        later = None
        for m in sorted(self._old_new):
            reduced = self._reduce(self._old_new[m])
            out[f"drift/old_new_mb{m}/mean"] = reduced.summary().mean
            if m > 0:
                later = reduced if later is None else later + reduced
        if later is not None:
            out.update(later.summary().metrics("drift/old_new"))
        has_rollout = torch.tensor(float(self._infer is not None), device=compute_device())
        all_reduce(has_rollout, op=dist.ReduceOp.MIN)
        if has_rollout:
            out.update(self._reduce(self._infer).summary().metrics("drift/infer_train"))
        return out

    def close(self) -> None:
        """Clear megatron's replay state for this model."""
        for replay in self.replays:
            replay.close()
