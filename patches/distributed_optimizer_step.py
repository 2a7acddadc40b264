"""Give every parameter its own Adam `step` after `DistributedOptimizer.load_state_dict`.

Without apex / TransformerEngine, `DistributedOptimizer.load_state_dict` (megatron-core 0.16 to 0.19)
puts ONE `step` tensor into every parameter's torch-Adam state. Torch's Adam increments
`state["step"]` in place once per parameter, so after a resume the shared counter runs ahead
by the number of parameters each step, and the bias correction of the resumed run drifts
from the uninterrupted one from its second step on.
"""

import functools
import inspect

import torch
from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(inspect.unwrap(DistributedOptimizer.load_state_dict))
    require(
        's["step"] = step' in source, "distributed_optimizer_step", "load_state_dict no longer shares step"
    )


def _apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()

    DistributedOptimizer.load_state_dict = load_state_dict


PATCH = Patch(
    name="distributed_optimizer_step",
    fixes="DistributedOptimizer.load_state_dict shares one Adam step tensor between all parameters",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="no_te",
    check=_check,
    apply=_apply,
)
