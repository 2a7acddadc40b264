"""Servers the run cannot use are refused by name at start-up: SGLang launched with dp_size > 1.

The embedded server launched with `--dp-size 2` reports SGLang's `dp_size: 2` in
/get_server_info and refuses the weight-update group the way SGLang does (its tokenizer
manager asserts dp_size == 1: HTTP 500 "dp_size must be 1 for init parameter update group").

The served weights are read where SGLang keeps them live: /get_server_info serialises the launch
arguments (its `weight_version` is the launch value for good), /model_info has what weight updates
set since. A server launched at version "0" and synced to 100 by an earlier run is out of date
for a trainer at 0.
"""

import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from warm_python import python

from megatron_gspo.config import RolloutConfig, WeightSyncConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.server_checks import (
    check_servers,
    refuse_unfit_servers,
    refuse_unreachable_endpoints,
    served_weights,
)
from megatron_gspo.weight_sync.sync import WeightSync

CFG = tiny(vocab_size=80)


@pytest.fixture(scope="module")
def dp2_server(tmp_path_factory):
    checkpoint = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", CFG)
    with launch_embedded_server(checkpoint, extra_args=("--dp-size", "2")) as server:
        with SGLangClient([server.url], max_retries=0) as client:
            yield server, client


def test_a_dp2_server_answers_as_sglang_does(dp2_server):
    server, client = dp2_server
    assert client.server_info()[0]["dp_size"] == 2
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    answer = httpx.post(f"{server.url}/init_weights_update_group", json=body, timeout=30)
    assert answer.status_code == 500
    assert answer.json()["message"] == "dp_size must be 1 for init parameter update group"


@pytest.mark.parametrize("method", ["distributed", "tensor"])
def test_start_up_refuses_a_dp2_server_for_group_and_tensor_sync(dp2_server, method):
    _, client = dp2_server
    with pytest.raises(ConfigError) as err:
        refuse_unfit_servers(client.urls, client.server_info(), sync_method=method, routed_experts=False)
    message = str(err.value)
    assert client.urls[0] in message and "dp_size=2" in message
    assert "one server per DP replica" in message and "weight_sync.method=disk" in message


def test_disk_sync_takes_a_dp2_server(dp2_server):
    _, client = dp2_server
    refuse_unfit_servers(client.urls, client.server_info(), sync_method="disk", routed_experts=True)


def test_start_up_checks_ask_each_server_once(dp2_server):
    """One /get_server_info per server serves the refusal, one /model_info the out-of-date check."""
    server, client = dp2_server
    asked = []
    hooks = client._http.event_hooks["request"]
    hooks.append(lambda request: asked.append(request.url.path))
    try:
        stale = check_servers(client, sync_method="disk", routed_experts=True, version=0, expected_path=None)
        assert asked == ["/get_server_info", "/model_info"]
        assert stale == [f"{server.url} serves weight_version 'default', the trainer's is 0: syncing"]
        with pytest.raises(ConfigError, match=r"dp_size=2"):
            check_servers(client, sync_method="tensor", routed_experts=False, version=0, expected_path=None)
        assert asked == ["/get_server_info", "/model_info", "/get_server_info"]  # refused before
    finally:
        hooks.pop()


def test_served_weights_come_from_the_model_info():
    urls = ["http://a:1", "http://b:2"]
    infos = [{"weight_version": 3, "model_path": "/m"}, {"model_path": "/m"}]
    assert served_weights(urls, infos) == [("http://a:1", "3", "/m"), ("http://b:2", "unknown", "/m")]


def test_start_up_syncs_a_server_whose_live_version_is_not_its_launch_version(tmp_path):
    """Launched at "0", synced to 100 since: /get_server_info still says "0" (as SGLang's), so
    only the live /model_info tells a trainer at 0 that the server is out of date."""
    checkpoint = make_tiny_hf_checkpoint(tmp_path / "ckpt", CFG)
    with (
        launch_embedded_server(checkpoint, extra_args=("--weight-version", "0")) as server,
        SGLangClient([server.url], max_retries=0) as client,
    ):
        body = {"model_path": str(checkpoint), "weight_version": "100"}  # an earlier run's sync
        assert httpx.post(f"{server.url}/update_weights_from_disk", json=body, timeout=60).json()["success"]
        assert client.server_info()[0]["weight_version"] == "0"  # the launch argument, for good
        assert client.model_info()[0]["weight_version"] == "100"
        stale = check_servers(
            client, sync_method="tensor", routed_experts=True, version=0, expected_path=checkpoint
        )
        # what the trainer logs ("start-up: ...") before it syncs, ahead of the first rollout
        assert stale == [f"{server.url} serves weight_version '100', the trainer's is 0: syncing"]


def test_the_sync_itself_refuses_a_dp2_server_without_retrying(dp2_server, tmp_path):
    """Without the start-up check, the group join names the deployment, not a 500 after retries."""
    _, client = dp2_server
    init_distributed(ParallelConfig(), seed=0)
    try:
        model = build_model(CFG, ParallelConfig()).eval()
        sync = WeightSync(WeightSyncConfig(retries=3, timeout_s=30), model, CFG, tmp_path)
        with pytest.raises(ConfigError, match=r"dp_size=2: SGLang refuses weight_sync.method=distributed"):
            sync.sync(client, 1)
    finally:
        destroy_distributed()


