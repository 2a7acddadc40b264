"""SGLang's `/update_weights_from_tensor` payload: tensor handles through torch's multiprocessing reductions.

SGLang 0.5.23 (`http_server:update_weights_from_tensor`, `io_struct:UpdateWeightsFromTensorReqInput`)
takes `serialized_named_tensors`, one entry per TP rank of the server, each the base64 of
`MultiprocessingSerializer.serialize(obj)` (`utils/common.py`): a `ForkingPickler` pickle, in which
torch's reductions (`torch.multiprocessing.reductions`) write a *handle* to each tensor's memory,
never its bytes. TP rank r unpickles entry r only (`tp_worker:deserialize_own_rank`, with SGLang's
`SafeUnpickler` allow-list) and hands the tensors to its model's `load_weights`. With
`load_format="flattened_bucket"` the object is `{"flattened_tensor": uint8 tensor, "metadata":
[entries with name, shape, dtype, start_idx, end_idx, numel]}` and the tensors are byte ranges of the
flat one (`weight_sync/tensor_bucket.py:FlattenedTensorBucket`, read by
`model_runner_components/weight_updater.py:_update_weights_from_flattened_bucket`); without it, a
list of (name, tensor) pairs.

The handles:
- CUDA: an IPC handle of the tensor's allocation (`rebuild_cuda_tensor`). The device is written as
  its UUID, as SGLang's own sender patch does (`utils/patch_torch.py`), since the server may number
  the GPUs differently from the trainer; SGLang's receiver maps the UUID back to its index.
- CPU: a POSIX shared-memory segment opened by name (`rebuild_storage_filename`, torch's
  `file_system` sharing strategy, with its `torch_shm_manager` counting references), which an
  unrelated process can open. torch's default CPU strategy (`file_descriptor`) passes a descriptor
  that only a process started by the sender can receive, so the sender uses `file_system` here.

The metadata entries are `types.SimpleNamespace` objects: SGLang reads them by attribute and its
unpickler allows that type, so the trainer needs no SGLang install. The sender keeps each flat
tensor alive until every server has answered for it (the handle is only a name for its memory).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import pickle
import threading
import types
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED_BUCKET)
"""The `load_format`s of `/update_weights_from_tensor` decoded here (SGLang's other ones, `direct`
and custom loaders, are model-specific)."""
_CUDA_DEVICE_ARG = 6  # the device's place in `reduce_tensor`'s arguments for a CUDA tensor
_STRATEGY_LOCK = threading.Lock()


class TensorPayloadError(ValueError):
    """A `serialized_named_tensors` entry this side cannot decode; the message says why."""


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """The `file_system` CPU sharing strategy of torch while inside (it is process-wide: restored after)."""
    with _STRATEGY_LOCK:
        before = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch.multiprocessing.set_sharing_strategy(before)


def shareable(flat: torch.Tensor) -> torch.Tensor:
    """`flat` where a handle to it can be sent: itself on CUDA; on CPU a copy in shared memory."""
    if flat.is_cuda:
        return flat
    with _file_system_sharing():
        shared = torch.empty(flat.numel(), dtype=flat.dtype).share_memory_()
    shared.copy_(flat.reshape(-1))
    return shared


class _HandlePickler(ForkingPickler):
    """ForkingPickler (torch's reductions) writing a CUDA tensor's device as its UUID."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
        return NotImplemented


def serialize(obj: object) -> str:
    """Base64 of the handle pickle of `obj` (SGLang's `MultiprocessingSerializer.serialize(obj, True)`)."""
    buf = io.BytesIO()
    with _file_system_sharing():
        _HandlePickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_flattened_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> str:
    """One `serialized_named_tensors` entry for `load_format="flattened_bucket"`.

    Args:
        flat: the bucket's bytes (uint8, from `shareable`), the tensors back to back in order.
        names: each tensor's HF name.
        dtypes: each tensor's dtype string (`float32`, `bfloat16`, ...).
        shapes: each tensor's shape.
    """
    metadata, offset = [], 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape)
        nbytes = size.numel() * dtype.itemsize
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=size, dtype=dtype, start_idx=offset, end_idx=offset + nbytes, numel=nbytes
            )
        )
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"the bucket holds {flat.numel()} bytes, its tensors describe {offset}")
    return serialize({"flattened_tensor": flat, "metadata": metadata})


