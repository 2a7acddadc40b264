"""The model-parallel RNG tracker keeps CUDA generator states; on CPU use the CPU generator.

`model_parallel_cuda_manual_seed` and `get_cuda_rng_tracker().fork()` read and set the
CUDA RNG state. The tracker's named states (data-parallel, tensor-parallel, expert-parallel
seeds) become CPU generator states, forked the same way.
"""

import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.tensor_parallel import random

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "CudaRNGStatesTracker"):
        require(hasattr(random, name), "rng_tracker", f"tensor_parallel.random.{name} missing")
    add = inspect.signature(random.CudaRNGStatesTracker.add)
    require(list(add.parameters) == ["self", "name", "seed"], "rng_tracker", f"tracker.add{add}")


def _add(self, name, seed):
    """CudaRNGStatesTracker.add on the CPU generator (same checks as upstream)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


def _apply() -> None:
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    random.CudaRNGStatesTracker.add = _add


PATCH = Patch(
    name="rng_tracker",
    fixes="model_parallel_cuda_manual_seed / rng tracker fork read CUDA RNG states",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="cpu",
    check=_check,
    apply=_apply,
)
