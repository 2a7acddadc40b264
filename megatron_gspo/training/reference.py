"""The reference policy of the KL loss: a frozen second Megatron model with the policy's layout.

`algorithm.use_kl_loss` adds `kl_loss_coef x KL(pi_theta || pi_ref)` to the policy loss. pi_ref
is built by the policy's own builder and spec with the same TP/EP/PP layout, so each rank holds
the same shard of both models and the reference forward runs the step's micro-batches exactly
as the policy does; it has no optimizer, no DDP wrapper (hence no gradient buffers), no
gradients and stays in eval mode. Its weights come from `model.ref_hf_path`, or by default are a
copy of the policy's starting weights (after the SFT cold start when there is one).

Resume: a copy that exists nowhere on disk (weights after SFT, or a random init) is exported
once as an HF checkpoint to `run_dir/reference` at the start of the run; a resumed run reloads
it from there (the same bytes, so the same log-probs), else from `model.ref_hf_path` or
`model.hf_path`. The reference is never exported to the rollout servers (weight sync streams
the policy only).

Routing: the reference routes its tokens with its own (frozen) routers. Routing replay (R2/R3)
drives the policy's routers only: under R3 the policy is forced onto the rollout engine's
experts while the reference chooses its own, so `actor/kl_ref` also measures the routing
difference between the replayed and the reference's own choice (R3's routes come from the
rollout weights, which drift away from the reference as training goes on).

`model.ref_offload`: on GPU, the reference's parameters live in pinned host memory between
its passes and are copied to the device for each pass (one copy of the bf16 shard per step);
on CPU they are in host memory already and the option does nothing.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from megatron_gspo.errors import ConfigError
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.control_plane import on_rank0
from megatron_gspo.model.hf.checkpoint import ExportDamagedError, verify_export
from megatron_gspo.model.hf.convert import load_hf_checkpoint
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.pipeline import run_micro_batches
from megatron_gspo.training.step.forward import MicroBatch

logger = logging.getLogger(__name__)

REFERENCE_DIR = "reference"
"""Sub-directory of the run dir holding the reference's weights when no file had them."""


class ReferenceDamagedError(ConfigError):
    """The run's saved reference (`run_dir/reference`) is not what was written: never loaded."""


