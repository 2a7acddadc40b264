"""Weight sync into a real embedded server: memory on the sending rank and time, by method.

    python benchmarks/bench_weight_sync.py [--quick] [--bucket-mb 64]

A MoE-shaped policy of ~230M parameters (4 layers, 24 experts of 1024x512, vocab 32k; fp32)
in a world of one, and an embedded server started from its export. For each method the
weights are perturbed, then synced as the next version (the server checks every tensor and
applies them all at once), twice per method, the second timed (an RL run's steady state):
- distributed: buckets broadcast over a gloo weight-update group;
- disk: an HF checkpoint in /dev/shm (or a temp dir), then `/update_weights_from_disk`.
Reported, measured in this one run: peak extra resident memory of the sending process during
the sync (sampled every millisecond from /proc/self/statm) / bucket size (goal <= 2.5), and
sync time distributed / disk (goal <= 0.5); the distributed sync is measured again with
rollout.quantization=fp8 (bytes sent: FP8 values + block scales). Then, on paper, the bytes and the seconds at
25 GB/s for Qwen3-30B-A3B and Qwen3-235B-A22B in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import MoEModelConfig, qwen3_30b_a3b, qwen3_235b_a22b
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.convert import name_table
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.plan import sync_bytes
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.weight_sync.sync import WeightSync

SYNCS = (
    ("distributed", "distributed", "none"),
    ("distributed_fp8", "distributed", "fp8"),
    ("disk", "disk", "none"),
)
"""(label, weight_sync.method, rollout.quantization) of each measured sync."""
LINK_GBPS = 25.0  # bytes/s of one NCCL broadcast path, GB/s (NVLink/IB class)


def model_config(quick: bool) -> MoEModelConfig:
    if quick:
        return MoEModelConfig(
            vocab_size=4096, hidden_size=256, num_layers=2, num_experts=8, moe_ffn_hidden_size=256
        )
    return MoEModelConfig(
        vocab_size=32_000,
        hidden_size=1024,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=2,
        head_dim=128,
        num_experts=24,
        moe_topk=4,
        moe_ffn_hidden_size=512,
    )


def parameter_bytes(cfg: MoEModelConfig, bytes_per_param: int) -> int:
    """Bytes of every weight the sync sends (from the conversion's name table)."""
    return sum(torch.Size(s).numel() for t in name_table(cfg) for s in t.hf_shapes) * bytes_per_param


class PeakRSS:
    """Highest resident set size of this process while inside the `with` block (1 ms sampling)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def measure(quick: bool = False, bucket_mb: float = 64.0) -> dict:
    """Sync the bench model with each method; memory and time figures plus the paper estimates."""
    cfg = model_config(quick)
    bucket_mb = 4.0 if quick else bucket_mb
    init_distributed(ParallelConfig(), seed=0)
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-", dir=shm))
    results: dict = {"parameters": parameter_bytes(cfg, 1), "bucket_mb": bucket_mb, "methods": {}}
    try:
        model = build_model(cfg, ParallelConfig()).eval()
        start_dir = export_hf_checkpoint(model, work / "start", cfg)
        with launch_embedded_server(start_dir, timeout=600) as server, SGLangClient([server.url]) as client:
            version = 0
            for label, method, quantization in SYNCS:
                sync = WeightSync(
                    WeightSyncConfig(method=method, bucket_mb=bucket_mb, timeout_s=600),
                    model,
                    cfg,
                    work / "sync",
                    quantization=quantization,
                )
                for _ in range(2):  # the first sync warms up (group, allocations); the second is timed
                    with torch.no_grad():
                        for param in model.parameters():
                            param.mul_(0.99)
                    version += 1
                    with PeakRSS() as rss:
                        start = time.perf_counter()
                        stats = sync.sync(client, version)
                        seconds = time.perf_counter() - start
                sync.close(client)
                results["methods"][label] = {
                    "seconds": seconds,
                    "peak_extra_bytes": rss.extra,
                    "bytes": stats.bytes,
                    "buckets": stats.buckets,
                }
    finally:
        destroy_distributed()
        shutil.rmtree(work, ignore_errors=True)
    dist_, disk = results["methods"]["distributed"], results["methods"]["disk"]
    results["memory_over_bucket"] = dist_["peak_extra_bytes"] / (bucket_mb * 2**20)
    results["time_distributed_over_disk"] = dist_["seconds"] / disk["seconds"]
    results["paper"] = {
        name: {
            "bf16_bytes": (b := parameter_bytes(fn(), 2)),
            "seconds_at_25GBps": b / (LINK_GBPS * 1e9),
            "fp8_bytes": sync_bytes(fn(), 2, "fp8"),
        }
        for name, fn in (("qwen3_30b_a3b", qwen3_30b_a3b), ("qwen3_235b_a22b", qwen3_235b_a22b))
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, seconds")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args()
    r = measure(args.quick, args.bucket_mb)
    print(f"model: {r['parameters'] / 1e6:.0f}M parameters (fp32), bucket {r['bucket_mb']:g} MiB")
    fp8 = r["methods"]["distributed_fp8"]["bytes"] / r["methods"]["distributed"]["bytes"]
    print(f"fp8 / unquantised bytes sent: {fp8:.3f} (fp8 values + float32 block scales vs fp32)")
    for method, m in r["methods"].items():
        print(
            f"  {method:16s} {m['seconds']:7.2f} s  peak extra RSS {m['peak_extra_bytes'] / 2**20:8.1f} MiB  "
            f"{m['bytes'] / 2**20:8.1f} MiB in {m['buckets']} bucket(s)"
        )
    print(f"peak extra memory / bucket size: {r['memory_over_bucket']:.2f} (goal <= 2.5)")
    print(f"sync time distributed / disk:     {r['time_distributed_over_disk']:.2f} (goal <= 0.5)")
    for name, p in r["paper"].items():
        print(
            f"on paper, {name}: {p['bf16_bytes'] / 1e9:.1f} GB bf16 -> "
            f"{p['seconds_at_25GBps']:.1f} s at 25 GB/s; with rollout.quantization=fp8 "
            f"{p['fp8_bytes'] / 1e9:.1f} GB ({p['fp8_bytes'] / p['bf16_bytes']:.2f}x)"
        )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
