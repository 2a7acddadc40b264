"""Process groups for TP x PP x EP x DP: one entry point for torchrun workers and plain processes.

`init_distributed` applies the megatron-core runtime patches this machine needs, starts
torch.distributed (NCCL on GPUs, gloo on CPU), builds megatron's model-parallel groups and
seeds the model-parallel RNG tracker. Under torchrun it reads the usual RANK / WORLD_SIZE /
LOCAL_RANK variables that torchrun sets; a plain `python` process becomes a world of one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_gspo.model.control_plane import destroy_control_group, init_control_group

# Expected on CPU: megatron falls back to torch optimizers and local kernels without TE/apex.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")  # megatron's own default
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated.*")

# The run's MoE token dispatcher, recorded by `init_distributed` (read by `model/packing.py`).
_token_dispatcher = "allgather"  # until then: the dispatcher that needs equal shapes


@dataclass
class ParallelConfig:
    """How the policy is sharded. Data parallel size is whatever the world size leaves."""

    tensor_parallel: int = 1
    """Tensor-parallel size (attention heads, FFN columns, vocabulary split across ranks)."""
    expert_parallel: int = 1
    """Expert-parallel size (experts of each MoE layer split across ranks)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (consecutive transformer layers split into this many stages)."""
    first_stage_layers: int | None = None
    """Transformer layers on the first pipeline stage (megatron's `num_layers_in_first_pipeline_stage`);
    None: the stage gets its even share. The layers left are split evenly over the other stages."""
    last_stage_layers: int | None = None
    """Transformer layers on the last pipeline stage (megatron's `num_layers_in_last_pipeline_stage`);
    None: the stage gets its even share."""
    virtual_pipeline: int | None = None
    """Model chunks per pipeline stage (megatron's `virtual_pipeline_model_parallel_size`): stage s
    holds chunks of layers taken in turn, and the interleaved 1F1B schedule runs them, which
    shrinks the pipeline bubble by this factor. Every stage's layers must divide by it. None: one."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting (the first stage builds one layer fewer);
    megatron's flag of that name. Not combinable with first/last_stage_layers."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer when splitting (the last stage builds one layer
    fewer); megatron's flag of that name. Not combinable with first/last_stage_layers."""
    expert_tensor_parallel: int | None = None
    """Tensor-parallel size inside each expert (default: tensor_parallel, megatron's default)."""
    sequence_parallel: bool | None = None
    """Shard activations along the sequence between TP ranks (default: on when TP > 1; MoE needs it)."""
    context_parallel: int = 1
    """Context-parallel size: every packed sequence split over this many ranks (megatron's
    load-balanced 2·CP chunks, `model/context_parallel.py`), for long responses. Needs the
    TransformerEngine spec (its attention exchanges keys/values between the CP ranks) and THD
    packing; not with pipeline_parallel > 1."""
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """MoE token dispatcher. `flex` (DeepEP) is GPU-only and not offered here."""
    distributed_optimizer: bool = False
    """Shard optimizer states across data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket (all-reduce, or reduce-scatter with the distributed optimizer)
    as soon as the last micro-batch's backward fills it, under the rest of the backward (megatron's
    `--overlap-grad-reduce`)."""
    overlap_param_gather: bool = False
    """All-gather the updated parameters bucket by bucket under the next forward, not at the end of
    the optimizer step (megatron's `--overlap-param-gather`); needs distributed_optimizer and
    overlap_grad_reduce. Weight sync, export and checkpoints gather whatever is still pending first."""
    align_param_gather: bool | None = None
    """Under a virtual pipeline, start every chunk's parameter all-gather from the schedule, on all
    pipeline stages at once (megatron's `--align-param-gather`); null: on with overlap_param_gather
    and virtual_pipeline."""
    make_vocab_size_divisible_by: int = 1
    """The vocabulary is padded to a multiple of this x tensor_parallel, as megatron's
    `--make-vocab-size-divisible-by` (megatron-LM's default: 128). Padded rows are never sampled
    or counted in log-probs, and export and weight sync leave them out."""
    timeout_minutes: float = 120.0
    """How long a collective may wait before the job is aborted (the process group and the gloo
    control group; megatron's `--distributed-timeout-minutes`). Long: rank 0 may wait this long
    for rollouts or an export while the other ranks block."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "expert_parallel",
            "make_vocab_size_divisible_by",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_pipeline is not None and (self.virtual_pipeline < 2 or self.pipeline_parallel < 2):
            raise ValueError(
                f"parallel.virtual_pipeline={self.virtual_pipeline} needs parallel.pipeline_parallel >= 2 "
                "and at least 2 chunks per stage (null: no virtual pipeline)"
            )
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"parallel.token_dispatcher must be alltoall or allgather, got {self.token_dispatcher!r}"
            )
        if not math.isfinite(self.timeout_minutes) or self.timeout_minutes <= 0:
            raise ValueError(
                f"parallel.timeout_minutes must be a finite number > 0, got {self.timeout_minutes!r}"
            )
        if self.context_parallel < 1:
            raise ValueError(f"parallel.context_parallel must be >= 1, got {self.context_parallel}")
        if self.context_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError(
                f"parallel.context_parallel={self.context_parallel} with pipeline_parallel="
                f"{self.pipeline_parallel}: context parallelism is supported without pipeline stages only"
            )
        self._check_overlap()
        if self.sequence_parallel is False and self.tensor_parallel > 1:
            raise ValueError(
                "MoE training with tensor_parallel > 1 requires sequence_parallel (megatron-core)"
            )
        if self.token_dispatcher == "allgather" and self.pipeline_parallel > 1:
            # Stages exchange micro-batches of varying length (`variable_seq_lengths`), which
            # megatron-core's allgather dispatcher refuses at model build.
            raise ValueError(
                f"parallel.token_dispatcher=allgather with pipeline_parallel={self.pipeline_parallel}: "
                "megatron-core's allgather dispatcher does not support the variable sequence lengths "
                "pipeline stages exchange; use parallel.token_dispatcher=alltoall"
            )

    def _check_overlap(self) -> None:
        """Megatron's own constraints on communication overlap (its `validate_args`), by name."""
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError(
                "parallel.overlap_param_gather needs parallel.distributed_optimizer=true (only the "
                "distributed optimizer leaves parameters to gather)"
            )
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError(
                "parallel.overlap_param_gather needs parallel.overlap_grad_reduce=true (as in megatron)"
            )
        if self.align_param_gather and not (self.overlap_param_gather and self.virtual_pipeline):
            raise ValueError(
                "parallel.align_param_gather=true applies to overlap_param_gather under a virtual pipeline "
                "(parallel.virtual_pipeline); set it to null"
            )

    @property
    def aligned_param_gather(self) -> bool:
        """`align_param_gather`, resolved (on with overlap_param_gather under a virtual pipeline)."""
        if self.align_param_gather is not None:
            return self.align_param_gather
        return self.overlap_param_gather and self.virtual_pipeline is not None

    def padded_vocab_size(self, vocab_size: int) -> int:
        """`vocab_size` rounded up to a multiple of make_vocab_size_divisible_by x tensor_parallel."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_parallel
        return -(-vocab_size // multiple) * multiple

    @property
    def use_sequence_parallel(self) -> bool:
        """Sequence parallelism, resolved (on exactly when TP > 1 unless set)."""
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def pad_multiple(self) -> int:
        """Every packed sequence's length multiple: TP under sequence parallelism, x 2·CP with CP."""
        tp = self.tensor_parallel if self.use_sequence_parallel else 1
        return tp * (2 * self.context_parallel if self.context_parallel > 1 else 1)

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size, resolved."""
        return self.expert_tensor_parallel or self.tensor_parallel

    def check_world_size(self, world_size: int) -> int:
        """Validate the layout against a world size; returns the data-parallel size.

        Megatron lays out world = TP x PP x DP for dense parts and world = ETP x EP x PP x
        expert-DP for experts: both products must divide the world.
        """
        model_group = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if world_size % model_group:
            product = (
                f"tensor_parallel x pipeline_parallel = {self.tensor_parallel} x {self.pipeline_parallel}"
            )
            if self.context_parallel > 1:
                product = product.replace(" =", " x context_parallel =") + f" x {self.context_parallel}"
            raise ValueError(f"world size {world_size} is not divisible by {product}")
        expert_group = self.expert_tp * self.expert_parallel * self.pipeline_parallel
        if world_size % expert_group:
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tensor_parallel x expert_parallel x "
                f"pipeline_parallel = {self.expert_tp} x {self.expert_parallel} x {self.pipeline_parallel}"
            )
        return world_size // model_group

    def check_num_layers(self, num_layers: int) -> None:
        """Refuse a pipeline split megatron-core would refuse (`chunk_layers` says why)."""
        self.chunk_layers(num_layers)

    def chunk_layers(self, num_layers: int) -> list[list[tuple[int, int]]]:
        """(first global layer, layers) of every model chunk of every stage: `[stage][chunk]`.

        Without a virtual pipeline each stage is one chunk. With V chunks per stage, chunk c of
        stage s holds 1/V of the stage's layers, and the chunks are taken in turn: all stages'
        chunk 0 first, then chunk 1 (megatron's `get_transformer_layer_offset`; tested against it).

        Raises:
            ValueError: naming the `parallel.*` key when a stage's layers do not split into chunks.
        """
        stages = self.stage_layers(num_layers)
        chunks = self.virtual_pipeline or 1
        if chunks > 1 and (
            self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        ):
            raise ValueError(
                "parallel.virtual_pipeline with parallel.account_for_*_in_pipeline_split is not supported; "
                "set parallel.first_stage_layers / last_stage_layers instead"
            )
        for s, n in enumerate(stages):
            if n % chunks:
                raise ValueError(
                    f"parallel.virtual_pipeline={chunks} does not divide the {n} layers of pipeline "
                    f"stage {s} (stages: {stages})"
                )
        per_round = num_layers // chunks  # layers of one chunk on every stage together
        return [
            [(c * per_round + sum(stages[:s]) // chunks, n // chunks) for c in range(chunks)]
            for s, n in enumerate(stages)
        ]

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers of each pipeline stage, first to last, as megatron-core splits them.

        Mirrors `megatron.core.transformer.transformer_block.get_num_layers_to_build` (checked
        against it in tests): with first/last_stage_layers those stages hold that many and the
        stages between share the rest evenly; with the embedding / loss accounted, every stage
        holds (layers + accounted) / PP and the first / last builds one fewer; else an even split.

        Raises:
            ValueError: naming the `parallel.*` key when megatron could not build the split.
        """
        pp = self.pipeline_parallel
        uneven = {"first_stage_layers": self.first_stage_layers, "last_stage_layers": self.last_stage_layers}
        accounted = {
            "embedding": self.account_for_embedding_in_pipeline_split,
            "loss": self.account_for_loss_in_pipeline_split,
        }
        set_uneven = {k: v for k, v in uneven.items() if v is not None}
        if pp == 1:
            if set_uneven or any(accounted.values()):
                keys = [f"parallel.{k}" for k in set_uneven] + [
                    f"parallel.account_for_{k}_in_pipeline_split" for k, on in accounted.items() if on
                ]
                raise ValueError(
                    f"{', '.join(keys)} set with parallel.pipeline_parallel=1: there is one stage"
                )
            return [num_layers]
        if set_uneven and any(accounted.values()):
            raise ValueError(
                "parallel.first_stage_layers / last_stage_layers and "
                "parallel.account_for_*_in_pipeline_split are exclusive in megatron-core: set one or the "
                "other"
            )
        for key, value in set_uneven.items():
            if value < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {value}")
        if set_uneven:
            middle_layers = num_layers - sum(set_uneven.values())
            middle_stages = pp - len(set_uneven)
            fixed = ", ".join(f"parallel.{k}={v}" for k, v in set_uneven.items())
            if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
                raise ValueError(
                    f"{fixed} with parallel.pipeline_parallel={pp} leaves {middle_layers} of the "
                    f"{num_layers} layers for {middle_stages} other stage(s)"
                )
            if middle_stages and middle_layers % middle_stages:
                raise ValueError(
                    f"{fixed} leaves {middle_layers} of the {num_layers} layers, not divisible by the "
                    f"{middle_stages} other stage(s) of parallel.pipeline_parallel={pp}"
                )
            per = middle_layers // middle_stages if middle_stages else 0
            layers = [per] * pp
            if self.first_stage_layers is not None:
                layers[0] = self.first_stage_layers
            if self.last_stage_layers is not None:
                layers[-1] = self.last_stage_layers
            return layers
        slots = num_layers + sum(accounted.values())
        if slots % pp:
            counted = "".join(f" + 1 ({k})" for k, on in accounted.items() if on)
            raise ValueError(
                f"parallel.pipeline_parallel={pp} does not divide the {num_layers}{counted} "
                "transformer layers; set parallel.first_stage_layers / last_stage_layers for an uneven split"
            )
        layers = [slots // pp] * pp
        layers[0] -= accounted["embedding"]
        layers[-1] -= accounted["loss"]
        if min(layers) < 1:
            raise ValueError(
                f"parallel.pipeline_parallel={pp} with the embedding / loss accounted leaves a stage "
                f"without transformer layers ({layers})"
            )
        return layers


def compute_device() -> torch.device:
    """The device every compute-path tensor lives on: the current CUDA device, else the CPU.

    Collectives on the default (NCCL on GPU) group and everything the loss touches must be
    created here; control-plane traffic uses the gloo group instead.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` under megatron's DDP / Float16Module wrappers (megatron-core's own unwrap).

    A virtual pipeline's `ModelChunks` comes back as the `ModelChunks` of its unwrapped chunks.

    Imported on use: modules that call this also serve processes that never load megatron.
    """
    from megatron.core.utils import unwrap_model as megatron_unwrap

    from megatron_gspo.model.chunks import ModelChunks

    if isinstance(model, ModelChunks):  # a virtual pipeline's chunks, each unwrapped
        return ModelChunks(megatron_unwrap(chunk) for chunk in model)
    return megatron_unwrap(model)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """`dist.all_reduce` in place, skipped when there is nothing to reduce.

    That is: no process group, or a group of one. Each call costs a backend round trip (a
    gloo handoff, a NCCL launch) even then, and a tiny model's RL step makes dozens of them.
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def expert_peers_need_equal_shapes() -> bool:
    """Whether the ranks exchanging MoE tokens must each feed the same number of tokens.

    megatron's allgather dispatcher gathers every peer's [tokens, H] into one tensor (equal
    sizes); the alltoall dispatcher sends each peer its split of any size, so each rank can
    keep its own micro-batch shape (no padding to the largest peer, no padding tokens routed).
    """
    return _token_dispatcher == "allgather"


def init_distributed(parallel: ParallelConfig, *, seed: int = 1234) -> int:
    """Start torch.distributed and megatron's parallel groups for `parallel`; returns the DP size.

    Safe to call once per process. Applies the runtime patches first (CPU / no-TE fixes). The
    process group and the gloo control group (`control_plane`) both get `parallel.timeout_minutes`.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_gspo.patches import apply_patches

    global _token_dispatcher
    apply_patches()
    _token_dispatcher = parallel.token_dispatcher
    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    if not dist.is_initialized():
        _init_process_group(timeout)
    dp = parallel.check_world_size(dist.get_world_size())
    init_control_group(parallel.timeout_minutes)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tp,
        distributed_timeout_minutes=math.ceil(parallel.timeout_minutes),  # megatron's own groups too
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)  # CPU initialisation draws weights from the default generator
    return dp


def _init_process_group(timeout: datetime.timedelta) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, timeout=timeout)
        return
    # A plain process: a world of one, rendezvous through a private file (no port to collide on),
    # removed when the process group goes away or the process exits.
    store = tempfile.NamedTemporaryFile(prefix="megatron-gspo-rdzv-", delete=False).name
    atexit.register(_remove, store)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    destroy_control_group()
    if dist.is_initialized():
        dist.destroy_process_group()
