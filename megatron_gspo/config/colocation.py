"""Start-up checks of `rollout.placement: colocated`: what sharing the trainer's GPUs needs.

Read as a list: each check names the fields involved and why colocation needs them.
"""

from __future__ import annotations

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError


class ColocationError(ConfigError):
    """A colocated run's settings cannot share the trainer's GPUs with the rollout servers."""


def check_colocation(cfg: RunConfig, *, world_size: int, devices_per_node: int) -> None:
    """Refuse by name what a colocated run cannot do; nothing for a disaggregated one.

    Args:
        cfg: the run's config.
        world_size: trainer processes (one per GPU).
        devices_per_node: GPUs (CPU: trainer processes) of one node.
    """
    rollout = cfg.rollout
    if rollout.placement != "colocated":
        return
    if cfg.weight_sync.method != "tensor":
        raise ColocationError(
            f"rollout.placement=colocated needs weight_sync.method=tensor, got {cfg.weight_sync.method}: "
            "the servers share the trainer's GPUs, so the weights pass by tensor handles (CUDA IPC), "
            "not over a second copy in a broadcast group or on disk"
        )
    if rollout.max_staleness:
        raise ColocationError(
            f"rollout.placement=colocated needs rollout.max_staleness=0, got {rollout.max_staleness}: "
            "the servers release their memory while the trainer trains, so nothing can generate ahead"
        )
    if world_size % devices_per_node:
        raise ColocationError(
            f"rollout.placement=colocated: {world_size} trainer processes do not fill whole nodes of "
            f"{devices_per_node} GPUs; every GPU of a node hosts a trainer rank and a server rank"
        )
    for field, size in (
        ("rollout.server_tensor_parallel", rollout.server_tensor_parallel),
        ("parallel.tensor_parallel", cfg.parallel.tensor_parallel),
    ):
        if devices_per_node % size:
            raise ColocationError(
                f"rollout.placement=colocated: {field}={size} does not divide the node's "
                f"{devices_per_node} GPUs, so a TP group would span two nodes or leave GPUs idle"
            )
    embedded = not rollout.server_urls and rollout.router_url is None
    if embedded and world_size != devices_per_node:
        raise ColocationError(
            f"rollout.placement=colocated on {world_size // devices_per_node} nodes: the run starts "
            "embedded servers on one node only; start each node's SGLang servers on its own GPUs with "
            "launch/sglang_servers.sh (it passes --enable-memory-saver) and list them in "
            "rollout.server_urls or behind rollout.router_url"
        )
    covered = len(rollout.server_urls) * rollout.server_tensor_parallel
    if rollout.server_urls and covered != world_size:
        raise ColocationError(
            f"rollout.placement=colocated: {len(rollout.server_urls)} servers x "
            f"rollout.server_tensor_parallel={rollout.server_tensor_parallel} cover {covered} GPUs, "
            f"the trainer runs on {world_size}: each GPU hosts exactly one server rank"
        )
