"""Weight sync into a fleet behind SGLang's real router when a worker dies (a world of one).

A worker lost mid-sync (killed with SIGKILL as the second bucket goes out): the failed attempt
removes it from the router and from the client, and the retry syncs the rest while at least
rollout.min_workers remain; below, the sync stops with FleetTooSmallError and the survivors keep
their old weights. A worker lost between syncs is removed before the next one, whose
weight-update group is built from the workers that remain.

A worker lost in the middle of a distributed sync's broadcast can hold the other in that collective
(SGLang has no way to abort a receive) until the survivor's own group timeout: a survivor that
comes out within weight_sync.release_timeout_s is synced by the retry; one still held then is set
aside, and synced and re-added once it answers again. Every wait is seconds, not the group's
timeout.

With rollout.update_mode pause or partial the workers are paused when the sync probes them: their
/health, as SGLang's, would wait out its health timeout and answer 503, so the probe is
/model_info, which a paused worker answers at once and which generates nothing: every worker
is kept.
"""

import contextlib
import time
import types

import httpx
import pytest
from warm_python import kill_server
from world_one import world_one_policy

from megatron_gspo.config import WeightSyncConfig
from megatron_gspo.model.config import tiny
from megatron_gspo.rollout.client import SGLangClient
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.rollout.router_launch import launch_router, router_available
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.rollout.server_checks import served_weights
from megatron_gspo.training.ahead.inflight_updates import InFlightUpdates
from megatron_gspo.weight_sync.sync import WeightSync

pytestmark = [
    pytest.mark.skipif(router_available() is not None, reason=str(router_available())),
    pytest.mark.slow,  # two servers and a router per test
]

CFG = tiny(vocab_size=80, init_std=0.2)


@pytest.fixture(scope="module")
def model_and_checkpoint(tmp_path_factory):
    with world_one_policy(tmp_path_factory.mktemp("hf"), CFG, seed=3) as loaded:
        yield loaded


@pytest.fixture
def fleet(model_and_checkpoint):
    """Two workers at weight_version 0 behind the router."""
    _, checkpoint = model_and_checkpoint
    with (
        launch_embedded_server(checkpoint, extra_args=["--weight-version", "0"]) as a,
        launch_embedded_server(checkpoint, extra_args=["--weight-version", "0"]) as b,
        launch_router([a.url, b.url]) as router,
    ):
        yield a, b, router


def kill_at_second_bucket(client: SGLangClient, server) -> None:
    """Kill `server` just before the second bucket is sent (the first went to every worker)."""
    send = client.update_weights_from_tensor
    calls = []

    def send_and_kill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            kill_server(server)
        return send(*args, **kwargs)

    client.update_weights_from_tensor = send_and_kill


