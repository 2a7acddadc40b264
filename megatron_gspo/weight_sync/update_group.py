"""The weight-update process group that joins the trainer's sender to the rollout servers.

SGLang's workers join it from `/init_weights_update_group` with `tcp://master:port`
rendezvous, keys under the group name, ranks `rank_offset + tp_rank`; the trainer's sender is
rank 0 and hosts the store. The group lives outside either side's default process group (the
trainer's megatron world is untouched; the embedded server has no default group at all), so
this module builds it the way SGLang does, with torch's group constructor, and both the
trainer and the embedded server use it: the two sides must agree key for key.

Timeouts on the trainer's side. The project bounds every wait on the group itself
(`weight_sync.timeout_s`, the deadline) and recovers from a passed one: the attempt fails, held
workers are set aside, the retry syncs the rest. Under NCCL, torch's watchdog also watches each
collective against the group's timeout, and with `TORCH_NCCL_ASYNC_ERROR_HANDLING` at its
default (3; torchrun's agent sets 1) it ends the whole process when one times out, before that
recovery could act if the two timeouts were equal. So an NCCL group's timeout is the deadline
plus `NCCL_ABORT_MARGIN_S` (`collective_timeout_s`), and the trainer aborts its side of the
group itself (`abort_update_group`: torch's `_abort_process_group`) as soon as a bucket is not
answered by the deadline (under NCCL: as soon as a bucket fails at all), long before the
watchdog would. Gloo has no watchdog: its timeout is what ends a receive held by a lost peer
(the embedded server relies on it), so it stays the deadline. Gloo's abort does not close the
group's connections (measured: a peer held in a receive stays held until the aborting process
exits or the peer's own timeout).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

NCCL_ABORT_MARGIN_S = 600.0
"""How much longer than the deadline an NCCL group's collectives may run before torch's watchdog
acts: what the sender may spend after a broadcast is enqueued and before its deadline starts
(gathering the next bucket), plus the abort itself."""


def pick_backend(configured: str, trainer_device: torch.device, infos: Sequence[Mapping[str, Any]]) -> str:
    """`weight_sync.backend` with `auto` resolved for this trainer and these servers.

    `auto` is NCCL only when the trainer is on CUDA and every server's `/get_server_info` says
    `device: cuda` (SGLang serialises its `device` launch argument there; the embedded server
    reports where it runs); otherwise gloo. A CPU server refuses NCCL, so guessing from the
    trainer's side alone makes a GPU trainer wait for a group that server will never join.
    """
    if configured != "auto":
        return configured
    on_cuda = trainer_device.type == "cuda" and all(info.get("device") == "cuda" for info in infos)
    return "nccl" if on_cuda else "gloo"


def collective_timeout_s(backend: str, deadline_s: float) -> float:
    """The group's collective timeout for a project deadline of `deadline_s` (see the module doc).

    NCCL: `deadline_s + NCCL_ABORT_MARGIN_S`, so the project aborts a hung collective before the
    watchdog ends the process; gloo (no watchdog): `deadline_s`.
    """
    if backend == "nccl":
        return deadline_s + NCCL_ABORT_MARGIN_S
    return deadline_s


def init_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    collective_timeout: float | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: create) the group; blocks until all `world_size` ranks have joined.

    Args:
        master_address: the sender's address (rank 0 listens there).
        master_port: the rendezvous port.
        rank: this process's rank (0 = the trainer's sender).
        world_size: 1 + every rollout-server rank.
        group_name: shared name; also the key prefix in the rendezvous store.
        backend: "nccl" between GPUs, "gloo" on CPU.
        timeout_s: rendezvous timeout, and the collectives' unless `collective_timeout` is given.
        collective_timeout: the collectives' timeout in seconds (NCCL's watchdog acts on it); the
            trainer passes `collective_timeout_s(backend, timeout_s)`.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    group_timeout = datetime.timedelta(
        seconds=timeout_s if collective_timeout is None else collective_timeout
    )
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
        timeout=group_timeout,
    )
    # Group rank i is "global" rank i for `dist.broadcast(src=0, group=...)`: the sender is 0 on
    # both sides (the trainer joins from its global rank 0).
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def join_watching(
    join: Callable[[], dist.ProcessGroup], answers: cf.Future, timeout_s: float
) -> dist.ProcessGroup:
    """The trainer's side of the rendezvous (`join`), ended at once by a server's refusal.

    A server that refuses the group (a CPU server asked for NCCL, a name it holds) answers at
    once, but the rendezvous waits for every rank until its own timeout. So `join` runs on a
    thread while `answers` (the servers' replies to `/init_weights_update_group`) is watched: the
    first refusal is raised with the server's message. The rendezvous cannot be interrupted; given
    up on, its thread ends by its own timeout and a group it still makes is destroyed (every join
    has a fresh name and port, so nothing reuses them). The thread is a daemon one: an exiting
    trainer does not wait for it (a pool's thread would be joined at exit).

    Returns:
        The group, once the trainer has joined and every server has answered, within `timeout_s`.
    """
    joined: cf.Future = cf.Future()

    def run() -> None:
        try:
            joined.set_result(join())
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            joined.set_exception(err)

    threading.Thread(target=run, name="weight-update-join", daemon=True).start()
    cf.wait([joined, answers], timeout=timeout_s, return_when=cf.FIRST_EXCEPTION)
    if answers.done() and answers.exception() is not None:
        joined.add_done_callback(_destroy_if_made)
        raise answers.exception()
    if joined.done() and joined.exception() is not None:
        raise joined.exception()  # the trainer's own side failed: the servers' waits end by their timeout
    if not (joined.done() and answers.done()):
        joined.add_done_callback(_destroy_if_made)
        raise TimeoutError(f"weight-update group not joined within weight_sync.timeout_s={timeout_s}")
    return joined.result()


def _destroy_if_made(joined: cf.Future) -> None:
    if joined.exception() is None:
        with contextlib.suppress(Exception):
            destroy_update_group(joined.result())


def destroy_update_group(group: dist.ProcessGroup) -> None:
    """Leave the group (its sockets / communicators are released)."""
    dist.destroy_process_group(group)


def abort_update_group(group: dist.ProcessGroup) -> None:
    """Abort the group now: a collective in flight ends with an error instead of being waited for.

    torch's `_abort_process_group` (distributed_c10d.py) calls the group's `abort()` (NCCL:
    aborts its communicators; gloo: its backend's abort) and forgets the group, as
    `destroy_process_group` does; a destroy instead calls `shutdown()`, meant for a group with
    no collective hung in it.
    """
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)


def timed_out(err: BaseException) -> bool:
    """Whether a bucket's wait ended because a deadline passed.

    Ours (`TimeoutError`), or the group's own, which a gloo group is given equal to it
    (`update_group.collective_timeout_s`) and which may fire first, counted from the broadcast's
    start ("Timed out waiting 2000ms for send operation to complete").
    """
    return isinstance(err, TimeoutError) or (
        isinstance(err, RuntimeError) and "timed out" in str(err).lower()
    )


def wait_for_bucket(work, answers, timeout_s: float) -> None:
    """Wait for the servers' answers and the broadcast; a refusal or a failed broadcast ends the wait.

    The servers answer once they have received and checked the bucket (or at once when they
    refuse it), so the wait is on their answers, woken as soon as they come; the broadcast is
    looked at between wake-ups, so a failed one is raised without waiting for the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while not answers.done():
        if work.is_completed():
            work.wait()  # raises when the broadcast failed
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast not received within weight_sync.timeout_s={timeout_s}")
        cf.wait([answers], timeout=0.01)
    answers.result()  # a refusal: the group is unusable now
    while not work.is_completed():  # answered, so received: the sender's side is finishing
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast not completed within weight_sync.timeout_s={timeout_s}")
        time.sleep(0.0002)
    work.wait()


def master_address(urls: list[str]) -> str:
    """This host's address on the route to the first server (127.0.0.1 for a local server).

    A UDP `connect` sends nothing; it only picks the outgoing interface, which avoids
    `gethostbyname(gethostname())` answering 127.0.1.1 on hosts that map their name so.
    """
    url = urlparse(urls[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((url.hostname, url.port or 80))
        return sock.getsockname()[0]


def free_port() -> int:
    """A free TCP port on every interface, for the group's store (servers may connect from other hosts)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
