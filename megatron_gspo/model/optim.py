"""Megatron's training machinery around the policy: DDP, optimizer, LR schedule, one step.

Gradient reduction convention: megatron's DDP *averages* gradients over data-parallel
ranks (dense and expert parameters alike). A loss that must equal the unsplit mini-batch's
loss is therefore computed on each rank as `local_sum / global_normaliser * dp_size`
(`dp_loss_scale`): the average over ranks is then exactly the global-batch loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.model.chunks import model_chunks
from megatron_gspo.model.distributed import all_reduce, compute_device


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = "adam"
    """adam (AdamW-style decoupled weight decay, megatron's default) or sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine (megatron's OptimizerParamScheduler)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    optimizer_cpu_offload: bool = False
    """Megatron-Core's HybridDeviceOptimizer: the Adam states (and fp32 main weights) of
    `optimizer_offload_fraction` of the parameters live and step in host memory (pinned), the
    rest on the GPU. Needs CUDA (it builds CUDA streams) and `optim.optimizer: adam`."""
    optimizer_offload_fraction: float = 1.0
    """Share of the parameters (by count) whose optimizer steps on the host, in [0, 1]."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Copy gradients to the host and updated weights back on side CUDA streams, overlapped with
    the host's Adam (optimizer_cpu_offload only)."""
    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer (main weights and Adam moments may be kept in lower
    precision; here fp32 throughout). Needs `parallel.distributed_optimizer` and adam, and either
    TransformerEngine's FusedAdam or `optimizer_cpu_offload`."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"optim.lr_decay_style must be constant, linear or cosine, got {self.lr_decay_style!r}"
            )
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"optim.optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}"
            )
        if (self.optimizer_cpu_offload or self.use_precision_aware_optimizer) and self.optimizer != "adam":
            raise ValueError(
                "optim.optimizer_cpu_offload and optim.use_precision_aware_optimizer need "
                f"optim.optimizer=adam (megatron's CPU Adam), got {self.optimizer!r}"
            )
        if self.overlap_cpu_optimizer_d2h_h2d and not self.optimizer_cpu_offload:
            raise ValueError("optim.overlap_cpu_optimizer_d2h_h2d needs optim.optimizer_cpu_offload=true")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"optim needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}"
            )

    def check_hardware(self) -> None:
        """Refuse what this machine cannot run (kept out of `__post_init__`: GPU configs load anywhere).

        megatron's HybridDeviceOptimizer picks what to move by `param.is_cuda` and builds CUDA
        streams: with no CUDA parameter its host-side Adam has no GPU copies to map its
        gradients from, and its first step fails (KeyError in `_set_sub_optimizer_grads`).
        """
        if self.optimizer_cpu_offload and not torch.cuda.is_available():
            raise ValueError("optim.optimizer_cpu_offload needs CUDA (megatron's HybridDeviceOptimizer)")


def wrap_ddp(
    model: torch.nn.Module,
    *,
    distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    align_param_gather: bool = False,
) -> torch.nn.Module:
    """Wrap a megatron GPTModel in megatron's DistributedDataParallel (fp32 grad buffers).

    Virtual-pipeline chunks are wrapped one by one (`ModelChunks` of DDPs), the later ones
    unbucketed as megatron's `get_model` does. With overlap the schedule gets the hooks megatron's
    training loop gives it (`training.py`): `no_sync` around every micro-batch but the last (a
    bucket is reduced once, when the last one's backward fills it), each chunk's grad reduction
    started by the schedule under a pipeline, and with `align_param_gather` each chunk's parameter
    all-gather too. `ddp_options(parallel)` gives the keywords of a `ParallelConfig`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_gspo.model.chunks import ModelChunks

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        align_param_gather=align_param_gather,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,  # non-finite steps are detected and skipped by the caller
    )
    if isinstance(model, ModelChunks):
        wrapped = ModelChunks(
            DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(model)
        )
    else:
        wrapped = DistributedDataParallel(model.config, ddp_config, model)
    chunks = model_chunks(wrapped)
    config = chunks[0].config  # one TransformerConfig shared by every chunk

    def per_chunk(method: str):
        funcs = [getattr(chunk, method) for chunk in chunks]
        return funcs[0] if len(funcs) == 1 else funcs

    if overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        if config.pipeline_model_parallel_size > 1:  # megatron's align_grad_reduce (its default)
            config.grad_sync_func = per_chunk("start_grad_sync")
    if overlap_param_gather and align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    return wrapped


def ddp_options(parallel) -> dict[str, bool]:
    """`wrap_ddp`'s keywords for a `ParallelConfig` (distributed optimizer, communication overlap)."""
    return dict(
        distributed_optimizer=parallel.distributed_optimizer,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        align_param_gather=parallel.aligned_param_gather,
    )