def test_dp_attention_servers_take_tensor_updates_and_routed_experts_are_checked():
    urls = ["http://a:1", "http://b:2"]
    dp_attention = {"dp_size": 4, "enable_dp_attention": True, "enable_return_routed_experts": True}
    refuse_unfit_servers(urls, [dp_attention, {}], sync_method="tensor", routed_experts=True)
    with pytest.raises(ConfigError, match=r"http://a:1 was launched with dp_size=4"):
        refuse_unfit_servers(urls, [dp_attention, {}], sync_method="distributed", routed_experts=False)
    without = {"dp_size": 1, "enable_return_routed_experts": False}
    with pytest.raises(ConfigError, match=r"http://b:2 was launched without --enable-return-routed-experts"):
        refuse_unfit_servers(urls, [{}, without], sync_method="distributed", routed_experts=True)
    refuse_unfit_servers(urls, [{}, without], sync_method="distributed", routed_experts=False)


@pytest.mark.parametrize("method", ["distributed", "tensor"])
def test_a_pipeline_parallel_server_is_refused_for_group_and_tensor_sync(method):
    # SGLang joins the group as rank_offset + tp_rank: two stages would claim one rank and hang.
    urls = ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match=r"http://b:2 was launched with pp_size=2.*weight_sync.method=disk"):
        refuse_unfit_servers(urls, [{"pp_size": 1}, {"pp_size": 2}], sync_method=method, routed_experts=False)
    refuse_unfit_servers(urls, [{"pp_size": 1}, {"pp_size": 2}], sync_method="disk", routed_experts=False)


def test_a_colocated_run_refuses_servers_without_the_memory_saver():
    urls = ["http://a:1", "http://b:2"]
    saver, plain = {"enable_memory_saver": True}, {"enable_memory_saver": False}
    refuse_unfit_servers(urls, [saver, saver], sync_method="tensor", routed_experts=False, memory_saver=True)
    refuse_unfit_servers(urls, [plain, {}], sync_method="tensor", routed_experts=False)  # disaggregated
    for other in (plain, {}):  # SGLang without the flag would answer 200 and free nothing
        with pytest.raises(ConfigError, match=r"http://b:2 was launched without --enable-memory-saver"):
            refuse_unfit_servers(
                urls, [saver, other], sync_method="tensor", routed_experts=False, memory_saver=True
            )


def test_sglangs_cpu_engine_passes_without_the_memory_saver_saying_nothing_is_freed(caplog):
    """torch_memory_saver needs CUDA: no SGLang server on a CPU can have it, so a colocated run there
    goes on with a warning. The embedded server has a saver of its own on the CPU: still refused."""
    urls = ["http://a:1"]
    sglang_cpu = {"enable_memory_saver": False, "device": "cpu", "version": "0.5.23"}
    refuse_unfit_servers(urls, [sglang_cpu], sync_method="tensor", routed_experts=False, memory_saver=True)
    assert "http://a:1 runs on the CPU without the memory saver (SGLang's needs CUDA)" in caplog.text
    for refused in ({**sglang_cpu, "device": "cuda"}, {**sglang_cpu, "version": "embedded"}):
        with pytest.raises(ConfigError, match=r"http://a:1 was launched without --enable-memory-saver"):
            refuse_unfit_servers(
                urls, [refused], sync_method="tensor", routed_experts=False, memory_saver=True
            )


def train_tiny(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """`megatron-gspo train` of the tiny config for one step with `overrides`, as a user runs it."""
    repo = Path(__file__).resolve().parents[2]
    config = str(repo / "configs/tiny_moe_cpu.yaml")
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", config, "trainer.steps=1"]
    cmd += ["logging.progress_bar=false", f"trainer.run_dir={tmp_path}/run", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=repo)


def test_train_refuses_a_dp2_server_at_start_up_in_one_line(dp2_server, tmp_path):
    """`megatron-gspo train` against a dp_size 2 server: exit 2 and the fix, before any sync or step."""
    server, _ = dp2_server
    no_sft = ["sft.steps=0", "sft.target_accuracy=null"]
    done = train_tiny(tmp_path, f"rollout.server_urls=[{server.url}]", *no_sft)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"rollout server {server.url} was launched with dp_size=2" in done.stderr


def _closed_port_url() -> str:
    """A local URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("field", ["router_url", "server_urls"])
def test_an_unreachable_endpoint_is_refused_by_name(dp2_server, field):
    server, _ = dp2_server
    dead = _closed_port_url()
    value = dead if field == "router_url" else [server.url, dead]
    with pytest.raises(ConfigError, match=f"rollout.{field}.*{dead} is unreachable") as refused:
        refuse_unreachable_endpoints(RolloutConfig(**{field: value}, server_start_timeout_s=0.2), poll_s=0.05)
    assert "\n" not in str(refused.value)
    refuse_unreachable_endpoints(RolloutConfig(server_urls=[server.url]))  # a live one answers


@pytest.mark.slow
def test_train_refuses_an_unreachable_router_before_sft(tmp_path):
    """Found at start-up in one line, not after the whole SFT phase (which was then thrown away)."""
    dead = _closed_port_url()
    done = train_tiny(
        tmp_path, f"rollout.router_url={dead}", "rollout.server_start_timeout_s=1", "sft.steps=20"
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "SFT step" not in done.stdout + done.stderr
    assert f"config error: rollout.router_url={dead} is unreachable" in done.stderr
