"""Pure-torch RL algorithms: advantages, policy losses (registry), KL, aggregation, rollout correction.

Also the rollout/trainer log-prob mismatch statistics by response length. Imports nothing from
Megatron or HTTP. Built-in policy losses: ``gspo``, ``gspo_token``, ``grpo``, ``sapo``; add one
with :func:`register_policy_loss`.
"""

from megatron_gspo.algorithms.advantages import REWARD_NORMS, compute_group_advantages
from megatron_gspo.algorithms.aggregation import (
    LOSS_AGG_MODES,
    TOKEN_SUM_AGG_MODES,
    aggregate_loss,
    compute_loss_normalizer,
)
from megatron_gspo.algorithms.inputs import PolicyLossInputError
from megatron_gspo.algorithms.kl import KL_ESTIMATORS, compute_kl_loss, kl_penalty
from megatron_gspo.algorithms.mismatch import NUM_LENGTH_BUCKETS, mismatch_by_length, mismatch_sums
from megatron_gspo.algorithms.policy_loss import compute_policy_loss
from megatron_gspo.algorithms.registry import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossRegistry,
    PolicyLossSpec,
    PolicyLossTerms,
    register_policy_loss,
)
from megatron_gspo.algorithms.rollout_correction import (
    CORRECTION_LEVELS,
    CORRECTION_METHODS,
    RolloutCorrection,
)
from megatron_gspo.algorithms.running_stats import RunningMeanStd

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_METHODS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "NUM_LENGTH_BUCKETS",
    "POLICY_LOSSES",
    "REWARD_NORMS",
    "TOKEN_SUM_AGG_MODES",
    "PolicyLossInputError",
    "PolicyLossInputs",
    "PolicyLossRegistry",
    "PolicyLossSpec",
    "PolicyLossTerms",
    "RolloutCorrection",
    "RunningMeanStd",
    "aggregate_loss",
    "compute_group_advantages",
    "compute_kl_loss",
    "compute_loss_normalizer",
    "compute_policy_loss",
    "kl_penalty",
    "mismatch_by_length",
    "mismatch_sums",
    "register_policy_loss",
]
