"""The weight-update process group that joins the trainer's sender to the rollout servers.

SGLang's workers join it from `/init_weights_update_group` with `tcp://master:port`
rendezvous, keys under the group name, ranks `rank_offset + tp_rank`; the trainer's sender is
rank 0 and hosts the store. The group lives outside either side's default process group (the
trainer's megatron world is untouched; the embedded server has no default group at all), so
this module builds it the way SGLang does, with torch's group constructor, and both the
trainer and the embedded server use it: the two sides must agree key for key.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def init_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join (rank 0: create) the group; blocks until all `world_size` ranks have joined.

    Args:
        master_address: the sender's address (rank 0 listens there).
        master_port: the rendezvous port.
        rank: this process's rank (0 = the trainer's sender).
        world_size: 1 + every rollout-server rank.
        group_name: shared name; also the key prefix in the rendezvous store.
        backend: "nccl" between GPUs, "gloo" on CPU.
        timeout_s: rendezvous and collective timeout.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # What `tcp://` rendezvous builds, made directly: under torchrun that rendezvous would
    # expect the launcher's agent to host the store (TORCHELASTIC_USE_AGENT_STORE), not rank 0.
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
    )
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    # Group rank i is "global" rank i for `dist.broadcast(src=0, group=...)`: the sender is 0 on
    # both sides (the trainer joins from its global rank 0).
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_update_group(group: dist.ProcessGroup) -> None:
    """Leave the group (its sockets / communicators are released)."""
    dist.destroy_process_group(group)
