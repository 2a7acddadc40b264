"""Megatron's forward-backward schedules allocate their token counter on device="cuda".

Every schedule (no pipelining, 1F1B, interleaved) starts with
`total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`, which fails on a machine
without CUDA before the first micro-batch runs. The schedules module gets its own view of
`torch` whose `zeros` puts a CUDA-device tensor on the CPU; every other name is torch's own.
Scoped to that one module on purpose: a torch function mode around the schedule would also
intercept every operation of the forward and backward it drives.
"""

import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class SchedulesTorch:
    """`torch` as megatron's schedules module sees it on CPU: `zeros(..., device="cuda")` -> CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        """`torch.zeros`, on the CPU when asked for a CUDA device."""
        return torch.zeros(*args, device="cpu" if _is_cuda(device) else device, **kwargs)


def _check() -> None:
    from megatron.core.pipeline_parallel import schedules

    source = inspect.getsource(schedules)
    require(
        'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")' in source,
        "schedule_token_counter",
        "the schedules no longer allocate their token counter on device='cuda'",
    )


def _apply() -> None:
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, SchedulesTorch):
        schedules.torch = SchedulesTorch()


PATCH = Patch(
    name="schedule_token_counter",
    fixes="forward-backward schedules allocate total_num_tokens with device='cuda'",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
