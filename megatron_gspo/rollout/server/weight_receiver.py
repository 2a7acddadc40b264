"""The embedded server's side of SGLang's distributed weight update: bucket by bucket, as SGLang.

SGLang (0.5.23) protocol, one sync:
  /init_weights_update_group (once)  -> join the group with the trainer's sender (rank 0);
  /begin_weight_update               -> open a session;
  /update_weights_from_distributed   -> per bucket: receive a broadcast from rank 0 (one
                                        flattened byte tensor with `load_format:
                                        flattened_bucket`, else one broadcast per tensor);
  /end_weight_update                 -> close the session.
SGLang loads each bucket into the live weights as it arrives, and so does this server. A bucket
that fails (bad name or shape, NaN/inf, released memory, a broken group) is refused whole; the
buckets before it stay loaded, as SGLang leaves them ("the full weights of the ModelRunner are
partially updated"), and `weight_version` (carried by the last bucket) keeps its old label: a
failed sync leaves mixed weights under the old version until a retry sends every bucket again.
`/end_weight_update` closes the session; its `{"abort": true}` (an extension this project's
sender adds after a failure) changes nothing, as SGLang ignores the field. Blockwise FP8 weights
(`X.weight` float8_e4m3fn with `X.weight_scale_inv`, `model/fp8/blockwise.py`) are loaded dequantised once
both halves have arrived: the engine computes with the FP8 values, as an FP8 SGLang server does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gspo.model.fp8.blockwise import dequantize_named
from megatron_gspo.model.hf.checkpoint import check_fits_model
from megatron_gspo.model.hf.stream import flat_nbytes, tensor_dtype, unflatten_bucket
from megatron_gspo.rollout.server.engine import GenerationEngine
from megatron_gspo.rollout.server.memory import MemoryOccupationError
from megatron_gspo.weight_sync.tensor_handles import FLATTENED_BUCKET
from megatron_gspo.weight_sync.update_group import destroy_update_group, init_update_group

_BACKENDS = ("gloo", "nccl")


class WeightSyncError(ValueError):
    """A request of the distributed weight-update protocol failed (the message says why)."""


@dataclass
class _Session:
    buckets: int = 0
    loaded: int = 0
    """Tensors loaded so far (the buckets before a failed one stay loaded)."""
    fp8_pending: dict[str, torch.Tensor] = field(default_factory=dict)
    """FP8 weights or scales whose partner is in a later bucket."""


class WeightReceiver:
    """Weight-update groups and the update session of one embedded server (one rank)."""

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
        """Receive one bucket from rank 0 of `group_name` and load it; returns its tensor count.

        The broadcast is always received once the request is well-formed, even when the bucket
        is then refused, so the sender never waits on this server.
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
            return self._load(session, received, weight_version)

    @property
    def session_open(self) -> bool:
        """Whether a weight-update session is open (between begin and end)."""
        return self._session is not None

    def load(self, named: dict[str, torch.Tensor], weight_version: str | None) -> int:
        """Load tensors that arrived another way (`/update_weights_from_tensor` inside a session)."""
        with self._lock:
            return self._load(self._session, named, weight_version)

    def _load(self, session: _Session | None, received: dict[str, torch.Tensor], weight_version) -> int:
        if session is None:
            raise WeightSyncError(
                "update_weights_from_distributed must run between begin_weight_update and end_weight_update"
            )
        session.buckets += 1
        try:
            received = dequantize_named(received, session.fp8_pending)
            check_fits_model(self.engine.model, received)
            count = self.engine.update_weights_from_tensors(received, weight_version)
        except (KeyError, ValueError, MemoryOccupationError) as exc:
            raise WeightSyncError(
                f"weight update failed at bucket {session.buckets}: {exc}; the {session.loaded} tensor(s) "
                f"of the buckets before it are loaded, version {self.engine.weight_version} still labels "
                "them (as SGLang: partially updated weights until a full update)"
            ) from None
        session.loaded += count
        return count

    def end(self, *, abort: bool = False) -> int:
        """Close the session; returns the tensors it loaded.

        `abort` changes nothing (SGLang ignores the field): what was loaded stays loaded.
        """
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                raise WeightSyncError("no weight-update session is open; call begin_weight_update first")
            if session.fp8_pending and not abort:
                raise WeightSyncError(
                    f"weight update incomplete: FP8 tensors without their weight or scale were not "
                    f"loaded: {sorted(session.fp8_pending)[:3]}"
                )
            return session.loaded

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
