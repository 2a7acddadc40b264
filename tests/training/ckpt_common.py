"""A tiny but real training run for the checkpoint tests: model, Adam, LR schedule, data, RNG use.

Each step draws the next prompt batch from a `PromptStream` (its position is trainer state),
shuffles it with the torch CPU generator and drops one sample (so the losses depend on the RNG
state), computes a masked negative log-likelihood of the answers split over data-parallel ranks
(through megatron's schedule, so pipeline layouts run it too), and takes one optimizer step.
Loss values also feed a `RunningMeanStd` (more trainer state).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron_gspo.algorithms.running_stats import RunningMeanStd
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import MoEModelConfig, tiny
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.engine import EngineConfig
from megatron_gspo.model.optim import (
    OptimConfig,
    build_optimizer,
    dp_loss_scale,
    optimizer_step,
    wrap_ddp,
    zero_grads,
)
from megatron_gspo.model.packing import pack_sequences, packing_layout, pad_to_shape, uniform_shape
from megatron_gspo.model.pipeline import run_micro_batches, share_from_last_stage
from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.tasks.data import PromptStream
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

# On CPU the tracker's streams are CPU generator states, so megatron's check that a fork leaves
# the CPU generator alone always fires; it is expected here.
logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)

TOKENIZER = build_char_tokenizer()
BATCH = 8


@dataclass
class Run:
    model_cfg: MoEModelConfig
    model: torch.nn.Module
    ddp: torch.nn.Module
    optimizer: object
    scheduler: object
    stream: PromptStream
    stats: RunningMeanStd
    step: int = 0

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "weight_version": self.step,
            "data": self.stream.state_dict(),
            "loss_stats": self.stats.state_dict(),
            "config": {"batch": BATCH, "lr": 1e-2},
        }

    def load_trainer_state(self, state: dict) -> None:
        self.step = state["step"]
        self.stream.load_state_dict(state["data"])
        self.stats.load_state_dict(state["loss_stats"])


def build_run(
    parallel: ParallelConfig,
    *,
    init: bool = True,
    seed: int = 1234,
    dtype: str = "fp32",
    vocab_size: int = len(TOKENIZER),
    num_layers: int | None = None,
) -> Run:
    """The tiny run at `parallel`; `vocab_size` must divide by the TP size (the tokenizer has 79 tokens).

    `num_layers` overrides the tiny model's (a virtual pipeline needs PP x chunks of them).
    """
    if init:
        init_distributed(parallel, seed=seed)
    model_cfg = tiny(vocab_size=vocab_size, **({"num_layers": num_layers} if num_layers else {}))
    model = build_model(model_cfg, parallel, EngineConfig(dtype=dtype))
    ddp = wrap_ddp(model, distributed_optimizer=parallel.distributed_optimizer)
    optimizer, scheduler = build_optimizer(
        ddp,
        OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine", weight_decay=0.01),
        distributed_optimizer=parallel.distributed_optimizer,
        total_steps=10,
    )
    stream = PromptStream(AdditionTask(max_digits=3), batch_size=BATCH, seed=7)
    return Run(model_cfg, model, ddp, optimizer, scheduler, stream, RunningMeanStd())


def train_step(run: Run) -> dict:
    """One optimizer step; returns the global loss, grad norm and learning rate."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    problems = run.stream.next_batch()
    order = torch.randperm(len(problems))[: len(problems) - 1].tolist()
    seqs, masks = [], []
    for i in order:
        prompt = TOKENIZER.encode(problems[i].prompt)
        answer = TOKENIZER.encode(problems[i].answer) + [TOKENIZER.eos_token_id]
        seqs.append(torch.tensor([TOKENIZER.bos_token_id, *prompt, *answer]))
        masks.append(torch.arange(len(seqs[-1])) > len(prompt))
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(seqs), dp))
    total_tokens = sum(int(m.sum()) for m in masks)
    zero_grads(run.ddp, run.optimizer)
    kept = {}

    def loss_fn(i, logprobs, entropy):  # on the last pipeline stage
        mask = torch.zeros_like(logprobs)
        for row, j in enumerate(mine):
            mask[row, : len(masks[j])] = masks[j].float()
        local = -(logprobs * mask).sum() / total_tokens
        kept["loss"] = local.detach().clone()
        return local * dp_loss_scale(), {}

    run_micro_batches(run.ddp, [packed_batch(run.ddp, [seqs[i] for i in mine])], loss_fn, forward_only=False)
    stepped, grad_norm = optimizer_step(run.ddp, run.optimizer, run.scheduler)
    assert stepped
    loss = kept.get("loss")
    if loss is not None:
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
    loss = share_from_last_stage(loss)
    run.stats.update(loss.reshape(1))
    run.step += 1
    return {"loss": loss.item(), "grad_norm": grad_norm, "lr": run.optimizer.param_groups[0]["lr"]}


def packed_batch(model: torch.nn.Module, seqs: list[torch.Tensor]):
    """`seqs` packed for `model` (rows a multiple of TP long), as `sequence_logprobs` packs them."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    packed = pack_sequences(seqs, layout=packing_layout(model), pad_multiple=tp)
    return pad_to_shape(packed, *uniform_shape(packed))


def draw_probes() -> dict:
    """One draw from every random stream a resumed run must continue exactly."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracker = torch.randn(3)
    return {
        "torch": torch.randn(4),
        "numpy": np.random.rand(3),
        "python": random.random(),
        "tracker": tracker,
    }


def save_run(run: Run, root, **kwargs):
    """`save_checkpoint` of everything `run` holds, at its current step."""
    from megatron_gspo.checkpoint.save import save_checkpoint

    return save_checkpoint(
        root,
        run.step,
        model=run.ddp,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=run.trainer_state(),
        model_cfg=run.model_cfg,
        tokenizer=TOKENIZER,
        **kwargs,
    )


def load_run(run: Run, root, **kwargs):
    """`load_checkpoint` into `run`'s model, optimizer and scheduler."""
    from megatron_gspo.checkpoint.load import load_checkpoint

    return load_checkpoint(root, model=run.ddp, optimizer=run.optimizer, scheduler=run.scheduler, **kwargs)
