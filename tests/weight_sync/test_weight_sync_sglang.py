"""The trainer's distributed and tensor weight syncs against SGLang's own receiving code.

Two servers of TP 2 (`sglang_receiver_shim.py`, in the SGLang environment that
`launch/setup_sglang.sh` makes) join the weight-update group at rank offsets 1 and 3
through SGLang's `WeightUpdater`, receive every flattened bucket through SGLang's
`FlattenedTensorBucket` inside SGLang's begin/end session, and hand the reconstructed tensors to
their model's `load_weights`. Each of the four receiving ranks must get the trainer's HF-named
weights bit for bit, in every dtype the sender sends: fp32, bf16 and blockwise FP8 with fp32 scales.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.model.fp8.blockwise import quantize_stream
from megatron_gspo.model.hf.stream import run_on_hf_stream
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.weight_sync.sync import WeightSync
from megatron_gspo.weight_sync.update_group import destroy_update_group

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
SHIM = Path(__file__).with_name("sglang_receiver_shim.py")
CFG = tiny(vocab_size=96, init_std=0.2)
BUCKET_MB = 0.01  # ~10 KiB: many buckets, and the embedding (96 x 64 fp32 = 24 KiB) alone in one
TP_SIZE = 2
SERVERS = 2
DTYPES = {"fp32": {torch.float32}, "fp8": {torch.float8_e4m3fn, torch.float32}, "bf16": {torch.bfloat16}}
START_TIMEOUT_S = 300  # imports on a loaded 2-core box


def sglang_receiver_missing() -> str | None:
    """Why SGLang's receiver code cannot run here (None: it can)."""
    if not SGLANG_PYTHON.exists():
        return f"{SGLANG_PYTHON} missing: run launch/setup_sglang.sh"
    probe = (
        "from sglang.srt.utils.common import init_custom_process_group\n"
        "from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket\n"
    )
    done = subprocess.run([str(SGLANG_PYTHON), "-c", probe], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"SGLang's receiver modules do not import in {SGLANG_PYTHON}: {done.stderr.strip()[-300:]}"
    return None


class ShimServer:
    """One `sglang_receiver_shim.py` process (its TP ranks are its children); stops when its stdin closes."""

    def __init__(self, directory: Path):
        self.dump_dir, self.port_file = directory / "dump", directory / "port"
        self.log = (directory / "log").open("w")
        self.proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(SHIM), "--tp-size", str(TP_SIZE), "--dump-dir", str(self.dump_dir)]
            + ["--port-file", str(self.port_file)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its TP ranks in its process group: stopped together
        )

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = Path(self.log.name)
                raise RuntimeError(f"SGLang receiver shim did not start; {log}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return f"http://127.0.0.1:{self.port_file.read_text()}"

    def received(self, tp_rank: int) -> dict:
        return torch.load(self.dump_dir / f"tp{tp_rank}.pt", weights_only=True)

    def stop(self) -> None:
        self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError):  # TP ranks stuck in a collective, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    missing = sglang_receiver_missing()
    if missing is not None:
        pytest.skip(missing)
    servers = [ShimServer(tmp_path_factory.mktemp(f"sglang{i}")) for i in range(SERVERS)]
    try:
        client = SGLangClient([s.url() for s in servers], max_retries=0)
        with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=5) as (model, _):
            yield model, client, servers, tmp_path_factory.mktemp("export")
        client.close()
    finally:
        for server in servers:
            server.stop()


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def make_sync(model, export_dir, **overrides) -> WeightSync:
    cfg = {"bucket_mb": BUCKET_MB, "timeout_s": 120, "retries": 0, "backend": "gloo", **overrides}
    return WeightSync(WeightSyncConfig(**cfg), model, CFG, export_dir)


