"""Start-up checks of the rollout servers against what the run will ask of them.

A server launched in a way the run cannot use is refused by name before the first step,
instead of failing the first weight sync after minutes of retries:

- SGLang refuses `/init_weights_update_group` (and `/update_weights_from_tensor` without DP
  attention) on a server launched with `--dp-size` > 1: its tokenizer manager asserts
  `dp_size == 1` ("dp_size must be 1 for init parameter update group"). Such a deployment
  runs one server per DP replica (`launch/sglang_servers.sh` does with DP > 1), each URL in
  `rollout.server_urls`; `weight_sync.method: disk` works with any dp_size.
- Routing Replay R3 and the drift metrics need `--enable-return-routed-experts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gspo.errors import ConfigError

_DP_FIX = (
    "launch one server per DP replica (launch/sglang_servers.sh with DP={dp} does) and list every "
    "URL in rollout.server_urls, or set weight_sync.method=disk"
)


def refuse_unfit_servers(
    urls: Sequence[str], infos: Sequence[Mapping[str, Any]], *, sync_method: str, routed_experts: bool
) -> None:
    """Raise a `ConfigError` naming the first server the run cannot use.

    Args:
        urls: the servers, in the order of `infos`.
        infos: each server's `/get_server_info` answer (SGLang's server arguments).
        sync_method: `weight_sync.method` (distributed, tensor or disk).
        routed_experts: the run needs routed experts from the servers (R3 or drift).

    Raises:
        ConfigError: a server with dp_size > 1 for the distributed (or tensor, without DP
            attention) method, or without routed experts when they are needed.
    """
    for url, info in zip(urls, infos, strict=True):
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
