"""Start-up checks of the rollout servers against what the run will ask of them.

A server launched in a way the run cannot use is refused by name before the first step,
instead of failing the first weight sync after minutes of retries:

- SGLang refuses `/init_weights_update_group` (and `/update_weights_from_tensor` without DP
  attention) on a server launched with `--dp-size` > 1: its tokenizer manager asserts
  `dp_size == 1` ("dp_size must be 1 for init parameter update group"). Such a deployment
  runs one server per DP replica (`launch/sglang_servers.sh` does with DP > 1), each URL in
  `rollout.server_urls`; `weight_sync.method: disk` works with any dp_size.
- A server launched with `--pp-size` > 1 cannot take the distributed or tensor method: SGLang
  joins the weight-update group as `rank_offset + tp_rank` (`model_runner.init_weights_update_group`
  ignores the pipeline rank, so two stages claim one rank and the rendezvous hangs), and each TP
  rank opens its own `serialized_named_tensors` entry (`deserialize_own_rank`), which this
  project counts and places by TP rank only. `weight_sync.method: disk` works with any pp_size.
- Routing Replay R3 and the drift metrics need `--enable-return-routed-experts`.
- A colocated run (`memory_saver=True`) releases the servers' memory while it trains: SGLang
  without `--enable-memory-saver` answers `/release_memory_occupation` with 200 and frees
  nothing, so each server must report `enable_memory_saver: true`; one on the CPU (SGLang's CPU
  engine, where torch_memory_saver cannot run) is let through with a warning saying so.

A server that does not serve the trainer's weights (version or checkpoint) is synced before the
first evaluation. The launch checks read one `/get_server_info` per server, the served weights
one `/model_info` (`check_servers`): SGLang's `/get_server_info` serialises its launch arguments,
so its `model_path` and `weight_version` are the launch values, never those a weight update set
since (an earlier run's sync, an operator's); `/model_info` reports those live.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from megatron_gspo.config.schema import RolloutConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.client import SGLangClient

logger = logging.getLogger(__name__)

_DP_FIX = (
    "launch one server per DP replica (launch/sglang_servers.sh with DP={dp} does) and list every "
    "URL in rollout.server_urls, or set weight_sync.method=disk"
)


def refuse_unreachable_endpoints(rollout: RolloutConfig, poll_s: float = 0.5) -> None:
    """Raise a `ConfigError` naming the first external rollout endpoint that answers no HTTP request.

    Run before any training (SFT included), so that a wrong URL or a server not started costs
    seconds, not the cold start. Any HTTP answer counts (a server still loading may say 503);
    an endpoint that does not connect is retried until `timeout_s`, so servers started beside
    the trainer may still be coming up. The embedded server is started later by the run itself.

    Args:
        rollout: its `server_urls` or `router_url` (the router's workers are checked once it lists
            them) and `server_start_timeout_s`, how long each endpoint may take to answer.
        poll_s: pause between attempts.
    """
    timeout_s = rollout.server_start_timeout_s
    endpoints = (
        [(f"rollout.router_url={rollout.router_url}", rollout.router_url)] if rollout.router_url else []
    )
    endpoints += [(f"rollout.server_urls: {url}", url) for url in rollout.server_urls]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(
        timeout=httpx.Timeout(10.0, connect=min(10.0, max(timeout_s, 0.1))), trust_env=False
    ) as http:
        for name, url in endpoints:
            while True:
                try:
                    http.get(f"{url.rstrip('/')}/health")
                    break
                except httpx.HTTPError as err:
                    if time.monotonic() + poll_s > deadline:
                        raise ConfigError(
                            f"{name} is unreachable ({type(err).__name__}: {err}; waited {timeout_s:g} s, "
                            "rollout.server_start_timeout_s): start it or correct the URL"
                        ) from None
                time.sleep(poll_s)


def refuse_unfit_servers(
    urls: Sequence[str],
    infos: Sequence[Mapping[str, Any]],
    *,
    sync_method: str,
    routed_experts: bool,
    memory_saver: bool = False,
) -> None:
    """Raise a `ConfigError` naming the first server the run cannot use.

    Args:
        urls: the servers, in the order of `infos`.
        infos: each server's `/get_server_info` answer (SGLang's server arguments).
        sync_method: `weight_sync.method` (distributed, tensor or disk).
        routed_experts: the run needs routed experts from the servers (R3 or drift).
        memory_saver: the run releases the servers' memory (colocated): `--enable-memory-saver`.

    Raises:
        ConfigError: a server with dp_size > 1 for the distributed (or tensor, without DP
            attention) method, with pp_size > 1 for the distributed or tensor method, without
            routed experts when they are needed, or without the memory saver when it is needed.
    """
    for url, info in zip(urls, infos, strict=True):
        pp = int(info.get("pp_size", 1))
        if pp > 1 and sync_method in ("distributed", "tensor"):
            raise ConfigError(
                f"rollout server {url} was launched with pp_size={pp}: SGLang's weight updates address "
                f"its ranks by TP rank only (group rank = rank_offset + tp_rank, one tensor entry per TP "
                f"rank), so its {pp} pipeline stages cannot take weight_sync.method={sync_method}; relaunch "
                "it with --pp-size 1 (more TP, or more servers) or set weight_sync.method=disk"
            )
        dp = int(info.get("dp_size", 1))
        refused = sync_method == "distributed" or (
            sync_method == "tensor" and not info.get("enable_dp_attention", False)
        )
        if dp > 1 and refused:
            raise ConfigError(
                f"rollout server {url} was launched with dp_size={dp}: SGLang refuses "
                f"weight_sync.method={sync_method} unless dp_size is 1; " + _DP_FIX.format(dp=dp)
            )
        if routed_experts and info.get("enable_return_routed_experts") is False:
            raise ConfigError(
                f"rollout server {url} was launched without --enable-return-routed-experts, which "
                "algorithm.routing_replay=r3 and drift.enabled need; relaunch it with the flag "
                "(launch/sglang_servers.sh ROUTED_EXPERTS=1) or turn both off"
            )
        if memory_saver and info.get("enable_memory_saver") is not True and _saver_impossible(info):
            logger.warning(
                "rollout server %s runs on the CPU without the memory saver (SGLang's needs CUDA): its "
                "release and resume are no-ops, so nothing is freed while the trainer trains",
                url,
            )
        elif memory_saver and info.get("enable_memory_saver") is not True:
            raise ConfigError(
                f"rollout server {url} was launched without --enable-memory-saver (its server_info "
                f"says enable_memory_saver={info.get('enable_memory_saver')!r}), which a colocated run "
                "needs to release its weights and KV cache while training; relaunch it with the flag"
            )


def _saver_impossible(info: Mapping[str, Any]) -> bool:
    """SGLang's CPU engine: torch_memory_saver needs CUDA (the embedded server has a saver of its own)."""
    return info.get("device") == "cpu" and info.get("version") != "embedded"


