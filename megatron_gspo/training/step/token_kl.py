"""ROLL's reward-side KL in the RL step: per-token advantages from the rewards and the reference.

The response rewards reach the ranks already normalised and clipped (rank 0, as ROLL's
``reward_postprocess``); once pi_old and the reference's log-probs are known (the recompute or
reference pass), each micro-batch's [B] rewards become [B, T] returns
(`algorithms/token_kl.py`), then ROLL's whitening (over every response token of the step, all
data-parallel ranks) and advantage clip apply. Runs on the last pipeline stage, where the
log-probs live; the step's KL reaches every rank for the controller's update.
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms.token_kl import KLController, token_level_kl_returns
from megatron_gspo.config import AlgorithmConfig
from megatron_gspo.model.distributed import all_reduce, compute_device
from megatron_gspo.model.logprobs import is_last_stage
from megatron_gspo.model.pipeline import share_from_last_stage
from megatron_gspo.training.step.forward import MicroBatch

_WHITEN_EPS = 1e-8  # ROLL's masked_whiten


def apply_token_level_kl(
    model, plan: list[list[MicroBatch]], algo: AlgorithmConfig, controller: KLController, group
) -> dict[str, float]:
    """Replace every micro-batch's advantages by ROLL's token-level ones; update the controller.

    Args:
        model: the policy (to know whether this rank is the last pipeline stage).
        plan: the step's micro-batches with `old_logprobs` and `ref_logprobs` set.
        algo: `kl_penalty`, `reward_clip`, `whiten_advantages`, `advantage_clip`.
        controller: beta, updated after this step with the step's KL.
        group: the data-parallel group (the whitening and the KL span its ranks).

    Returns:
        `critic/kl` (mean over responses of each response's mean KL) and `critic/kl_coef` (the
        beta this step used), as ROLL logs them.
    """
    beta = controller.value
    out = {}
    if is_last_stage(model):
        micros = [micro for mini in plan for micro in mini]
        sums = torch.zeros(5, dtype=torch.float64, device=compute_device())
        for micro in micros:
            returns, seq_kl = token_level_kl_returns(
                micro.advantages, micro.old_logprobs, micro.ref_logprobs, micro.response_mask,
                beta=beta, estimator=algo.kl_penalty, reward_clip=algo.reward_clip,
            )  # fmt: skip
            values = returns[micro.response_mask].double()
            micro.advantages = returns
            sums += torch.stack([values.new_tensor(values.numel()), values.sum(), values.square().sum(),
                                 seq_kl.double().sum(), values.new_tensor(len(seq_kl))])  # fmt: skip
        all_reduce(sums, group=group)
        tokens, total, squares, kl_sum, responses = sums.tolist()
        mean = total / tokens
        var = (squares - tokens * mean * mean) / max(tokens - 1, 1)
        for micro in micros:
            adv = micro.advantages
            if algo.whiten_advantages:
                adv = (adv - mean) * (var + _WHITEN_EPS) ** -0.5
            if algo.advantage_clip is not None:
                adv = adv.clamp(-algo.advantage_clip, algo.advantage_clip)
            micro.advantages = torch.where(micro.response_mask, adv, 0.0)
        out = {"critic/kl": kl_sum / responses, "critic/kl_coef": beta, "_responses": responses}
    out = share_from_last_stage(out)
    controller.update(out["critic/kl"], int(out.pop("_responses")))
    return out
