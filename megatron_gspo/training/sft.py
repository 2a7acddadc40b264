"""Cold-start SFT: a short supervised phase that gives RL a policy with non-trivial accuracy.

As the GSPO paper starts RL from a cold-start model, the demo first teaches the random
policy the task's format and some of its answers: loss = mean NLL of the answer + EOS tokens
given BOS + prompt, over the global batch, on the same Megatron model, DDP and optimizer
machinery as RL (its own optimizer and schedule).

How far SFT gets in a fixed number of steps depends a lot on the weight init (the demo's
cold start ranged 0.1-0.45 held-out accuracy over seeds), so `sft.target_accuracy` stops it
once the held-out greedy accuracy, measured with the trainer's own model every
`sft.check_every` steps, reaches the target; `sft.steps` is then the cap. At SFT's learning
rate one check is noisy (accuracy swings by ~0.1 between checks 10 steps apart), and stopping
at the first lucky one starts RL from a weaker policy than its accuracy says, so the target
applies to the mean of the last `sft.target_window` checks.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_gspo.config import SFTConfig
from megatron_gspo.model.distributed import compute_device
from megatron_gspo.model.generate import greedy_generate
from megatron_gspo.model.optim import (
    OptimConfig,
    build_optimizer,
    dp_loss_scale,
    gather_params,
    optimizer_step,
    zero_grads,
)
from megatron_gspo.model.pipeline import run_micro_batches, share_from_last_stage
from megatron_gspo.tasks import Problem, PromptStream, Task, sft_batches
from megatron_gspo.tasks.tokenizer import encode_prompt, encode_text, problem_prompt_ids
from megatron_gspo.training.step.forward import pack_uniform
from megatron_gspo.training.step.micro_batches import DataLayout

logger = logging.getLogger(__name__)


def sft_example_ids(
    tokenizer, prompt, target: str, *, add_bos: bool, chat_template: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N], target mask [N] bool) of BOS + prompt + target + EOS; the mask covers target + EOS.

    The prompt (text or chat messages) is encoded as the rollouts encode it (`encode_prompt`,
    chat template included).
    """
    head = encode_prompt(tokenizer, prompt, add_bos=add_bos, chat_template=chat_template)
    tail = encode_text(tokenizer, target) + [tokenizer.eos_token_id]
    tokens = torch.tensor(head + tail, dtype=torch.long)
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    mask[len(head) :] = True
    return tokens, mask


def heldout_accuracy(
    model,
    task: Task,
    tokenizer,
    problems: Sequence[Problem],
    layout: DataLayout,
    *,
    max_new_tokens: int,
    add_bos: bool = True,
) -> float:
    """Greedy exact-match accuracy of the trainer's model on `problems` (collective, no rollout server).

    Each data-parallel rank decodes `problems[dp_rank::dp_size]`; the correct counts are summed
    over the data-parallel group, so every rank returns the same accuracy.
    """
    mine = list(problems[layout.dp_rank :: layout.dp_size])
    prompts = [
        problem_prompt_ids(tokenizer, p, add_bos=add_bos, chat_template=task.chat_template) for p in mine
    ]
    outputs = greedy_generate(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_multiple=layout.pad_multiple,
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    correct = sum(task.judge_batch(mine, texts)[1])
    total = torch.tensor([float(correct)], device=compute_device())
    if layout.dp_size > 1:
        from megatron.core import parallel_state as ps

        dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total.item()) / len(problems)


