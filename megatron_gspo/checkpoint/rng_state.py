"""Every random stream a training step draws from, captured and restored per rank.

A resume at the same parallel layout restores each rank's streams, so the resumed run draws
exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Every random stream a training step can draw from, on this rank.

    Returns:
        `python` (random.getstate()), `numpy` (legacy global generator state), `torch_cpu`
        (ByteTensor), `cuda` (one ByteTensor per device, only with CUDA) and `megatron_tracker`
        (megatron's model-parallel RNG tracker: name -> generator state; empty when unused).
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned, so the next draws repeat exactly.

    Raises:
        ValueError: a stream is missing, or the state holds CUDA generators and CUDA is absent.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    missing = {"python", "numpy", "torch_cpu", "megatron_tracker"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)} (has {sorted(state)})")
    if "cuda" in state and not torch.cuda.is_available():
        raise ValueError("RNG state holds CUDA generator states but CUDA is not available here")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = get_cuda_rng_tracker()
    if state["megatron_tracker"] or tracker.get_states():
        tracker.set_states({name: s.clone() for name, s in state["megatron_tracker"].items()})
