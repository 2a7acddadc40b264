"""Memory handed to another process by CUDA IPC: allocated outside expandable segments, collected after.

`launch/train_h100.sh` runs the trainer with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
(segments grow in place instead of fragmenting between micro-batches of different lengths). A
tensor in an expandable segment is shared as a POSIX file descriptor that the receiver fetches
with `pidfd_getfd`, which needs ptrace rights over the sender: an SGLang server is not the
trainer's child, so in a container or with `kernel.yama.ptrace_scope >= 1` the receiver's open
fails ("pidfd_getfd: Operation not permitted"; pytorch#165685, verl#3377) inside SGLang's
`update_weights_from_tensor`, where nothing catches it, and the scheduler dies at the first sync.
An ordinary segment is shared by a `cudaIpcMemHandle`, which any process on the node can open.

So the tensor method allocates each bucket with expandable segments switched off and back on
afterwards, as verl does around its weight hand-over; torch's caching allocator honours the switch
for the next allocations and does not hand out blocks of expandable segments while it is off. The
rest of the step keeps expandable segments. On a CPU device nothing is switched (CPU handles are
shared-memory files: `tensor_handles`).

After a sync, `collect_ipc` asks torch to free the memory of handles the receivers have closed
(`torch.cuda.ipc_collect`): the sender's allocator keeps a shared block until then.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

OFF = "expandable_segments:False"
ON = "expandable_segments:True"


def expandable_segments_on(settings: str) -> bool:
    """Whether allocator settings (`PYTORCH_CUDA_ALLOC_CONF`'s form) turn them on (the last one wins)."""
    on = False
    for option in settings.split(","):
        key, _, value = option.strip().partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


def allocator_settings() -> str | None:
    """The allocator settings torch holds now (None where this torch cannot say: before 2.9)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return get() if get is not None else None


def set_allocator_settings(settings: str) -> None:
    """Change torch's allocator settings for the next allocations (the option named; others kept)."""
    set_ = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_ is None:  # torch before 2.9: the same call under its older name
        set_ = torch.cuda.memory._set_allocator_settings
    set_(settings)


@contextlib.contextmanager
def outside_expandable_segments(device: torch.device) -> Iterator[None]:
    """Allocations on `device` inside the block come from ordinary segments, which CUDA IPC can share.

    Switched only on a CUDA device and only when expandable segments are on; switched back on
    after the block, error or not. A torch that cannot report its settings gets them switched
    off and left off (nothing says they were on).
    """
    if device.type != "cuda":
        yield
        return
    before = allocator_settings()
    switch = before is None or expandable_segments_on(before)
    if switch:
        set_allocator_settings(OFF)
    try:
        yield
    finally:
        if switch and before is not None:
            set_allocator_settings(ON)
        elif switch:
            logger.warning("expandable segments left off: this torch does not report its allocator settings")


def collect_ipc(device: torch.device) -> None:
    """After a sync on CUDA: free the shared blocks whose handles the receivers have closed."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()
