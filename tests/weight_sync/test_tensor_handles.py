"""SGLang's tensor-handle payload: what the trainer writes, and what the receiving side refuses by name."""

import base64
import dataclasses
import io
import os
import pickle
import sys
import types

import pytest
import torch
from safetensors.torch import save as safetensors_save

from megatron_gspo.weight_sync import tensor_handles

# int64 first: each tensor's byte offset is a multiple of its element size, as `view(dtype)` needs.
TENSORS = {
    "c": torch.ones(2, dtype=torch.int64),
    "a": torch.randn(3, 4),
    "b": torch.arange(6, dtype=torch.bfloat16),
}
KEPT = []


def _bucket(named):
    raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in named.values()])
    flat = tensor_handles.shareable(raw)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in named.values()]
    shapes = [list(t.shape) for t in named.values()]
    return flat, tensor_handles.serialize_flattened_bucket(flat, list(named), dtypes, shapes)


def test_a_bucket_round_trips_through_shared_memory():
    """Opened here; by another process: test_weight_sync.py (the server) and test_weight_sync_sglang.py."""
    flat, entry = _bucket(TENSORS)
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # restored after use
    assert flat.untyped_storage().is_shared()
    assert len(entry) < 1024  # a segment name and metadata (bodies vs bytes: test_weight_sync_tensor_handles)
    got = tensor_handles.named_tensors(tensor_handles.deserialize(entry), "flattened_bucket")
    assert list(got) == list(TENSORS)
    for name, want in TENSORS.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def _handles(obj) -> str:
    """`obj` pickled as the trainer does, its tensors first moved to shared memory."""

    def shared(value):
        if isinstance(value, torch.Tensor):
            return tensor_handles.shareable(value.reshape(-1)).view(value.dtype).reshape(value.shape)
        if isinstance(value, dict):
            return {k: shared(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(shared(v) for v in value)
        return value

    obj = shared(obj)
    KEPT.append(obj)  # a handle names memory: it must outlive the test that opens it
    return tensor_handles.serialize(obj)


def _pickled(obj) -> str:
    buf = io.BytesIO()
    pickle.Pickler(buf, 4).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    ("entry", "load_format", "named"),
    [
        ("not base64!", "flattened_bucket", "not base64"),
        (
            base64.b64encode(safetensors_save({"a": torch.ones(2)})).decode(),
            None,
            "not a MultiprocessingSerializer",
        ),
        (_pickled(os.getcwd), None, "refers to posix.getcwd, not allowed here"),
        (
            _handles({"flattened_tensor": torch.ones(2)}),
            "flattened_bucket",
            "dict with flattened_tensor and metadata",
        ),
        (
            _pickled([("a", torch.ones(2))]),
            None,
            # torch's reducer, or megatron-core 0.19's safe_globals.safe_load_from_bytes once
            # megatron.core is imported in the process (it replaces the storage reducer)
            "_load_from_bytes, not allowed",
        ),  # bytes inline
        (_handles([("a", torch.ones(2))]), "direct", "load_format='direct' unsupported"),
        (
            _handles(
                {
                    "flattened_tensor": torch.zeros(8, dtype=torch.uint8),
                    "metadata": [
                        types.SimpleNamespace(
                            name="w",
                            shape=torch.Size([4]),
                            dtype=torch.float32,
                            start_idx=0,
                            end_idx=16,
                            numel=16,
                        )
                    ],
                }
            ),
            "flattened_bucket",
            "w: bytes [0, 16) of torch.float32 outside the bucket",
        ),
    ],
)
def test_what_is_not_a_handle_payload_is_refused_by_name(entry, load_format, named):
    with pytest.raises(tensor_handles.TensorPayloadError) as err:
        tensor_handles.named_tensors(tensor_handles.deserialize(entry), load_format)
    assert named in str(err.value)


def test_a_file_descriptor_handle_is_refused_naming_the_strategy():
    shared = torch.ones(4).share_memory_()  # torch's default CPU strategy: a descriptor
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, 4).dump([("a", shared)])
    with pytest.raises(tensor_handles.TensorPayloadError, match="file_system strategy"):
        tensor_handles.deserialize(base64.b64encode(buf.getvalue()).decode())


def test_sglang_s_own_metadata_class_decodes(monkeypatch):
    """What SGLang's ecosystem sends (its `FlattenedTensorMetadata` dataclass by name) opens here."""
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):  # what pickle imports first
        monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent, types.ModuleType(parent)))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = tensor_handles.shareable(want.reshape(-1).view(torch.uint8))
    meta = [FlattenedTensorMetadata("w", want.shape, want.dtype, 0, 48, 48)]
    entry = tensor_handles.serialize({"flattened_tensor": flat, "metadata": meta})
    assert "sglang.srt.weight_sync.tensor_bucket" in base64.b64decode(entry).decode("latin-1")
    got = tensor_handles.named_tensors(tensor_handles.deserialize(entry), "flattened_bucket")
    assert torch.equal(got["w"], want)