def _verify_saved_reference(saved: Path) -> None:
    """Rank 0 checks the saved reference's checksums (collective); a damaged one is refused by name."""

    def verify() -> None:
        try:
            if not verify_export(saved):
                logger.warning(
                    "%s carries no checksums (saved by an earlier version): loaded unchecked", saved
                )
        except ExportDamagedError as err:
            raise ReferenceDamagedError(
                f"the run's reference model (KL loss) is damaged: {err}; restore {saved} from a copy, or set "
                "model.ref_hf_path to the checkpoint the KL loss should stay near"
            ) from None

    on_rank0(verify)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under megatron's DDP wrapper (a `Float16Module` in bf16, else the `GPTModel`).

    A virtual pipeline's `ModelChunks` of DDPs comes back as the `ModelChunks` of their modules.
    """
    from megatron.core.distributed import DistributedDataParallel

    from megatron_gspo.model.chunks import ModelChunks

    if isinstance(model, ModelChunks):
        return ModelChunks(_unwrap(chunk) for chunk in model)
    return model.module if isinstance(model, DistributedDataParallel) else model


class ReferencePolicy:
    """Frozen pi_ref: built like the policy, filled once, then forward-only.

    Build it before the policy: megatron's builder clears its class-level routing-replay list,
    which must not happen after the policy's replay handles are registered.
    """

    def __init__(self, model_cfg, parallel, engine, *, offload: bool = False) -> None:
        """Build this rank's shard of the reference (call after `init_distributed`).

        Args:
            model_cfg: the policy's `MoEModelConfig`.
            parallel: the policy's `ParallelConfig` (same TP/EP/PP shard).
            engine: the policy's `EngineConfig` (same dtype, spec and kernels).
            offload: keep the weights in pinned host memory between passes (GPU only).
        """
        self.model_cfg = model_cfg
        self.model = build_model(model_cfg, parallel, engine, routing_replay=False, aux_loss_coeff=0.0)
        self.model.eval()
        self.model.requires_grad_(False)
        self.offload = offload and torch.cuda.is_available()
        self._host: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def copy_from(self, policy: torch.nn.Module) -> None:
        """Take the policy's current weights (every parameter of this rank's shard, by name)."""
        source = dict(_unwrap(policy).named_parameters())
        target = dict(self.model.named_parameters())
        if source.keys() != target.keys():
            missing = sorted(source.keys() ^ target.keys())[:4]
            raise RuntimeError(f"the reference and the policy differ in parameters: {missing}")
        for name, param in target.items():
            param.copy_(source[name])

    def load(self, hf_dir: str | Path) -> None:
        """Read an HF checkpoint (the policy's architecture) into this rank's shard."""
        load_hf_checkpoint(self.model, hf_dir, self.model_cfg)

    def initialise(
        self, policy: torch.nn.Module, *, ref_hf_path: str | None, policy_hf_path: str | None,
        run_dir: Path, resumed: bool, on_disk: bool, tokenizer=None,
    ) -> str:  # fmt: skip
        """Fill the weights at the start of a run (collective); returns where they came from.

        Args:
            policy: the policy, holding its starting weights unless `resumed`.
            ref_hf_path: `model.ref_hf_path`: read the reference from there.
            policy_hf_path: `model.hf_path`.
            run_dir: the run's directory (`run_dir/reference` keeps an otherwise unsaved copy).
            resumed: the policy was loaded from a checkpoint (its weights moved on).
            on_disk: the policy's starting weights are exactly `policy_hf_path` (no SFT ran).
            tokenizer: saved next to an exported copy.

        Raises:
            FileNotFoundError: a resumed run whose reference is in no file.
        """
        saved = Path(run_dir, REFERENCE_DIR)
        if ref_hf_path:
            source = ref_hf_path
        elif resumed and (saved / "config.json").is_file():
            source = str(saved)
            _verify_saved_reference(saved)
        elif resumed and on_disk and policy_hf_path:
            source = policy_hf_path
        elif resumed:
            raise FileNotFoundError(
                f"the reference model's weights (the run's starting policy) are not in {saved}; "
                "set model.ref_hf_path to the checkpoint the KL loss should stay near"
            )
        else:
            self.copy_from(policy)
            if not on_disk:  # kept for a resume: after SFT or from a random init no file holds them
                export_hf_checkpoint(self.model, saved, self.model_cfg, tokenizer, checksums=True)
            return "the policy's starting weights"
        self.load(source)
        return source

    # ------------------------------------------------------------------ passes

    @contextlib.contextmanager
    def on_device(self):
        """The weights on the compute device for one pass (a no-op unless offloading on GPU)."""
        if not self.offload:
            yield
            return
        device = torch.device("cuda", torch.cuda.current_device())
        for name, param in self.model.named_parameters():
            param.data = self._host[name].to(device, non_blocking=True) if self._host else param.data
        try:
            yield
        finally:
            self._to_host()

    def _to_host(self) -> None:
        """Parameters to pinned host memory (copied once: the weights never change)."""
        for name, param in self.model.named_parameters():
            if name not in self._host:
                self._host[name] = param.data.to("cpu").pin_memory()
            param.data = self._host[name]

    def start_offloaded(self) -> None:
        """Move the weights to host memory now, once they are filled (`ref_offload`)."""
        if self.offload:
            self._to_host()

    @torch.no_grad()
    def fill_logprobs(self, micro_batches: list[MicroBatch], temperature: float) -> None:
        """Set `ref_logprobs` of one mini-batch's micro-batches: one forward-only schedule run.

        The same packed rows as every other pass of the step; values off the response are 0.
        Only the last pipeline stage computes (and keeps) log-probs.
        """

        def keep(i: int, logprobs: torch.Tensor, _entropy):
            micro = micro_batches[i]
            micro.ref_logprobs = torch.where(micro.response_mask, logprobs.float(), 0.0)
            return logprobs.new_zeros(()), {}

        run_micro_batches(
            self.model,
            [micro.packed for micro in micro_batches],
            keep,
            forward_only=True,
            temperature=temperature,
        )

    def fill_plan(self, plan: list[list[MicroBatch]], temperature: float) -> None:
        """`fill_logprobs` for every micro-batch of the step in one schedule run (no pi_old pass runs)."""
        with self.on_device():
            self.fill_logprobs([micro for micro_batches in plan for micro in micro_batches], temperature)