def same_path(served: str | None, expected: str | os.PathLike | None) -> bool:
    """Whether a server's `model_path` names `expected` (same string, or the same directory here)."""
    if served is None or expected is None:
        return False
    if str(served) == str(expected):
        return True
    return os.path.exists(served) and os.path.exists(expected) and os.path.samefile(served, expected)


def servers_not_serving(
    served: Iterable[tuple[str, str | None, str | None]],
    version: int,
    expected_path: str | os.PathLike | None,
) -> list[str]:
    """Why each server that does not serve the trainer's weights is out of date (empty: all do).

    `served` holds (url, weight_version, model_path) as each server reports them. A server must
    report the trainer's `version` and the checkpoint the trainer started from (an embedded
    server's start dir, else `model.hf_path`; none: random init, every server is synced anyway, so
    only versions are compared); otherwise it is synced before the cold-start
    evaluation, since a server started without `--weight-version` or updated by an earlier run
    would be measured, and then trained on, as if it were this run's policy.
    """
    problems = []
    for url, served_version, model_path in served:
        if served_version != str(version):
            problems.append(
                f"{url} serves weight_version {served_version!r}, the trainer's is {version}: syncing"
            )
        elif expected_path is not None and not same_path(model_path, expected_path):
            problems.append(f"{url} serves {model_path}, not {expected_path}: syncing")
    return problems


def served_weights(
    urls: Sequence[str], infos: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str, str | None]]:
    """(url, weight_version, model_path) of each server from its `/model_info` answer (the live ones).

    A server whose answer carries no `weight_version` reports "unknown" (so it is synced).
    """
    return [
        (url, str(info.get("weight_version", "unknown")), info.get("model_path"))
        for url, info in zip(urls, infos, strict=True)
    ]


def check_servers(
    client: SGLangClient,
    *,
    sync_method: str,
    routed_experts: bool,
    version: int,
    expected_path: str | os.PathLike | None,
    memory_saver: bool = False,
) -> list[str]:
    """`refuse_unfit_servers`, then `servers_not_serving`: one `/get_server_info` and one `/model_info` each.

    The refusal reads the launch arguments (`/get_server_info`), the out-of-date check what each
    server serves now (`/model_info`).

    Returns:
        Why each out-of-date server is (empty: every server serves the trainer's weights).

    Raises:
        ConfigError: a server the run cannot use (see `refuse_unfit_servers`).
    """
    infos = client.server_info()
    refuse_unfit_servers(
        client.urls, infos, sync_method=sync_method, routed_experts=routed_experts, memory_saver=memory_saver
    )
    return servers_not_serving(served_weights(client.urls, client.model_info()), version, expected_path)