# --------------------------------------------------------------------------- receiving side
class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of that name, so a payload from SGLang's own sender decodes."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_ALLOWED = {
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("types", "SimpleNamespace"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
}


def _rebuild_cuda_tensor(*args):
    """Torch's `rebuild_cuda_tensor`, the device given as an index or (as senders here write it) a UUID."""
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        found = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not found:
            raise TensorPayloadError(f"a tensor handle names GPU {device}, which this process does not see")
        device = found[0]
    return reductions.rebuild_cuda_tensor(*args[:_CUDA_DEVICE_ARG], device, *args[_CUDA_DEVICE_ARG + 1 :])


_STAND_INS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
}


class _HandleUnpickler(pickle.Unpickler):
    """Only what a tensor-handle payload holds: containers, torch sizes and dtypes, tensor rebuilds."""

    def find_class(self, module: str, name: str):
        if (module, name) in _STAND_INS:
            return _STAND_INS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        hint = (
            " (a CPU tensor shared by file descriptor: the sender must use the file_system strategy)"
            if name == "rebuild_storage_fd"
            else ""
        )
        raise TensorPayloadError(
            f"serialized_named_tensors refers to {module}.{name}, not allowed here{hint}"
        )


def deserialize(payload: object) -> object:
    """The object of one base64 `serialized_named_tensors` entry (tensors opened from their handles)."""
    if not isinstance(payload, str):
        raise TensorPayloadError(
            f"a serialized_named_tensors entry must be a base64 string, got {type(payload).__name__}"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise TensorPayloadError(f"serialized_named_tensors entry is not base64: {err}") from None
    if len(data) < 2 or data[0] != 0x80:
        raise TensorPayloadError(
            "serialized_named_tensors entry is not a MultiprocessingSerializer pickle (SGLang's format)"
        )
    try:
        return _HandleUnpickler(io.BytesIO(data)).load()
    except TensorPayloadError:
        raise
    except Exception as err:  # noqa: BLE001 - a handle that cannot be opened, a truncated pickle, ...
        raise TensorPayloadError(
            f"serialized_named_tensors entry cannot be opened: {type(err).__name__}: {err}"
        ) from None


def named_tensors(obj: object, load_format: str | None) -> dict[str, torch.Tensor]:
    """The (name -> tensor) pairs of a decoded entry, as SGLang reads them for `load_format`."""
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
            raise TensorPayloadError("a flattened_bucket entry is a dict with flattened_tensor and metadata")
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise TensorPayloadError("flattened_tensor must be a 1-D uint8 tensor")
        out = {}
        for meta in obj["metadata"]:
            try:
                name, shape, dtype = meta.name, torch.Size(meta.shape), meta.dtype
                start, end = int(meta.start_idx), int(meta.end_idx)
            except (AttributeError, TypeError) as err:
                raise TensorPayloadError(f"flattened_bucket metadata entry malformed: {err}") from None
            if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
                raise TensorPayloadError(f"{name}: bytes [{start}, {end}) of {dtype} outside the bucket")
            if end - start != shape.numel() * dtype.itemsize or start % dtype.itemsize:
                raise TensorPayloadError(f"{name}: bytes [{start}, {end}) do not hold {dtype} {tuple(shape)}")
            out[name] = flat[start:end].view(dtype).reshape(shape)
        return out
    if load_format is None:
        if not isinstance(obj, list | tuple) or not all(
            isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in obj
        ):
            raise TensorPayloadError("without load_format an entry is a list of (name, tensor) pairs")
        return {str(name): tensor for name, tensor in obj}
    raise TensorPayloadError(f"load_format={load_format!r} unsupported; use one of {list(LOAD_FORMATS)}")
