"""Update stage of an RL step: rollout batch -> mini-batches -> micro-batches -> optimizer steps.

The batch (rows group-major, on rank 0) is cut into `num_mini_batches` contiguous
mini-batches, one optimizer step each; rank 0 decides which rows each data-parallel rank
trains on and how it cuts them into micro-batches, by count or by a token budget
(`step.micro_batches`), and sends each rank only those (`step.scatter`); each rank packs its
micro-batches once per step. Per-token data, the loss and every tensor a collective touches
live on `compute_device()`. The loss normaliser of a mini-batch is computed over all its rows
(all-reduced over DP) and every micro-batch divides by it, so the summed gradient does not
depend on the split; megatron's DDP averages gradients over DP, hence the `dp_loss_scale` factor.
Each pass over a mini-batch is one run of megatron's forward-backward schedule over its
micro-batches (`model/pipeline.py`; 1F1B under pipeline parallelism): the policy loss is the
schedule's loss function on the last stage, where log-probs, pi_old and the loss metrics live;
the step's metrics reach every rank from there (`share_from_last_stage`).

pi_old is the rollout engine's log-probs (`old_logprobs=rollout`) or a no-grad trainer forward
with the rollout weights before the first update (`recompute`). The train/inference mismatch
|log pi_trainer - log pi_rollout| on response tokens (with its k3 KL and a by-length breakdown)
is measured either way while the weights still equal the rollout weights: in the recompute
pass, or in the first mini-batch's forward. With `recompute`, `algorithm.rollout_correction`
weighs every micro-batch's per-token loss by a function of pi_old / pi_rollout
(`algorithms/rollout_correction.py`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import (
    NUM_LENGTH_BUCKETS,
    compute_kl_loss,
    compute_loss_normalizer,
    compute_policy_loss,
    mismatch_by_length,
    mismatch_sums,
)
from megatron_gspo.algorithms.mismatch import SUM_COLUMNS
from megatron_gspo.config import AlgorithmConfig, policy_loss_options
from megatron_gspo.model.aux_loss import AuxLossWeights, aux_loss_scale
from megatron_gspo.model.distributed import all_reduce, compute_device
from megatron_gspo.model.logprobs import is_last_stage
from megatron_gspo.model.optim import dp_loss_scale, gather_params, optimizer_step, zero_grads
from megatron_gspo.model.pipeline import run_micro_batches, share_from_last_stage
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.training.step.forward import MicroBatch, pack_uniform
from megatron_gspo.training.step.micro_batches import DataLayout, flatten, split_batch
from megatron_gspo.training.step.scatter import RankRows


def plan_mini_batches(
    batch: RolloutBatch, advantages: torch.Tensor, num_mini_batches: int, layout: DataLayout
) -> list[list[MicroBatch]]:
    """`plan_rank_rows` of this rank's rows of a batch held locally (a world of one, tests).

    Args:
        batch: the step's rollout batch ([B, S] tensors).
        advantages: [B] one advantage per response.
        num_mini_batches: optimizer steps of the step; B must split evenly into them x DP.
        layout: this rank's place and the micro-batch rule.
    """
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    rows, sizes = flatten(split_batch(lengths, num_mini_batches, layout)[layout.dp_rank])
    local = RankRows.from_batch(
        batch, advantages, rows, routed_experts=False, device=compute_device(), micro_batch_sizes=sizes
    )
    return plan_rank_rows(local, num_mini_batches, layout)


def plan_rank_rows(rows: RankRows, num_mini_batches: int, layout: DataLayout) -> list[list[MicroBatch]]:
    """This rank's micro-batches of every mini-batch, packed (collective over the EP group).

    Args:
        rows: this rank's rows in training order, cut by `rows.micro_batch_sizes`.
        num_mini_batches: optimizer steps of the step.
        layout: this rank's place (padding multiple, packing layout).

    Returns:
        Per mini-batch, its micro-batches; `MicroBatch.indices` index `rows`, and the
        per-token tensors live on the device of `rows.response_mask` (the compute device).
    """
    sizes = rows.micro_batch_sizes
    if len(sizes) != num_mini_batches or not all(sizes):
        raise ValueError(
            f"this rank's rows are cut into {len(sizes)} mini-batches, expected {num_mini_batches}"
        )
    lengths = (rows.prompt_lengths + rows.response_lengths).tolist()
    plan, start = [], 0
    for mini in sizes:
        micro_batches = []
        for size in mini:
            idx = list(range(start, start + size))
            start += size
            packed = pack_uniform(
                [rows.tokens[i, : lengths[i]] for i in idx],
                pad_multiple=layout.pad_multiple,
                layout=layout.packing,
            )
            t = packed.max_len
            rollout_logprobs = rows.rollout_logprobs[idx, :t]
            micro_batches.append(
                MicroBatch(
                    indices=idx,
                    packed=packed,
                    response_mask=rows.response_mask[idx, :t].bool(),
                    old_logprobs=rollout_logprobs.clone(),
                    rollout_logprobs=rollout_logprobs,
                    advantages=rows.advantages[idx].float(),
                )
            )
        plan.append(micro_batches)
    return plan


def plan_metrics(plan: list[list[MicroBatch]]) -> dict[str, float]:
    """How well the step's micro-batches use their packed shapes, over all DP ranks (collective).

    Returns:
        `perf/padding_frac`: packed positions holding no token / all packed positions (after
        the expert-parallel peers' common shape); `perf/dp_token_imbalance`: most / fewest
        tokens (prompt + response) one data-parallel rank trains on in the step.
    """
    micro_batches = [micro for mini in plan for micro in mini]
    tokens = sum(micro.num_tokens for micro in micro_batches)
    positions = sum(micro.packed.tokens.numel() for micro in micro_batches)
    sums = torch.tensor([tokens, positions], dtype=torch.float64, device=compute_device())
    extremes = torch.tensor([tokens, -tokens], dtype=torch.float64, device=compute_device())
    all_reduce(sums, group=dp_group())
    all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp_group())
    return {
        "perf/padding_frac": float(1 - sums[0] / sums[1]),
        "perf/dp_token_imbalance": float(extremes[0] / -extremes[1]),
    }


class _Mismatch:
    """Accumulates the log-prob gap log pi_trainer - log pi_rollout on response tokens (no host sync).

    Reported as `rollout/logprob_mismatch_mean` / `_max` (|diff| over tokens), `rollout/k3_kl`
    (KL(pi_rollout || pi_trainer), k3 over tokens) and, per response-length bucket with at
    least one response (`algorithms/mismatch.py`), `rollout/mismatch_by_len/<bucket>/` +
    `abs_diff_mean`, `k3_kl`, `log_seq_ratio_mean` and `num_seqs`. With `old_logprobs=rollout`
    only the first mini-batch's rows are measured (the later ones see updated weights).
    """

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(NUM_LENGTH_BUCKETS, len(SUM_COLUMNS), dtype=torch.float64, device=device)
        self.max = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, logprobs: torch.Tensor, micro: MicroBatch) -> None:
        self.sums += mismatch_sums(logprobs, micro.rollout_logprobs, micro.response_mask)
        diff = (logprobs.detach().double() - micro.rollout_logprobs.double()).abs()[micro.response_mask]
        self.max = torch.maximum(self.max, diff.max())

    def reduce(self, group) -> dict[str, float]:
        all_reduce(self.sums, group=group)
        all_reduce(self.max, op=dist.ReduceOp.MAX, group=group)
        _, tokens, abs_diff, k3, _ = self.sums.sum(dim=0).tolist()
        out = {
            "rollout/logprob_mismatch_mean": abs_diff / max(tokens, 1.0),
            "rollout/logprob_mismatch_max": float(self.max),
            "rollout/k3_kl": k3 / max(tokens, 1.0),
        }
        for row in mismatch_by_length(self.sums):
            prefix = f"rollout/mismatch_by_len/{row['bucket']}/"
            out[prefix + "abs_diff_mean"] = row["abs_diff_mean"]
            out[prefix + "k3_kl"] = row["kl_k3"]
            out[prefix + "log_seq_ratio_mean"] = row["log_seq_ratio_mean"]
            out[prefix + "num_seqs"] = float(row["num_sequences"])
        return out


@torch.no_grad()
def recompute_old_logprobs(
    model,
    plan: list[list[MicroBatch]],
    temperature: float,
    *,
    routing=None,
    set_logprobs: bool = True,
    reference=None,
) -> None:
    """The pi_old pass (weights = rollout weights): the trainer's own `old_logprobs` and routing.

    One forward-only schedule run per mini-batch (`model/pipeline.py`); `old_logprobs` are
    set on the last pipeline stage, the only one that computes log-probs (and uses them).
    With a `reference`, the same pass also runs the reference model over each mini-batch's
    packed rows right after the policy (`ref_logprobs`): one pass over the step's data, two models.

    Args:
        model: the DDP-wrapped policy, still holding the rollout weights.
        plan: from `plan_mini_batches`.
        temperature: sampling temperature of the rollouts.
        routing: a `StepRouting` that records / captures pi_old's routing in this pass.
        set_logprobs: replace `old_logprobs` (False: the pass only serves `routing`).
        reference: a `ReferencePolicy` whose log-probs the KL loss needs, or None.
    """
    with reference.on_device() if reference is not None else contextlib.nullcontext():
        for micro_batches in plan:
            _old_pass(model, micro_batches, temperature, routing, set_logprobs)
            if reference is not None:
                reference.fill_logprobs(micro_batches, temperature)


def _old_pass(model, micro_batches: list[MicroBatch], temperature: float, routing, set_logprobs: bool):
    """One mini-batch of `recompute_old_logprobs` through the policy."""

    def keep(i: int, logprobs: torch.Tensor, _entropy):
        micro = micro_batches[i]
        if set_logprobs:
            micro.old_logprobs = torch.where(micro.response_mask, logprobs.float(), 0.0)
        return logprobs.new_zeros(()), {}

    passing = routing.old_pass(micro_batches) if routing is not None else contextlib.nullcontext([])
    with passing as hooks:
        run_micro_batches(
            model,
            [micro.packed for micro in micro_batches],
            keep,
            forward_only=True,
            temperature=temperature,
            hooks=hooks,
        )


def dp_group():
    """Megatron's data-parallel group (the KL controller and advantage whitening reduce over it)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


# Globally normalised losses: a mini-batch's loss is the SUM of its micro-batch losses over DP ranks.
_SUMMED_KEYS = frozenset({"actor/pg_loss", "actor/kl_loss"})
# Per-token means weighted by the micro-batch's response tokens (`_TOKENS`), so the step's value is
# the mean over all its tokens whatever the split.
_TOKEN_WEIGHTED_KEYS = frozenset({"actor/kl_ref"})
_TOKENS = "_response_tokens"


def _reduce_metrics(
    per_micro: list[dict[str, torch.Tensor]], num_mini_batches: int, group
) -> dict[str, float]:
    """One value per metric for the step, one collective per kind.

    Losses (`_SUMMED_KEYS`) are summed over micro-batches and DP ranks and averaged over
    mini-batches; `*_max` / `*_min` keys take the max / min; `_TOKEN_WEIGHTED_KEYS` (and their
    `_first_mb` / `_later_mbs` forms) are means over all response tokens when the micro-batches
    carry their token count (`_TOKENS`); the rest are means of the micro-batch statistics over
    micro-batches and DP ranks.
    """
    if not per_micro:
        return {}
    out = _token_weighted(per_micro, group)
    keys = sorted(k for k in per_micro[0] if k not in out and k != _TOKENS)
    device = compute_device()
    stacked = {k: torch.stack([m[k].to(device, torch.float32) for m in per_micro]) for k in keys}
    kinds = {
        "max": [k for k in keys if k.endswith("_max")],
        "min": [k for k in keys if k.endswith("_min")],
        "sum": [k for k in keys if k in _SUMMED_KEYS],
    }
    kinds["mean"] = [k for k in keys if not any(k in names for names in kinds.values())]
    reducers = {
        "max": torch.amax,
        "min": torch.amin,
        "sum": lambda v: v.sum() / num_mini_batches,
        "mean": torch.mean,
    }
    ops = {
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
    }
    for kind, names in kinds.items():
        if not names:
            continue
        values = torch.stack([reducers[kind](stacked[k]) for k in names])
        all_reduce(values, op=ops[kind], group=group)
        if kind == "mean" and dist.is_initialized():
            values /= dist.get_world_size(group)
        out.update({k: float(v) for k, v in zip(names, values)})
    return out


def _token_weighted(per_micro: list[dict[str, torch.Tensor]], group) -> dict[str, float]:
    """The token-weighted means of `_reduce_metrics` (one collective)."""
    if _TOKENS not in per_micro[0]:
        return {}
    keys = sorted(k for k in per_micro[0] if k.startswith(tuple(_TOKEN_WEIGHTED_KEYS)))
    if not keys:
        return {}
    device = compute_device()
    tokens = torch.stack([m[_TOKENS].to(device, torch.float64) for m in per_micro])
    sums = [torch.stack([m[k].to(device, torch.float64) for m in per_micro]).mul(tokens).sum() for k in keys]
    totals = torch.stack([*sums, tokens.sum()])
    all_reduce(totals, group=group)
    return {k: float(totals[i] / totals[-1]) for i, k in enumerate(keys)}


def _correction_weights(
    plan: list[list[MicroBatch]], algo: AlgorithmConfig
) -> tuple[list[list[torch.Tensor]] | None, list[dict[str, torch.Tensor]]]:
    """The rollout correction's [B, T] loss weights per micro-batch of `plan`, and their metrics.

    pi_old and pi_rollout stay fixed during the step, so the weights are computed once and
    reused by every mini-batch's pass. None (and no metrics) when the correction is off.
    """
    correction = algo.rollout_correction.build()
    if not correction.enabled:
        return None, []
    if algo.old_logprobs != "recompute":
        raise ValueError(
            "algorithm.rollout_correction needs algorithm.old_logprobs=recompute (pi_old = the trainer's "
            "forward on the rollout weights)"
        )
    weights, metrics = [], []
    for micro_batches in plan:
        weights.append([])
        for micro in micro_batches:
            w, values = correction.weights(micro.old_logprobs, micro.rollout_logprobs, micro.response_mask)
            weights[-1].append(w)
            metrics.append(values)
    return weights, metrics


_BY_PHASE = ("actor/clipfrac_seq", "actor/kl_ref")


def _by_phase(per_micro: list[dict[str, torch.Tensor]], first_count: int, group) -> dict[str, float]:
    """`actor/clipfrac_seq` (and `actor/kl_ref`, KL loss) of the first mini-batch and of the later ones.

    The first mini-batch trains on the rollout weights, so its clipped responses measure pi_old's
    gap to the trainer (the rollout/trainer mismatch with `old_logprobs=rollout`, 0 with
    `recompute`); the later ones add the policy's own drift. On the first step's first
    mini-batch the policy still equals the reference, so `actor/kl_ref_first_mb` is 0 there.
    `_later_mbs` keys are absent with one mini-batch.
    """
    keys = [k for k in _BY_PHASE if per_micro and k in per_micro[0]]
    extra = [_TOKENS] if per_micro and _TOKENS in per_micro[0] else []

    def phase(m: dict, suffix: str) -> dict:
        return {**{f"{k}{suffix}": m[k] for k in keys}, **{k: m[k] for k in extra}}

    first = [phase(m, "_first_mb") for m in per_micro[:first_count]]
    later = [phase(m, "_later_mbs") for m in per_micro[first_count:]]
    return {**_reduce_metrics(first, 1, group), **_reduce_metrics(later, 1, group)}


def train_on_batch(
    model,
    optimizer,
    scheduler,
    plan: list[list[MicroBatch]],
    algo: AlgorithmConfig,
    *,
    temperature: float,
    max_response_length: int,
    nan_loss: bool = False,
    routing=None,
) -> dict[str, float]:
    """One optimizer step per mini-batch of `plan`; returns the step's reduced metrics.

    Args:
        model: the DDP-wrapped policy.
        optimizer: megatron optimizer.
        scheduler: its LR scheduler.
        plan: from `plan_mini_batches` (old log-probs, and with the KL loss ref log-probs, set).
        algo: loss type, options, aggregation, KL loss and `ppo_epochs` (passes over `plan`).
        temperature: sampling temperature of the rollouts.
        max_response_length: the constant L of `seq-mean-token-sum-norm`.
        nan_loss: multiply the first mini-batch's loss by NaN (fault injection for tests).
        routing: a `StepRouting` (routing replay and drift capture around each forward/backward).

    Returns:
        `actor/*` loss metrics (with `actor/clipfrac_seq_first_mb` / `_later_mbs`; with the KL
        loss `actor/kl_loss`, `actor/kl_ref` and its `_first_mb` / `_later_mbs`),
        `train/grad_norm` (mean over taken steps), `train/lr`, `train/optimizer_steps`,
        `train/skipped_steps` (non-finite, weights untouched), the rollout correction's
        `rollout_corr/*` when it is on and, unless pi_old was recomputed, the rollout/trainer
        log-prob mismatch (`_Mismatch`).
    """
    group, device = dp_group(), compute_device()
    mode = algo.loss_agg_mode or "seq-mean-token-mean"
    norm_kwargs = {"max_response_length": max_response_length} if mode == "seq-mean-token-sum-norm" else {}
    mismatch = _Mismatch(device) if algo.old_logprobs == "rollout" else None
    weights, correction_metrics = _correction_weights(plan, algo)
    per_micro: list[dict[str, torch.Tensor]] = []
    first_mb_count = 0
    grad_norms, skipped = [], 0
    passes = [(epoch, m, mbs) for epoch in range(algo.ppo_epochs) for m, mbs in enumerate(plan)]
    for epoch, m, micro_batches in passes:
        shares = [
            compute_loss_normalizer(mb.response_mask, mode, **norm_kwargs).to(device) for mb in micro_batches
        ]
        normalizer = torch.stack(shares).double().sum()
        all_reduce(normalizer, group=group)
        zero_grads(model, optimizer)

        first = epoch == 0 and m == 0

        def loss_fn(
            j, logprobs, entropy, m=m, first=first, micro_batches=micro_batches, normalizer=normalizer
        ):
            nonlocal first_mb_count
            micro = micro_batches[j]
            if first and mismatch is not None:
                mismatch.add(logprobs, micro)
            loss, metrics = compute_policy_loss(
                algo.loss_type,
                logprobs,
                micro.old_logprobs,
                micro.advantages,
                micro.response_mask,
                loss_agg_mode=mode,
                normalizer=normalizer,
                allow_token_sum_for_gspo=algo.allow_token_sum_for_gspo,
                token_weights=None if weights is None else weights[m][j],
                **policy_loss_options(algo),
            )
            if algo.use_kl_loss:
                kl_loss, kl_metrics = compute_kl_loss(
                    logprobs,
                    micro.ref_logprobs,
                    micro.response_mask,
                    coef=algo.kl_loss_coef,
                    loss_agg_mode=mode,
                    normalizer=normalizer,
                    estimator=algo.kl_estimator,
                )
                loss = loss + kl_loss
                metrics.update(kl_metrics)
                metrics[_TOKENS] = micro.response_mask.sum()
            if nan_loss and first:
                loss = loss * math.nan
            metrics["actor/entropy"] = entropy[micro.response_mask].mean()
            per_micro.append(metrics)
            first_mb_count += first
            return loss * dp_loss_scale(), metrics

        aux = AuxLossWeights([aux_loss_scale(share, normalizer, dp_loss_scale()) for share in shares])
        passing = routing.train_pass(m, micro_batches) if routing is not None else contextlib.nullcontext([])
        with passing as hooks:  # replay keyed by micro-batch, in its forward and its backward recompute
            run_micro_batches(
                model,
                [micro.packed for micro in micro_batches],
                loss_fn,
                forward_only=False,
                temperature=temperature,
                with_entropy=True,
                hooks=[aux, *hooks],
            )
        stepped, grad_norm = optimizer_step(model, optimizer, scheduler)
        if stepped:
            grad_norms.append(grad_norm)
        else:
            skipped += 1
    gather_params(model)  # the step ends with whole weights: sync, export and save read them next
    out = {}
    if is_last_stage(model):  # losses, log-probs and pi_old live on the last pipeline stage
        out = _reduce_metrics(per_micro, len(passes), group)
        out.update(_by_phase(per_micro, first_mb_count, group))
        out.update(_reduce_metrics(correction_metrics, 1, group))
        if mismatch is not None:
            out.update(mismatch.reduce(group))
    out = share_from_last_stage(out)
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
    out["train/grad_norm_max"] = max(grad_norms) if grad_norms else math.nan
    out["train/optimizer_steps"] = float(len(grad_norms))
    out["train/skipped_steps"] = float(skipped)
    out["train/lr"] = float(optimizer.param_groups[0]["lr"])
    if routing is not None:
        out.update(routing.step_metrics())
    return out


def recompute_and_measure(
    model, plan: list[list[MicroBatch]], temperature: float, *, routing=None, reference=None
) -> dict[str, float]:
    """`recompute_old_logprobs`, and the rollout/trainer mismatch it reveals (before any update)."""
    recompute_old_logprobs(model, plan, temperature, routing=routing, reference=reference)
    out = {}
    if is_last_stage(model):
        mismatch = _Mismatch(compute_device())
        for micro_batches in plan:
            for micro in micro_batches:
                mismatch.add(micro.old_logprobs, micro)
        out = mismatch.reduce(dp_group())
    return share_from_last_stage(out)
