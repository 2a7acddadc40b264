"""Buckets of the weight stream and the shard-by-shard HF checkpoint writer."""

import json

import pytest
import torch

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import HFCheckpointWriter, load_hf_state_dict
from megatron_gspo.model.hf.stream import (
    Bucket,
    iter_buckets,
    unflatten_bucket,
)


def named(sizes, dtype=torch.float32):
    return [(f"t{i}", torch.arange(n, dtype=dtype).reshape(-1) + i) for i, n in enumerate(sizes)]


def test_buckets_respect_the_size_and_mark_the_last():
    tensors = named([10, 10, 10, 30, 5])  # 40, 40, 40, 120, 20 bytes
    buckets = list(iter_buckets(tensors, bucket_bytes=80))
    assert [b.names for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]  # t3 (120 B) alone
    assert [b.last for b in buckets] == [False, False, False, True]
    assert [b.nbytes for b in buckets] == [80, 40, 120, 20]
    with pytest.raises(ValueError, match="positive"):
        list(iter_buckets(tensors, bucket_bytes=0))
    # A 3-element bf16 tensor (6 bytes) would leave the next fp32 tensor at an unaligned offset.
    mixed = [("h", torch.ones(3, dtype=torch.bfloat16)), ("f", torch.ones(2)), ("g", torch.ones(2))]
    assert [b.names for b in iter_buckets(mixed, bucket_bytes=1000)] == [["h"], ["f", "g"]]


def test_flatten_round_trips_mixed_dtypes_bit_exactly():
    bucket = Bucket(index=0)
    bucket.add("a", torch.randn(3, 5, dtype=torch.float32))
    bucket.add("b", torch.randn(7, dtype=torch.bfloat16))
    bucket.add("c", torch.randn(2, 2, dtype=torch.float32).t())  # non-contiguous
    bucket.add("d", torch.randn(4, dtype=torch.float16))
    flat = bucket.flatten()
    assert flat.dtype == torch.uint8 and flat.numel() == 60 + 14 + 16 + 8
    # bf16 (14 bytes) leaves the fp32 tensor after it unaligned, as SGLang's receiver would refuse.
    with pytest.raises(ValueError, match="not aligned"):
        unflatten_bucket(flat, bucket.names, bucket.dtypes, bucket.shapes)
    aligned = Bucket(index=0)
    for name, tensor in zip(bucket.names, bucket.tensors):
        if name != "b":
            aligned.add(name, tensor)
    out = unflatten_bucket(aligned.flatten(), aligned.names, aligned.dtypes, aligned.shapes)
    for name, tensor in zip(aligned.names, aligned.tensors):
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor)
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        unflatten_bucket(aligned.flatten(), aligned.names, ["float99", *aligned.dtypes[1:]], aligned.shapes)
    with pytest.raises(ValueError, match="describe"):
        unflatten_bucket(aligned.flatten()[:-4], aligned.names, aligned.dtypes, aligned.shapes)


def test_writer_streams_shards_and_an_abort_keeps_the_old_checkpoint(tmp_path):
    cfg = tiny(vocab_size=32)
    out = tmp_path / "ckpt"
    tensors = named([100] * 7)  # 400 bytes each
    with HFCheckpointWriter(out, cfg, max_shard_bytes=1000) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.finish()
    assert writer.largest_shard_bytes == 800  # never more than one shard held
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)
    ]
    loaded = load_hf_state_dict(out)
    assert all(torch.equal(loaded[n], t) for n, t in tensors)

    with pytest.raises(RuntimeError, match="stream broke"):
        with HFCheckpointWriter(out, cfg, max_shard_bytes=1000) as writer:
            writer.add("other", torch.zeros(300))
            writer.add("other2", torch.zeros(300))  # a shard was written to the temp dir
            raise RuntimeError("stream broke")
    assert load_hf_state_dict(out).keys() == loaded.keys()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the temp dir is gone