def run_sft(
    model,
    task: Task,
    tokenizer,
    cfg: SFTConfig,
    layout: DataLayout,
    *,
    add_bos: bool = True,
    heldout: Sequence[Problem] = (),
    max_new_tokens: int = 0,
) -> dict:
    """Train `model` (DDP-wrapped) for up to `cfg.steps` SFT steps; returns the `sft/*` metrics.

    Every rank draws the same global batch (seeded stream) and keeps rows `dp_rank::dp_size`;
    the NLL is divided by the global number of target tokens. With `cfg.target_accuracy`, the
    greedy accuracy on `heldout` (answers of at most `max_new_tokens`) is measured every
    `cfg.check_every` steps and at the last step, and training stops once the mean of the last
    `cfg.target_window` checks reaches the target.

    Returns:
        {"sft/loss", "sft/seconds", "sft/steps"}, plus with a target {"sft/accuracy" (the last
        check), "sft/accuracy_window" (the mean of the last `target_window` checks),
        "sft/hit_cap" (1.0 when `cfg.steps` ran out first), "sft/eval_seconds"}.
    """
    target = cfg.target_accuracy
    if target is not None and (not heldout or max_new_tokens < 1):
        raise ValueError("sft.target_accuracy needs held-out problems and max_new_tokens >= 1 to measure it")
    optimizer, scheduler = build_optimizer(
        model,
        OptimConfig(lr=cfg.lr, lr_warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 0)), clip_grad=1.0),
        total_steps=cfg.steps,
    )
    batches = sft_batches(PromptStream(task, cfg.batch_size, seed=cfg.seed))
    start = time.perf_counter()
    loss_value = float("nan")
    out: dict[str, float] = {}
    eval_seconds, steps_run = 0.0, 0
    window: collections.deque[float] = collections.deque(maxlen=cfg.target_window)
    for step in range(cfg.steps):
        loss_value = _sft_step(model, optimizer, scheduler, next(batches), task, tokenizer, layout, add_bos)
        steps_run = step + 1
        if step % 50 == 0 or steps_run == cfg.steps:
            logger.info("SFT step %d/%d: loss %.4f (rank-local estimate)", steps_run, cfg.steps, loss_value)
        if target is None or (steps_run % cfg.check_every and steps_run != cfg.steps):
            continue
        t0 = time.perf_counter()
        accuracy = heldout_accuracy(
            model, task, tokenizer, heldout, layout, max_new_tokens=max_new_tokens, add_bos=add_bos
        )
        eval_seconds += time.perf_counter() - t0
        window.append(accuracy)
        mean = sum(window) / len(window)
        reached = len(window) == window.maxlen and mean >= target
        out = {"sft/accuracy": accuracy, "sft/accuracy_window": mean, "sft/hit_cap": float(not reached)}
        logger.info(
            "SFT step %d: held-out accuracy %.3f, mean of the last %d checks %.3f (target %.3f)",
            steps_run, accuracy, len(window), mean, target,
        )  # fmt: skip
        if reached:
            break
    gather_params(model)  # whole weights for the export / sync that follows the cold start
    if out.get("sft/hit_cap"):
        logger.warning(
            "SFT hit its cap sft.steps=%d at held-out accuracy %.3f (mean of the last checks %.3f), "
            "short of sft.target_accuracy=%.3f",
            cfg.steps, out["sft/accuracy"], out["sft/accuracy_window"], target,
        )  # fmt: skip
    if target is not None:
        out["sft/eval_seconds"] = eval_seconds
    return {
        "sft/loss": loss_value,
        "sft/seconds": time.perf_counter() - start,
        "sft/steps": float(steps_run),
        **out,
    }


def _sft_step(
    model, optimizer, scheduler, batch, task: Task, tokenizer, layout: DataLayout, add_bos: bool
) -> float:
    """One optimizer step on a global batch of (prompt, target) pairs; returns the rank-local loss."""
    examples = [
        sft_example_ids(tokenizer, p, t, add_bos=add_bos, chat_template=task.chat_template) for p, t in batch
    ]
    total_targets = sum(int(mask.sum()) for _, mask in examples)
    mine = examples[layout.dp_rank :: layout.dp_size]
    packed = pack_uniform(
        [tokens for tokens, _ in mine], pad_multiple=layout.pad_multiple, layout=layout.packing
    )
    zero_grads(model, optimizer)
    nll = {}

    def loss_fn(_i, logprobs, _entropy):
        mask = torch.zeros(logprobs.shape, dtype=torch.bool)  # built on the host, moved once
        for row, (_, target_mask) in enumerate(mine):
            mask[row, : len(target_mask)] = target_mask
        nll["value"] = -(logprobs * mask.to(logprobs.device)).sum() / total_targets
        return nll["value"] * dp_loss_scale(), {}

    run_micro_batches(model, [packed], loss_fn, forward_only=False)  # the loss lives on the last stage
    stepped, _ = optimizer_step(model, optimizer, scheduler)
    if not stepped:
        logger.warning("SFT step skipped: non-finite gradients")
    local = float(nll["value"].detach()) * layout.dp_size if "value" in nll else math.nan
    return share_from_last_stage(local)  # this rank's share, rescaled (logged only)