def kill_as_second_broadcast_starts(client: SGLangClient, server) -> None:
    """Kill `server` once every worker waits in the second bucket's broadcast, before rank 0 sends it."""
    announce = client.update_weights_from_distributed
    calls = []

    def announce_and_kill(*args, **kwargs):
        answers = announce(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            time.sleep(0.5)  # the announcements reach the workers: both enter the collective
            kill_server(server)
        return answers

    client.update_weights_from_distributed = announce_and_kill


def weight_version(server) -> str:
    """What `server` serves (answered even while it waits in a broadcast)."""
    return httpx.get(f"{server.url}/model_info", timeout=10).json()["weight_version"]


@contextlib.contextmanager
def fleet_held_on_loss(checkpoint, group_timeout_s: float):
    """(survivor, lost, router): two workers at version 0; their update groups time out in `group_timeout_s`.

    The lost one has group rank 1 (the first URL) and the survivor rank 2: gloo's root sends a
    broadcast to its ranks in order, so once rank 1 is gone the root fails before sending to
    rank 2, which stays in the collective until its group times out.
    """
    args = ["--weight-version", "0", "--weight-update-timeout-s", str(group_timeout_s)]
    with (
        launch_embedded_server(checkpoint, extra_args=args) as one,
        launch_embedded_server(checkpoint, extra_args=args) as two,
        launch_router([one.url, two.url]) as router,
    ):
        lost, survivor = sorted([one, two], key=lambda server: server.url)
        yield survivor, lost, router


def released_by_its_timeout(server, group_timeout_s: float, wait_s: float = 0.0) -> bool:
    """Whether `server`'s receive in the weight-update group has ended by its own group timeout.

    Read from its log, which reaches the test through a pipe and may trail its HTTP answers:
    `wait_s` polls for the line that long (a hang guard, not a measurement).
    """
    line = f"Timed out waiting {int(group_timeout_s * 1000)}ms for recv"
    deadline = time.monotonic() + wait_s
    while line not in server.output and time.monotonic() < deadline:
        time.sleep(0.1)
    return line in server.output


def listed(router) -> list[str]:
    return [w["url"] for w in httpx.get(f"{router.url}/workers").json()["workers"]]


def make_sync(model, tmp_path, method: str) -> WeightSync:
    return WeightSync(
        WeightSyncConfig(method=method, bucket_mb=0.05, timeout_s=60, retries=1), model, CFG, tmp_path
    )


@pytest.mark.parametrize("min_workers", [1, 2])
def test_worker_lost_mid_sync(model_and_checkpoint, fleet, tmp_path, min_workers):
    model, _ = model_and_checkpoint
    a, b, router = fleet
    with SGLangClient([], router_url=router.url, max_retries=0, min_workers=min_workers) as client:
        sync = make_sync(model, tmp_path, "tensor")
        kill_at_second_bucket(client, b)
        if min_workers == 1:
            stats = sync.sync(client, 5)
            assert stats.attempts == 2 and stats.buckets > 2
            assert stats.metrics()["fleet/workers"] == 1 and stats.metrics()["fleet/removed"] == 1
            assert served_weights(client.urls, client.model_info())[0][:2] == (
                a.url,
                "5",
            )  # the survivor has the new weights
        else:
            with pytest.raises(FleetTooSmallError, match=rf"1 healthy .*min_workers=2 \(lost: {b.url}"):
                sync.sync(client, 5)
            assert served_weights(client.urls, client.model_info())[0][:2] == (
                a.url,
                "0",
            )  # nothing half-applied
        assert client.urls == [a.url] and listed(router) == [a.url]  # out of the router too


def test_worker_lost_between_syncs_leaves_the_next_group_and_rejoins_synced(
    model_and_checkpoint, fleet, tmp_path
):
    model, checkpoint = model_and_checkpoint
    a, b, router = fleet
    with SGLangClient([], router_url=router.url, max_retries=0) as client:
        sync = make_sync(model, tmp_path, "distributed")
        assert sync.sync(client, 1).metrics()["fleet/workers"] == 2
        assert sync._group.urls == sorted([a.url, b.url])
        kill_server(b)
        stats = sync.sync(client, 2)
        assert sync._group.urls == [a.url] and sync._group.name.endswith("_2")  # a new group, of one worker
        sync.close(client)
        assert stats.attempts == 1 and stats.metrics()["fleet/removed"] == 1
        assert served_weights(client.urls, client.model_info())[0][:2] == (a.url, "2") and listed(router) == [
            a.url
        ]
        # The worker comes back (restarted on its address, at its launch version): synced, then re-added.
        port = int(b.url.rsplit(":", 1)[1])
        with launch_embedded_server(checkpoint, port=port, extra_args=["--weight-version", "0"]) as again:
            assert again.url == b.url and listed(router) == [a.url]  # not routed to before its sync
            stats = sync.sync(client, 3)
            assert sync._group.urls == sorted([a.url, b.url])
            sync.close(client)
            assert stats.metrics()["fleet/rejoined"] == 1 and stats.metrics()["fleet/workers"] == 2
            assert sorted(listed(router)) == sorted([a.url, b.url])
            assert [v for _, v, _ in served_weights(client.urls, client.model_info())] == ["3", "3"]


@pytest.mark.parametrize("min_workers", [1, 2])
def test_worker_lost_mid_broadcast_the_survivor_is_released_and_synced(
    model_and_checkpoint, tmp_path, min_workers
):
    model, checkpoint = model_and_checkpoint
    with (
        fleet_held_on_loss(checkpoint, group_timeout_s=4) as (a, b, router),
        SGLangClient([], router_url=router.url, max_retries=0, min_workers=min_workers) as client,
    ):
        sync = WeightSync(
            WeightSyncConfig(bucket_mb=0.05, timeout_s=60, release_timeout_s=30, retries=1),
            model,
            CFG,
            tmp_path,
        )
        kill_as_second_broadcast_starts(client, b)
        if min_workers == 1:
            stats = sync.sync(client, 5)
            assert stats.attempts == 2 and stats.buckets > 2
            assert stats.metrics()["fleet/workers"] == 1 and stats.metrics()["fleet/removed"] == 1
            assert weight_version(a) == "5"  # the survivor has the new weights
            assert sync.sync(client, 6).attempts == 1 and weight_version(a) == "6"  # and the run goes on
            sync.close(client)
        else:
            with pytest.raises(FleetTooSmallError, match=rf"1 healthy .*min_workers=2 \(lost: {b.url}"):
                sync.sync(client, 5)
            assert weight_version(a) == "0"  # nothing half-applied
        assert released_by_its_timeout(a, 4, wait_s=60)  # held in the collective, came out, was synced
        assert client.urls == [a.url] and listed(router) == [a.url]


def test_worker_held_in_a_broadcast_is_set_aside_then_synced_and_readmitted(model_and_checkpoint, tmp_path):
    model, checkpoint = model_and_checkpoint
    with (
        fleet_held_on_loss(checkpoint, group_timeout_s=15) as (a, b, router),
        SGLangClient([], router_url=router.url, max_retries=0, health_timeout_s=2) as client,
    ):
        sync = WeightSync(
            WeightSyncConfig(bucket_mb=0.05, timeout_s=60, release_timeout_s=2, retries=1),
            model,
            CFG,
            tmp_path,
        )
        kill_as_second_broadcast_starts(client, b)
        with pytest.raises(
            FleetTooSmallError, match=rf"0 healthy .*\(lost: {b.url}: .*; held in a broadcast: {a.url}\)"
        ):
            sync.sync(client, 5)
        assert not released_by_its_timeout(a, 15)  # given up on a while still in its collective
        assert weight_version(a) == "0" and client.urls == [] and listed(router) == []
        # Once its collective timed out, a answers again: the next sync takes it back, then the router.
        assert released_by_its_timeout(a, 15, wait_s=120)
        stats = sync.sync(client, 6)
        sync.close(client)
        assert stats.attempts == 1 and stats.metrics()["fleet/rejoined"] == 1
        assert weight_version(a) == "6" and listed(router) == [a.url]


HEALTH_WAIT_S = 3
"""The workers' SGLANG_HEALTH_CHECK_TIMEOUT: a paused one's /health answers 503 after it (SGLang: 20 s)."""


@pytest.fixture(scope="module")
def sglang_health_fleet(model_and_checkpoint):
    """Two workers at weight_version 0 behind the router, /health as SGLang's (a paused one: 503).

    The router's own periodic /health probes are an hour apart, so any token the workers
    generate during the test is the client's doing. Shared by the tests below (each syncs its
    own version).
    """
    _, checkpoint = model_and_checkpoint
    args, env = ["--weight-version", "0"], {"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_WAIT_S)}
    with (
        launch_embedded_server(checkpoint, extra_args=args, env=env) as a,
        launch_embedded_server(checkpoint, extra_args=args, env=env) as b,
        launch_router([a.url, b.url], extra_args=["--health-check-interval-secs", "3600"]) as router,
    ):
        yield a, b, router


@pytest.mark.parametrize("mode, version", [("pause", 1), ("partial", 2)])
def test_a_sync_with_the_workers_paused_keeps_every_worker(
    model_and_checkpoint, sglang_health_fleet, tmp_path, mode, version
):
    model, _ = model_and_checkpoint
    a, b, router = sglang_health_fleet
    with SGLangClient([], router_url=router.url, max_retries=0) as client:
        tokens = [a.generated_tokens(), b.generated_tokens()]
        assert client.remove_unhealthy_workers() == []  # a probe between syncs generates nothing
        assert [a.generated_tokens(), b.generated_tokens()] == tokens
        sync = make_sync(model, tmp_path, "tensor")
        inflight = InFlightUpdates(mode, client, pause_mode="retract")
        no_batch_running = types.SimpleNamespace(paused=contextlib.nullcontext)  # the trainer's producer
        with inflight.around_sync(no_batch_running):  # the workers pause (partial: pause mode abort)
            stats = sync.sync(client, version)
        assert stats.attempts == 1 and stats.metrics()["fleet/removed"] == 0
        assert stats.metrics()["fleet/workers"] == 2 and client.urls == sorted([a.url, b.url])
        assert sorted(listed(router)) == sorted([a.url, b.url])
        assert [weight_version(a), weight_version(b)] == [str(version)] * 2
        assert httpx.get(f"{a.url}/health", timeout=60).status_code == 200  # continued
