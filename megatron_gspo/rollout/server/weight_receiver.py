"""The embedded server's side of SGLang's distributed weight update, all-or-nothing.

SGLang (0.5.23) protocol, one sync:
  /init_weights_update_group (once)  -> join the group with the trainer's sender (rank 0);
  /begin_weight_update               -> open a session;
  /update_weights_from_distributed   -> per bucket: receive a broadcast from rank 0 (one
                                        flattened byte tensor with `load_format:
                                        flattened_bucket`, else one broadcast per tensor);
  /end_weight_update                 -> close the session.
SGLang loads each bucket into the live weights as it arrives. This server stages the buckets
and swaps them in at `end_weight_update` in one step under the engine's lock, so a failed
bucket (bad name or shape, NaN/inf, a broken group) leaves the old weights and the old
`weight_version` serving; the session is then marked failed and `end_weight_update` reports
it and discards the staged tensors. A sender that failed on its side (a bucket lost on the
way) ends the session with `{"abort": true}` (an extension; SGLang ignores the field and keeps
what it loaded until the retry overwrites it). Staging costs one extra copy of the updated tensors.
Blockwise FP8 weights (`X.weight` float8_e4m3fn with `X.weight_scale_inv`, `model/fp8.py`) are
staged dequantised: the engine computes with the FP8 values, as an FP8 SGLang server does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gspo.model.fp8 import dequantize_named
from megatron_gspo.model.hf_checkpoint import check_finite, check_fits_model
from megatron_gspo.model.hf_stream import flat_nbytes, tensor_dtype, unflatten_bucket
from megatron_gspo.rollout.server.engine import GenerationEngine
from megatron_gspo.rollout.server.memory import MemoryOccupationError
from megatron_gspo.rollout.update_group import destroy_update_group, init_update_group

FLATTENED_BUCKET = "flattened_bucket"
_BACKENDS = ("gloo", "nccl")


class WeightSyncError(ValueError):
    """A request of the distributed weight-update protocol failed (the message says why)."""


@dataclass
class _Session:
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    buckets: int = 0
    weight_version: str | None = None
    failure: str | None = None
    fp8_pending: dict[str, torch.Tensor] = field(default_factory=dict)
    """FP8 weights or scales whose partner is in a later bucket."""


class WeightReceiver:
    """Weight-update groups and the staging session of one embedded server (one rank)."""

    def __init__(self, engine: GenerationEngine, *, timeout_s: float = 600.0):
        self.engine = engine
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._session: _Session | None = None
        self._lock = threading.Lock()  # one protocol step at a time

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join group `group_name` as rank `rank_offset` (this server has one rank); blocks until all join."""
        if backend not in _BACKENDS:
            raise WeightSyncError(f"backend={backend!r} unsupported; use one of {_BACKENDS}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise WeightSyncError(
                "backend='nccl' needs a CUDA device; this server runs on the CPU (use gloo)"
            )
        if not group_name:
            raise WeightSyncError("group_name must not be empty")
        if not 0 < rank_offset < world_size:
            raise WeightSyncError(f"rank_offset={rank_offset} must be in [1, world_size={world_size})")
        with self._lock:
            if group_name in self._groups:
                raise WeightSyncError(f"group {group_name!r} already exists; destroy it first")
            self._groups[group_name] = init_update_group(
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=self.timeout_s,
            )

    def destroy_group(self, group_name: str) -> None:
        """Leave group `group_name`."""
        with self._lock:
            group = self._groups.pop(group_name, None)
            if group is None:
                raise WeightSyncError(f"group {group_name!r} does not exist")
            destroy_update_group(group)

    def begin(self) -> None:
        """Open a weight-update session."""
        with self._lock:
            if self._session is not None:
                raise WeightSyncError("a weight-update session is already open; call end_weight_update first")
            self._session = _Session()

    def receive(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
    ) -> int:
        """Receive one bucket from rank 0 of `group_name` and stage it; returns its tensor count.

        The broadcast is always received once the request is well-formed, even when the
        session already failed, so the sender never waits on this server.
        """
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise WeightSyncError(
                    f"group {group_name!r} not initialised; call init_weights_update_group first"
                )
            if load_format not in (None, FLATTENED_BUCKET):
                raise WeightSyncError(
                    f"load_format={load_format!r} unsupported; use None or {FLATTENED_BUCKET!r}"
                )
            if not (len(names) == len(dtypes) == len(shapes)) or not names:
                raise WeightSyncError(
                    "names/dtypes/shapes must be non-empty and equally long: "
                    f"{len(names)}/{len(dtypes)}/{len(shapes)}"
                )
            session = self._session
            received = self._broadcast_in(group, names, dtypes, shapes, load_format)
            return self._stage(session, received, weight_version)

    @property
    def session_open(self) -> bool:
        """Whether updates are being staged (between begin and end)."""
        return self._session is not None

    def stage(self, named: dict[str, torch.Tensor], weight_version: str | None) -> int:
        """Stage tensors that arrived another way (`/update_weights_from_tensor` inside a session)."""
        with self._lock:
            return self._stage(self._session, named, weight_version)

    def _stage(self, session: _Session | None, received: dict[str, torch.Tensor], weight_version) -> int:
        if session is None:
            raise WeightSyncError(
                "update_weights_from_distributed must run between begin_weight_update and end_weight_update"
            )
        session.buckets += 1
        if session.failure is None:
            try:
                received = dequantize_named(received, session.fp8_pending)
                check_finite(received, "weight update")
                self.engine.memory.check_update()
                check_fits_model(self.engine.model, received)
            except (KeyError, ValueError, MemoryOccupationError) as exc:
                session.failure = f"bucket {session.buckets}: {exc}"
                session.staged.clear()
        if session.failure is not None:
            raise WeightSyncError(f"weight update failed at {session.failure}; nothing will be applied")
        session.staged.update(received)
        if weight_version is not None:
            session.weight_version = str(weight_version)
        return len(received)

    def end(self, *, abort: bool = False) -> int:
        """Close the session: swap the staged tensors in, all at once.

        The staged tensors are discarded instead when the sender says the sync failed
        (`abort`) or a bucket failed here.
        """
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                raise WeightSyncError("no weight-update session is open; call begin_weight_update first")
            if abort:
                return 0
            if session.failure is not None:
                raise WeightSyncError(
                    f"weight update failed at {session.failure}; the previous weights "
                    f"(version {self.engine.weight_version}) keep serving"
                )
            if session.fp8_pending:
                raise WeightSyncError(
                    f"weight update failed: FP8 tensors without their weight or scale: "
                    f"{sorted(session.fp8_pending)[:3]}; the previous weights keep serving"
                )
            if not session.staged:
                return 0
            return self.engine.update_weights_from_tensors(session.staged, session.weight_version)

    def _broadcast_in(
        self,
        group: dist.ProcessGroup,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        load_format,
    ) -> dict[str, torch.Tensor]:
        device = self.engine.device
        if load_format == FLATTENED_BUCKET:
            flat = torch.empty(flat_nbytes(dtypes, shapes), dtype=torch.uint8, device=device)
            dist.broadcast(flat, group=group, group_src=0)
            return unflatten_bucket(flat, names, dtypes, shapes)
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=tensor_dtype(dtype), device=device)
            dist.broadcast(tensor, group=group, group_src=0)
            out[name] = tensor
        return out