def test_a_restarted_trainer_joins_servers_still_holding_its_old_group(setup):
    """A trainer that died without leaving its group, restarted: SGLang refuses a group name it
    holds ("already been created"), so the new trainer must not reuse its predecessor's names
    (the old code did, and waited out `timeout_s` before a retry under the next name)."""
    model, client, _, export_dir = setup
    crashed = make_sync(model, export_dir)
    crashed.sync(client, 1)
    destroy_update_group(crashed._group.group)  # gone on the trainer's side only, as in a crash
    restarted = make_sync(model, export_dir, retries=1, timeout_s=20)
    stats = restarted.sync(client, 2)
    restarted.close(client)
    assert stats.attempts == 1
    assert [i["weight_version"] for i in client.model_info()] == ["2"] * SERVERS


def test_a_restarted_trainer_closes_the_session_its_predecessor_left_open(setup):
    """SGLang refuses /begin_weight_update while a session is open ("already open"); a trainer
    that died mid-sync leaves one. The failed attempt closes it, so the retry goes through (the
    old code closed a session only once its own begin had succeeded: every retry was refused)."""
    model, client, _, export_dir = setup
    client.begin_weight_update()  # what the trainer that died mid-sync had opened
    sync = make_sync(model, export_dir, retries=1)
    stats = sync.sync(client, 6)
    sync.close(client)
    assert stats.attempts == 2
    assert [i["weight_version"] for i in client.model_info()] == ["6"] * SERVERS


def test_sglang_opens_the_trainer_tensor_handles_bit_for_bit(setup):
    """`weight_sync.method: tensor`: every TP rank opens its own entry with SGLang's
    `MultiprocessingSerializer` (its `SafeUnpickler`), reads the shared-memory handles the trainer
    wrote and rebuilds the tensors through `FlattenedTensorBucket`, inside SGLang's session."""
    model, client, servers, export_dir = setup
    stats = make_sync(model, export_dir, method="tensor", bucket_mb=0.05).sync(client, 7)
    expected = run_on_hf_stream(model, CFG, lambda stream: {name: t.clone() for name, t in stream})
    assert stats.buckets > 3
    for server in servers:
        for tp_rank in range(TP_SIZE):
            got = server.received(tp_rank)
            assert got["weight_version"] == "7" and got["loads"] == stats.buckets
            assert sorted(got["tensors"]) == sorted(expected)
            for name, want in expected.items():
                assert torch.equal(raw(got["tensors"][name]), raw(want)), (
                    f"{name} differs on a receiving rank"
                )
    assert [i["weight_version"] for i in client.model_info()] == ["7"] * SERVERS


@pytest.mark.parametrize("precision", ["fp32", "fp8", "bf16"])  # bf16 last: it casts the model
def test_sglang_receives_the_trainer_weights_bit_for_bit(setup, precision):
    model, client, servers, export_dir = setup
    if precision == "bf16":
        model.to(torch.bfloat16)
    quantization = "fp8" if precision == "fp8" else "none"
    sync = make_sync(model, export_dir)
    sync.quantization = quantization
    version = {"fp32": 3, "fp8": 4, "bf16": 5}[precision]
    stats = sync.sync(client, version)
    group_name = sync._group.name
    sync.close(client)  # SGLang's destroy_weights_update_group on every rank

    def hf_weights(stream):
        stream = quantize_stream(stream) if quantization == "fp8" else stream
        return {name: tensor.clone() for name, tensor in stream}

    expected = run_on_hf_stream(model, CFG, hf_weights)
    assert {t.dtype for t in expected.values()} == DTYPES[precision]
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert largest > BUCKET_MB * 2**20 and stats.buckets > 3

    group_ranks = []
    for server in servers:
        for tp_rank in range(TP_SIZE):
            got = server.received(tp_rank)
            assert got["weight_version"] == str(version)
            assert got["loads"] == stats.buckets  # one load_weights per bucket received
            group_ranks.append(got["update_group_ranks"][group_name])
            tensors = got["tensors"]
            assert sorted(tensors) == sorted(expected)
            for name, want in expected.items():
                have = tensors[name]
                assert have.dtype == want.dtype and have.shape == want.shape, name
                assert torch.equal(raw(have), raw(want)), f"{name} differs on a receiving rank"
    assert sorted(group_ranks) == [1, 2, 3, 4]  # rank_offset + tp_rank, beside the trainer's 0
    assert [i["weight_version"] for i in client.model_info()] == [str(version)] * SERVERS