def gather_params(ddp_model: torch.nn.Module) -> None:
    """Make every rank's parameters whole before they are read outside a forward (collective).

    With `overlap_param_gather` an optimizer step leaves each rank with its own shard updated and
    the all-gather to the next forward's pre-hooks, so weight sync, export and checkpoints would
    read the weights before the step elsewhere. Finishes each bucket's gather (waits for one in
    flight, runs one not started); nothing when none is pending or without the overlap, so the
    forward pre-hooks then find every bucket done.
    """
    for chunk in model_chunks(ddp_model):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.overlap_param_gather:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if not group.param_gather_dispatched or group.param_gather_handle is not None:
                group.start_param_sync(force_sync=True)


def build_optimizer(
    ddp_model: torch.nn.Module,
    cfg: OptimConfig,
    *,
    distributed_optimizer: bool | None = None,
    total_steps: int = 1,
):
    """`get_megatron_optimizer` + `OptimizerParamScheduler` for a DDP-wrapped model.

    `distributed_optimizer`: None takes the DDP wrapper's (its gradient buffers are reduce-scattered
    for a distributed optimizer, so another kind would step on unreduced shards); another value
    than the wrapper's is refused.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = ddp_model.config
    wrapped = model_chunks(ddp_model)[0].ddp_config.use_distributed_optimizer
    if distributed_optimizer is None:
        distributed_optimizer = wrapped
    elif distributed_optimizer != wrapped:
        raise ValueError(
            f"build_optimizer(distributed_optimizer={distributed_optimizer}) on a DDP model wrapped with "
            f"distributed_optimizer={wrapped}: its gradients are reduced for the other kind"
        )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=config.bf16,
            fp16=False,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
            optimizer_cpu_offload=cfg.optimizer_cpu_offload,
            optimizer_offload_fraction=cfg.optimizer_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
            use_precision_aware_optimizer=cfg.use_precision_aware_optimizer,
        ),
        model_chunks(ddp_model),
    )
    _use_foreach_kernels(optimizer)
    decay_steps = max(total_steps, cfg.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _use_foreach_kernels(optimizer) -> None:
    """Let torch's Adam/AdamW (megatron's fallback without TE/apex) update all tensors per kernel.

    torch picks its multi-tensor path by default on CUDA only; on CPU it would loop in Python
    over every parameter, a measurable share of a tiny model's step. (torch's fused CPU kernel is
    faster still in isolation, but it rounds differently: the demo's RL trajectories changed,
    ending 0.02-0.04 lower on 3 of 3 seeds, for no wall-time gain measurable over the run.)
    Fused TE/apex optimizers are left alone.
    """
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True


def zero_grads(ddp_model: torch.nn.Module, optimizer) -> None:
    """Clear the DDP grad buffers and the optimizer's main grads before a mini-batch."""
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


def grads_are_finite(ddp_model: torch.nn.Module) -> bool:
    """Whether every gradient on every rank is finite (collective over the world).

    Checks megatron DDP's contiguous grad buffers (every `main_grad` is a view into one), a
    few kernels instead of one per parameter; flags live on the compute device (NCCL reduces
    device tensors only) and are read after the reduction. A NaN/inf makes a buffer's norm
    NaN/inf, so finite norms on every rank clear the step with one reduction per buffer (0.29
    -> 0.03 ms per optimizer step on the demo model, no mask of the buffer's size); a norm that
    is not finite may also be the overflow of huge finite values, so then every rank (they
    all see the same reduced flag) looks at the values themselves.
    """
    grads = [grad for chunk in model_chunks(ddp_model) for grad in _grad_tensors(chunk)]
    norms = torch._foreach_norm(grads) if grads else []
    if _any_on_any_rank([(~torch.isfinite(torch.stack(norms))).any()] if norms else []):
        return not _any_on_any_rank([(~torch.isfinite(grad)).any() for grad in grads])
    return True


def _any_on_any_rank(flags: list[torch.Tensor]) -> bool:
    """Whether any of this rank's boolean device flags, or any other rank's, is set (collective)."""
    bad = torch.zeros(1, device=compute_device())
    for flag in flags:
        bad += flag
    all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() != 0.0


def _grad_tensors(ddp_model: torch.nn.Module) -> list[torch.Tensor]:
    buffers = getattr(ddp_model, "buffers", None)
    if isinstance(buffers, list):
        grads = [b.grad_data for b in buffers + ddp_model.expert_parallel_buffers]
        if all(g is not None for g in grads):
            return grads
    grads = []
    for param in ddp_model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            grads.append(grad)
    return grads


def optimizer_step(ddp_model: torch.nn.Module, optimizer, scheduler) -> tuple[bool, float]:
    """Reduce gradients across ranks, then step if they are finite.

    Returns (stepped, grad_norm). A non-finite gradient skips the step with the weights
    untouched (grad_norm is then NaN).
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks(ddp_model))
    if not grads_are_finite(ddp_model):
        return False, math.nan
    stepped, grad_norm, _ = optimizer.step()
    if stepped:
        scheduler.step(increment=1)
    return bool(stepped), float(grad_norm) if grad_norm is not None else math.nan


def dp_loss_scale() -> int:
    """Factor that turns a globally-normalised local loss into one megatron's DDP averages right."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()
