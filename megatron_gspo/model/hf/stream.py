"""The policy's weights as a stream of HF tensors, cut into buckets.

The one iterator behind weight sync to the rollout servers and `megatron-gspo export`.

`iter_hf_tensors` walks the model's global tensors one at a time (`sharding.iter_global_tensors`
gathers each over TP and EP; under pipeline parallelism the stages take turns and the owning
stage broadcasts each tensor over the pipeline group, so rank 0 receives the other stages'
layers one tensor at a time), converts each to its HF tensors (`convert.name_table`: QKV split
per query group, fc1 split into gate/up) and yields them on the sending rank. `iter_buckets`
groups that stream into `Bucket`s of about `bucket_bytes`, flattened into one byte tensor in
SGLang's `flattened_bucket` layout (each tensor's bytes, concatenated in order).

Memory: the sender holds the bucket being filled, the flattened copy of the previous one while
it is sent, and one global tensor in flight (about two buckets beyond its own shards); the other
ranks hold one gathered tensor at a time (a colocated tensor sync, `every_rank`: each rank
holds what the sender does, its own copy for the server rank on its GPU). Who sends: global rank
0 alone (colocated: rank 0 posts every rank's handles). SGLang's receivers
take every broadcast from rank 0 of the weight-update group, so a second sender would need a
second group spanning every SGLang rank, and each server applies its update requests one after
another anyway; the gathers that feed rank 0 already run over all TP/EP ranks at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_gspo.model import control_plane
from megatron_gspo.model.config import MoEModelConfig
from megatron_gspo.model.distributed import unwrap_model
from megatron_gspo.model.hf.checkpoint import first_non_finite
from megatron_gspo.model.hf.convert import ConversionError, megatron_tensor_to_hf, name_table
from megatron_gspo.model.sharding import iter_global_tensors

T = TypeVar("T")


class NonFiniteWeightError(ConversionError):
    """A weight about to leave the trainer holds NaN or inf (the tensor is named)."""


def refuse_non_finite(model: torch.nn.Module, what: str) -> None:
    """Collective: raise `NonFiniteWeightError` on every rank if any rank's shard holds NaN/inf.

    Every rank checks its own parameters (replicated ones included: a replica may differ), one
    flag per tensor computed where it lives and read back once; the first offender is named.
    """
    problem = first_non_finite(
        {n: p for n, p in unwrap_model(model).named_parameters() if p.is_floating_point()}
    )
    found = [(r, p) for r, p in enumerate(control_plane.all_gather_objects(problem)) if p is not None]
    if found:
        r, name = found[0]
        raise NonFiniteWeightError(
            f"refusing to {what}: tensor {name} has NaN/inf values on rank {r} (previous weights kept)"
        )


def iter_hf_tensors(
    model: torch.nn.Module, model_cfg: MoEModelConfig, *, sender: bool, every_rank: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF on-disk name, tensor) for every weight; collective over all ranks.

    Every rank must drain the iterator (the gathers are collectives); only the `sender`,
    global rank 0, converts and receives tensors, the others get nothing, and only those
    holding shards of the replica rank 0 gathers take part (`iter_global_tensors(to_rank0=True)`).
    With `every_rank` each rank receives and converts every tensor on its own device (a
    colocated sync: each rank hands its copy to the server rank on its GPU).
    Tensors stay on the device they were gathered on. With tied embeddings `lm_head.weight` is
    not produced.

    Raises:
        ConversionError: the model has a tensor the name table lacks, or lacks one it has
            (raised on every rank: the names are the same everywhere).
    """
    table = {t.megatron: t for t in name_table(model_cfg)}
    sender = sender or every_rank
    for name, tensor in iter_global_tensors(model, to_rank0=not every_rank):
        mapping = table.pop(name, None)
        if mapping is None:
            raise ConversionError(f"model tensor {name!r} has no HF counterpart in the name table")
        if sender:
            yield from megatron_tensor_to_hf(mapping, tensor, model_cfg).items()
    if table and sender:  # the other ranks walk only their part of the model
        raise ConversionError(f"model lacks {len(table)} tensor(s), e.g. {sorted(table)[:3]}")


