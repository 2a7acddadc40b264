"""Cold-start SFT: a short supervised phase that gives RL a policy with non-trivial accuracy.

As the GSPO paper starts RL from a cold-start model, the demo first teaches the random
policy the task's format and some of its answers: loss = mean NLL of the answer + EOS tokens
given BOS + prompt, over the global batch, on the same Megatron model, DDP and optimizer
machinery as RL (its own optimizer and schedule).
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_gspo.config import SFTConfig
from megatron_gspo.model.optim import OptimConfig, build_optimizer, dp_loss_scale, optimizer_step, zero_grads
from megatron_gspo.tasks import PromptStream, Task, sft_batches
from megatron_gspo.tasks.tokenizer import encode_prompt, encode_text
from megatron_gspo.training.forward import forward_microbatch, pack_uniform
from megatron_gspo.training.micro_batching import DataLayout

logger = logging.getLogger(__name__)


def sft_example_ids(
    tokenizer, prompt: str, target: str, *, add_bos: bool, chat_template: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N], target mask [N] bool) of BOS + prompt + target + EOS; the mask covers target + EOS.

    The prompt is encoded as the rollouts encode it (`encode_prompt`, chat template included).
    """
    head = encode_prompt(tokenizer, prompt, add_bos=add_bos, chat_template=chat_template)
    tail = encode_text(tokenizer, target) + [tokenizer.eos_token_id]
    tokens = torch.tensor(head + tail, dtype=torch.long)
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    mask[len(head) :] = True
    return tokens, mask


def run_sft(
    model, task: Task, tokenizer, cfg: SFTConfig, layout: DataLayout, *, add_bos: bool = True
) -> dict:
    """Train `model` (DDP-wrapped) for `cfg.steps` SFT steps; returns {"sft/loss", "sft/seconds"}.

    Every rank draws the same global batch (seeded stream) and keeps rows `dp_rank::dp_size`;
    the NLL is divided by the global number of target tokens.
    """
    optimizer, scheduler = build_optimizer(
        model,
        OptimConfig(lr=cfg.lr, lr_warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 0)), clip_grad=1.0),
        total_steps=cfg.steps,
    )
    batches = sft_batches(PromptStream(task, cfg.batch_size, seed=cfg.seed))
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(cfg.steps):
        examples = [
            sft_example_ids(tokenizer, p, t, add_bos=add_bos, chat_template=task.chat_template)
            for p, t in next(batches)
        ]
        total_targets = sum(int(mask.sum()) for _, mask in examples)
        mine = examples[layout.dp_rank :: layout.dp_size]
        packed = pack_uniform(
            [tokens for tokens, _ in mine], pad_multiple=layout.pad_multiple, layout=layout.packing
        )
        zero_grads(model, optimizer)
        logprobs, _ = forward_microbatch(model, packed)
        mask = torch.zeros(logprobs.shape, dtype=torch.bool)  # built on the host, moved once
        for row, (_, target_mask) in enumerate(mine):
            mask[row, : len(target_mask)] = target_mask
        mask = mask.to(logprobs.device)
        nll = -(logprobs * mask).sum() / total_targets
        (nll * dp_loss_scale()).backward()
        stepped, _ = optimizer_step(model, optimizer, scheduler)
        loss_value = float(nll.detach()) * layout.dp_size  # this rank's share, rescaled (logged only)
        if not stepped:
            logger.warning("SFT step %d skipped: non-finite gradients", step)
        if step % 50 == 0 or step == cfg.steps - 1:
            logger.info("SFT step %d/%d: loss %.4f (rank-local estimate)", step + 1, cfg.steps, loss_value)
    return {"sft/loss": loss_value, "sft/seconds": time.perf_counter() - start}
