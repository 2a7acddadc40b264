"""The client's router arguments, without a router running (the real router: test_router_fleet.py)."""

import socket

import pytest

from megatron_gspo.rollout import RolloutServerError, SGLangClient


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket closes


def test_urls_and_a_router_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        SGLangClient(["http://a:1"], router_url="http://r:2")


def test_an_unreachable_router_is_named_after_the_wait():
    url = f"http://127.0.0.1:{closed_port()}"
    with SGLangClient([], router_url=url, health_timeout_s=1) as client:
        assert client.urls == []  # nothing listed yet: the wait below is where it must appear
        with pytest.raises(
            RolloutServerError, match=rf"/workers .*{url}.*Connection refused \(waited 0.5s\)"
        ):
            client.wait_until_healthy(0.5, poll_s=0.1)


def test_without_a_router_no_worker_is_ever_removed():
    url = f"http://127.0.0.1:{closed_port()}"  # dead, but configured: the run's servers are fixed
    with SGLangClient([url]) as client:
        assert client.remove_unhealthy_workers() == [] and client.urls == [url]
