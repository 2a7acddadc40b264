"""Loading a `fully_reshardable` DistributedOptimizer checkpoint with torch's Adam.

`DistributedOptimizer._set_main_param_and_optimizer_states` copies every entry of the
parameter's torch-Adam state from the loaded tensors, `step` included, but the
`fully_reshardable` loader hands it only `param`, `exp_avg` and `exp_avg_sq` (the step comes
from the param groups): `KeyError: 'step'` on every resume without apex / TransformerEngine
(whose FusedAdam keeps no per-parameter step). The patch passes the parameter's own step
tensor along, so the copy leaves it as `load_state_dict` set it.
"""

import functools
import inspect

from packaging.specifiers import SpecifierSet

from ._base import Patch, require


def _check() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer._set_main_param_and_optimizer_states)
    require(
        '{"param": main_param' in source and "copy_(tensors[key])" in source,
        "distributed_optimizer_reshardable_load",
        "_set_main_param_and_optimizer_states no longer copies the Adam state key by key",
    )


def _apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


PATCH = Patch(
    name="distributed_optimizer_reshardable_load",
    fixes="fully_reshardable DistributedOptimizer checkpoints fail to load with torch Adam (KeyError 'step')",
    verified=SpecifierSet(">=0.16.1,<0.20"),
    needed_when="no_te",
    check=_check,
    apply=_apply,
)