def run_on_hf_stream(
    model: torch.nn.Module,
    model_cfg: MoEModelConfig,
    consume: Callable[[Iterator[tuple[str, torch.Tensor]]], T],
) -> T:
    """Collective: global rank 0 runs `consume` on the HF tensor stream; its result on every rank.

    Whatever `consume` leaves unread (it returned or raised early) is drained, so the other
    ranks' gathers always complete; an exception of `consume` (or of the stream) is raised on
    every rank after the walk, never leaving a rank waiting in a collective.
    """
    sender = not dist.is_initialized() or dist.get_rank() == 0
    stream = iter_hf_tensors(model, model_cfg, sender=sender)
    outcome: T | BaseException | None = None
    if sender:
        try:
            outcome = consume(stream)
        except Exception as exc:  # every rank must learn about it, after the gathers finish
            outcome = exc
    try:
        for _ in stream:
            pass
    except ConversionError:
        if sender:
            raise  # raised identically on every rank (same names everywhere)
    return control_plane.broadcast_from_rank0(outcome)


@dataclass
class Bucket:
    """Named tensors sent as one unit (one `/update_weights_from_distributed` request)."""

    index: int
    last: bool = False
    """No bucket follows (SGLang's `weight_version` rides on the last one)."""
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    """SGLang's dtype strings (`bfloat16`, `float32`, ...), in order."""
    shapes: list[list[int]] = field(default_factory=list)
    """Each tensor's shape, in order."""
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor."""
        self.names.append(name)
        self.tensors.append(tensor)
        self.dtypes.append(str(tensor.dtype).removeprefix("torch."))
        self.shapes.append(list(tensor.shape))
        self.nbytes += tensor.numel() * tensor.element_size()

    def flatten(self, device: torch.device | str | None = None) -> torch.Tensor:
        """All tensors' bytes, concatenated in order: a uint8 tensor of `nbytes` on `device`.

        A bucket of one contiguous tensor already on `device` is viewed, not copied (a tensor
        bigger than the bucket size travels alone, so this spares the largest copies).
        """
        device = torch.device(device) if device is not None else self.tensors[0].device
        first = self.tensors[0]
        if len(self.tensors) == 1 and first.is_contiguous() and first.device == device:
            return first.detach().reshape(-1).view(torch.uint8)
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        offset = 0
        for tensor in self.tensors:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        return flat

    def flatten_and_release(self, device: torch.device | str | None = None) -> torch.Tensor:
        """`flatten`, then drop the tensors: the flat copy alone holds their bytes from here on.

        Names, dtypes and shapes stay for the request that announces the bucket. A gathered
        tensor is a fresh copy that only the bucket holds, so keeping the tensors beside the
        flat copy would double the sender's memory per bucket.
        """
        flat = self.flatten(device)
        self.tensors = []
        return flat


def tensor_dtype(name: str) -> torch.dtype:
    """The torch dtype of an SGLang dtype string (`bfloat16`, `float32`, ...); ValueError if none."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def flat_nbytes(dtypes: list[str], shapes: list[list[int]]) -> int:
    """Bytes of a flattened bucket holding tensors of these dtypes and shapes."""
    return sum(torch.Size(s).numel() * tensor_dtype(d).itemsize for d, s in zip(dtypes, shapes))


def unflatten_bucket(
    flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> dict[str, torch.Tensor]:
    """The inverse of `Bucket.flatten` (views into `flat`), checking that the sizes add up."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    out, offset = {}, 0
    described = flat_nbytes(dtypes, shapes)
    if described != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, its tensors describe {described}")
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = tensor_dtype(dtype_name)
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        size = torch.Size(shape).numel() * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not aligned to {dtype}")
        out[name] = flat[offset : offset + size].view(dtype).reshape(shape)
        offset += size
    return out


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group a (name, tensor) stream into buckets of at most `bucket_bytes` (a bigger tensor goes alone).

    A tensor whose byte offset would not be a multiple of its element size starts a new bucket.

    A bucket is yielded once the next tensor is in hand, so the final one knows it is `last`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket = Bucket(index=0)
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        # Receivers view each tensor in place, so its byte offset must suit its dtype.
        misaligned = bucket.nbytes % tensor.element_size() != 0
        if bucket.names and (bucket.nbytes + nbytes > bucket_bytes or misaligned):
            yield bucket
            bucket = Bucket(index=bucket.index + 1)
        bucket.add(name, tensor)
    if bucket.names:
        bucket.last = True
        yield bucket
