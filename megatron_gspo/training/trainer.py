"""The RL loop: cold start, then per step rollout, reward, advantages, mini-batch updates, weight sync.

Every rank trains; global rank 0 alone talks to the rollout engine. One step (see /design:
data flow):

1. rank 0 samples `rollout_batch_size` prompts x G responses (one batch request per server),
   validates them (`rollout.on_invalid`) and scores them;
2. rank 0 computes the group advantages and the batch metrics over the whole batch; the
   metrics (or rank 0's exception) reach every rank over the gloo control plane, and each
   data-parallel rank receives only the rows it trains on (`step.scatter`); a batch whose
   advantages are all zero is reported and not trained on;
3. `num_mini_batches` optimizer steps (`step.update`); a non-finite loss or gradient skips that
   optimizer step with the weights untouched and is counted;
4. the weights reach the rollout servers as `weight_version + 1` (`weight_sync`): streamed in
   buckets over a weight-update group (`weight_sync.method: distributed`, the default), sent
   as tensors, or, with `disk`, exported as an HF checkpoint (RAM-backed dir when available)
   that the servers reload;
5. held-out evaluation every `eval.every` steps, metrics, checkpoints every `save_every`.

With `rollout.max_staleness >= 1`, step 1's sampling moves to rank 0's producer thread
(`ahead.queue`), which runs ahead of training; the step takes the oldest batch within the
bound from its queue, and steps 4-5 pause the producer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import RunningMeanStd
from megatron_gspo.algorithms.token_kl import KLController
from megatron_gspo.checkpoint.load import load_checkpoint
from megatron_gspo.checkpoint.meta import CheckpointError, step_dir_name
from megatron_gspo.checkpoint.resume_checks import check_resume
from megatron_gspo.checkpoint.save import save_checkpoint
from megatron_gspo.checkpoint.schedule import checkpoint_due
from megatron_gspo.checkpoint.steps import resumable_step
from megatron_gspo.config import (
    ConfigError,
    RunConfig,
    build_model_config,
    build_task,
    effective_reward_norm,
    needs_reference,
    to_yaml,
    validate,
)
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.control_plane import broadcast_from_rank0, call_on_rank0, on_rank0
from megatron_gspo.model.distributed import compute_device, destroy_distributed, init_distributed
from megatron_gspo.model.hf.checkpoint import ExportTargetError, check_export_target
from megatron_gspo.model.hf.convert import ConversionError, load_hf_checkpoint
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.optim import build_optimizer, ddp_options, wrap_ddp
from megatron_gspo.model.packing import packing_layout
from megatron_gspo.placement.colocation import Colocated, Placement
from megatron_gspo.placement.offload import TrainerOffload
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.rollout.fleet import FleetTooSmallError
from megatron_gspo.rollout.server_checks import check_servers, refuse_unreachable_endpoints
from megatron_gspo.tasks import PromptStream
from megatron_gspo.tasks.prompt_check import check_prompts
from megatron_gspo.tasks.tokenizer import resolve_add_bos
from megatron_gspo.termination import exit_if_terminated
from megatron_gspo.training.ahead.rollouts_ahead import RolloutsAhead
from megatron_gspo.training.heldout import heldout_metrics
from megatron_gspo.training.metrics import MetricsLogger, ZeroRewardWatch
from megatron_gspo.training.reference import ReferencePolicy
from megatron_gspo.training.run_lock import RunLock, lock_path
from megatron_gspo.training.run_setup import load_tokenizer, weight_sync_dir
from megatron_gspo.training.sft import run_sft
from megatron_gspo.training.step.metrics import peak_memory_metrics, progress_label
from megatron_gspo.training.step.micro_batches import DataLayout
from megatron_gspo.training.step.rollouts import RolloutEngine, rollout_servers
from megatron_gspo.training.step.routing import StepRouting
from megatron_gspo.training.step.scatter import scatter_rank_rows
from megatron_gspo.training.step.scoring import score_batch
from megatron_gspo.training.step.token_kl import apply_token_level_kl
from megatron_gspo.training.step.update import (
    dp_group,
    plan_metrics,
    plan_rank_rows,
    recompute_and_measure,
    recompute_old_logprobs,
    train_on_batch,
)
from megatron_gspo.weight_sync.shm_exports import claim_export_dir
from megatron_gspo.weight_sync.sync import WeightSync

logger = logging.getLogger(__name__)


class Trainer:
    """Builds everything one run needs from a validated `RunConfig`; `run()` trains."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        try:
            cfg.engine.check_hardware()  # TransformerEngine / fused kernels asked for where unavailable
            cfg.optim.check_hardware()  # optimizer_cpu_offload without CUDA
        except ValueError as err:
            raise ConfigError(str(err)) from None
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        self.rank0 = dist.get_rank() == 0
        self.run_dir = Path(cfg.trainer.run_dir)
        self.sync_dir = weight_sync_dir(cfg)
        self.lock = RunLock()
        if self.rank0:  # before any work: one run at a time writes these directories
            self._lock_directories()
        on_rank0(refuse_unreachable_endpoints, cfg.rollout)  # before SFT, not found after it
        self.model_cfg = build_model_config(cfg)
        self.task = build_task(cfg)
        self.tokenizer = load_tokenizer(cfg)
        if len(self.tokenizer) > self.model_cfg.vocab_size:
            raise ConfigError(
                f"model vocab_size={self.model_cfg.vocab_size} is smaller than the tokenizer "
                f"({len(self.tokenizer)} tokens); set model.overrides.vocab_size"
            )
        self.add_bos = resolve_add_bos(cfg.task.add_bos, self.tokenizer)
        try:  # every prompt the run can see, encoded once: errors and overlong prompts now, not at step N
            check_prompts(self.task, self.tokenizer, add_bos=self.add_bos, sft=cfg.sft.steps > 0)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        replay = cfg.algorithm.routing_replay
        # Built first: megatron's builder clears the routing-replay handles the policy registers.
        self.reference = (
            ReferencePolicy(self.model_cfg, cfg.parallel, cfg.engine, offload=cfg.model.ref_offload)
            if needs_reference(cfg.algorithm)
            else None
        )
        model = build_model(
            self.model_cfg,
            cfg.parallel,
            cfg.engine,
            routing_replay=replay != "none",
            aux_loss_coeff=cfg.algorithm.aux_loss_coeff,  # RL's, not the checkpoint's
        )
        if cfg.model.hf_path:
            try:
                load_hf_checkpoint(model, cfg.model.hf_path, self.model_cfg)
            except ConversionError as err:  # the user's checkpoint: a named tensor, one line
                raise ConfigError(f"model.hf_path: {err}") from None
        self.model = wrap_ddp(model, **ddp_options(cfg.parallel))
        sp_tp = cfg.parallel.tensor_parallel if cfg.parallel.use_sequence_parallel else 1
        from megatron.core import parallel_state as ps

        self.routing = StepRouting(
            self.model,
            mode=replay,
            drift=cfg.drift.enabled,
            drift_every=cfg.drift.every,
            drift_sample_tokens=cfg.drift.sample_tokens,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=sp_tp,
            sequence_parallel=cfg.parallel.use_sequence_parallel,
        )
        self.layout = DataLayout.from_megatron(
            cfg.trainer.micro_batch_size,
            cfg.parallel.pad_multiple,
            packing_layout(model),
            max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch or 0,
        )
        self.stream = PromptStream(self.task, cfg.rollout.rollout_batch_size, seed=cfg.trainer.seed)
        self.running = RunningMeanStd() if effective_reward_norm(cfg.algorithm) == "running" else None
        algo = cfg.algorithm
        self.kl_ctl = (
            KLController(algo.init_kl_coef, algo.kl_ctl, algo.target_kl, algo.kl_horizon)
            if algo.add_token_level_kl
            else None
        )
        self.counters = {"skipped_steps": 0, "all_zero_adv_batches": 0, "dropped_groups": 0}
        self.zero_reward = ZeroRewardWatch(cfg.logging.zero_reward_warn_steps, cfg.logging.samples_per_step)
        self.step, self.weight_version = 0, 0
        self.sample_rows: list[dict] = []
        self.ahead: RolloutsAhead | None = None  # rank 0 with rollout.max_staleness >= 1
        self.placement = Placement()  # colocated: set once the optimizer exists
        self.ckpt_root = self.run_dir / "checkpoints"
        if self.rank0 and str(self.sync_dir).startswith("/dev/shm/"):
            claim_export_dir(self.sync_dir.parent)  # after removing the exports of runs that died
        try:
            self.heldout = self.task.heldout(cfg.eval.num_problems)
        except ValueError as err:
            raise ConfigError(f"eval.num_problems={cfg.eval.num_problems}: {err}") from None
        self.weight_sync = WeightSync(
            cfg.weight_sync,
            self.model,
            self.model_cfg,
            self.sync_dir,
            self.tokenizer,
            quantization=cfg.rollout.quantization,
            colocated=cfg.rollout.placement == "colocated",
        )

    def _lock_directories(self) -> None:
        """Lock the run dir and the weight-sync dir (rank 0); refuse a sync dir that is not an export."""
        self.lock.acquire(lock_path(self.run_dir, inside=True), "trainer.run_dir", self.run_dir)
        if self.cfg.trainer.weight_sync_dir:  # replaced whole by each export: its lock sits beside it
            sync_lock = lock_path(self.sync_dir, inside=False)
            self.lock.acquire(sync_lock, "trainer.weight_sync_dir", self.sync_dir)
            try:
                check_export_target(self.sync_dir)
            except ExportTargetError as err:
                raise ConfigError(f"trainer.weight_sync_dir={self.sync_dir}: {err}") from None

    def _restore_or_cold_start(self) -> dict[str, float]:
        cfg = self.cfg
        existing = resumable_step(self.ckpt_root)
        if existing is not None and not cfg.trainer.resume:
            # Fail before any work: a fresh run would end by refusing to overwrite these checkpoints.
            raise ConfigError(
                f"trainer.run_dir={self.run_dir} already holds checkpoints up to step {existing}: "
                "pass --resume to continue that run, or choose a new trainer.run_dir"
            )
        if cfg.trainer.resume and existing is None and not cfg.trainer.resume_or_start:
            raise ConfigError(
                f"--resume: trainer.run_dir={self.run_dir} holds no checkpoint; "
                "drop --resume to start a new run, or pass --resume-or-start"
            )
        resume_step = existing if cfg.trainer.resume else None
        if resume_step is not None:  # before any heavy work: a setting the checkpoint cannot serve
            check_resume(self.ckpt_root / step_dir_name(resume_step), cfg)
        start: dict[str, float] = {}
        if resume_step is None and cfg.sft.steps > 0:
            start = run_sft(
                self.model,
                self.task,
                self.tokenizer,
                cfg.sft,
                self.layout,
                add_bos=self.add_bos,
                heldout=self.heldout,
                max_new_tokens=cfg.rollout.max_new_tokens,
            )
        total = max(cfg.trainer.steps * cfg.algorithm.num_mini_batches * cfg.algorithm.ppo_epochs, 1)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, cfg.optim, distributed_optimizer=cfg.parallel.distributed_optimizer, total_steps=total
        )
        if cfg.rollout.placement == "colocated":
            self.placement = Colocated(TrainerOffload(self.model, self.optimizer))
        if resume_step is not None:
            try:
                state = load_checkpoint(  # a damaged newest checkpoint falls back to an older intact one
                    self.ckpt_root,
                    model=self.model,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    fallback=True,
                )
            except CheckpointError as err:  # none intact, or none loadable here: the message says which
                raise ConfigError(f"--resume: {err}") from None
            self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
            self.stream.load_state_dict(state["prompt_stream"])
            self.counters = dict(state["counters"])
            if self.running is not None:
                self.running.load_state_dict(state["running_stats"])
            if self.kl_ctl is not None and state.get("kl_controller") is not None:
                self.kl_ctl.load_state_dict(state["kl_controller"])
            logger.info("resumed from step %d (weight_version %d)", self.step, self.weight_version)
            if self.step >= cfg.trainer.steps:  # exiting 0 here would report a run that did nothing
                raise ConfigError(
                    f"--resume: the run in trainer.run_dir={self.run_dir} already reached step "
                    f"{self.step}, so trainer.steps={cfg.trainer.steps} leaves nothing to train; "
                    f"set trainer.steps above {self.step} to continue it"
                )
        if self.reference is not None:
            try:
                source = self.reference.initialise(
                    self.model,
                    ref_hf_path=cfg.model.ref_hf_path,
                    policy_hf_path=cfg.model.hf_path,
                    run_dir=self.run_dir,
                    resumed=resume_step is not None,
                    on_disk=bool(cfg.model.hf_path) and cfg.sft.steps == 0,
                    tokenizer=self.tokenizer,
                )
            except FileNotFoundError as err:
                raise ConfigError(str(err)) from None
            self.reference.start_offloaded()
            logger.info("reference model (KL loss): %s", source)
        return start

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weight_version": self.weight_version,
            "prompt_stream": self.stream.state_dict(),
            "running_stats": None if self.running is None else self.running.state_dict(),
            "kl_controller": None if self.kl_ctl is None else self.kl_ctl.state_dict(),
            "counters": dict(self.counters),
            "config": to_yaml(self.cfg),
        }

    def _startup_weights(self, changed: bool) -> tuple[Path | None, bool]:
        """Where an embedded server starts from, and whether a sync must follow (collective).

        `changed`: the trainer's weights differ from `model.hf_path` (SFT ran, the run resumed,
        or there is no checkpoint). Servers given by URL serve `model.hf_path` as launched;
        they get a sync only when the weights changed. The embedded server starts from
        `model.hf_path` (then syncs if changed) unless there is none or the method is disk:
        then from an export of the current weights, the one export a non-disk run makes.
        """
        hf_path = self.cfg.model.hf_path
        if self.cfg.rollout.server_urls or self.cfg.rollout.router_url:
            return None, changed
        if hf_path and self.cfg.weight_sync.method != "disk":
            return Path(hf_path), changed
        return export_hf_checkpoint(self.model, self.sync_dir, self.model_cfg, self.tokenizer), False

    def _evaluate(self, engine: RolloutEngine | None) -> dict[str, float]:
        def run() -> dict[str, float]:
            return heldout_metrics(engine, self.task, self.heldout, self.cfg.eval, seed=self.cfg.trainer.seed)

        start = time.perf_counter()
        out = on_rank0(run)
        out["time/eval_s"] = time.perf_counter() - start
        return out

    def _sample_and_score(self, engine: RolloutEngine, problems) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """Rank 0: the step's batch, its advantages and what every rank must know about it.

        Advantages and `rollout/*` metrics need the whole batch, so they are computed here,
        before the rows are split over data-parallel ranks (reward running statistics live on
        rank 0, which alone writes them into checkpoints).
        """
        batch = engine.sample_groups(
            problems,
            seed=self.cfg.trainer.seed,
            step=self.step,
            weight_version=self.weight_version,
            routed_experts=self._needs_routed_experts(),  # R3, or a step that measures drift
        )
        return self._score(batch)

    def _take_and_score(self) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """Rank 0 with rollouts ahead: the oldest batch within the staleness bound, scored."""
        taken = self.ahead.take(self.weight_version)
        batch, advantages, shared = self._score(taken.item.batch)
        shared["metrics"].update(self.ahead.step_metrics(taken, batch, self.weight_version))
        return batch, advantages, shared

    def _score(self, batch: RolloutBatch) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """Rank 0: a sampled batch's advantages and what every rank must know about it."""
        self.sample_rows = batch.stats.get("sample_rows", [])  # rank 0 writes them with the step's record
        return score_batch(batch, self.cfg.algorithm, self.running, self.layout.dp_size)

    def train_step(self, engine: RolloutEngine | None) -> dict[str, float]:
        """One RL step (collective); returns its metrics."""
        cfg, algo = self.cfg, self.cfg.algorithm
        self.step += 1
        t0 = time.perf_counter()
        self.routing.set_step(self.step)  # drift.every: only measured steps pay the extra forward
        if cfg.rollout.max_staleness:  # rank 0's producer draws the prompts
            local = call_on_rank0(self._take_and_score)
        else:
            problems = self.stream.next_batch()  # every rank advances its stream (same state everywhere)
            local = call_on_rank0(self._sample_and_score, engine, problems)
        shared = broadcast_from_rank0(local[2] if isinstance(local, tuple) else local)
        batch, advantages = local[:2] if isinstance(local, tuple) else (None, None)
        t1 = time.perf_counter()
        metrics = {**shared["metrics"], **self.placement.to_training(engine and engine.client)}
        if self.rank0:  # one warning, not one per rank
            self.zero_reward.update(self.step, metrics)
        self.counters["dropped_groups"] += shared["dropped_groups"]
        all_zero = shared["all_zero"]
        metrics["train/all_zero_adv_batch"] = float(all_zero)
        if all_zero:
            self.counters["all_zero_adv_batches"] += 1
            logger.warning("step %d: every advantage is zero; nothing to learn, update skipped", self.step)
        else:
            rows = scatter_rank_rows(
                batch,
                advantages,
                num_mini_batches=algo.num_mini_batches,
                layout=self.layout,
                routed_experts=self._needs_routed_experts(),
                device=compute_device(),
            )
            plan = plan_rank_rows(rows, algo.num_mini_batches, self.layout)
            metrics.update(plan_metrics(plan))
            routing = self.routing if self.routing.active else None
            if routing is not None:
                routing.begin_step(rows)
            temperature, reference = cfg.rollout.temperature, self.reference
            if algo.old_logprobs == "recompute":
                metrics.update(
                    recompute_and_measure(self.model, plan, temperature, routing=routing, reference=reference)
                )
            elif self.routing.needs_old_pass:  # pi_old's routing only (R2 targets, drift reference)
                recompute_old_logprobs(
                    self.model, plan, temperature, routing=routing, set_logprobs=False, reference=reference
                )
            elif reference is not None:  # no pi_old pass to share: the reference runs alone
                reference.fill_plan(plan, temperature)
            if self.kl_ctl is not None:
                metrics.update(apply_token_level_kl(self.model, plan, algo, self.kl_ctl, dp_group()))
            metrics.update(
                train_on_batch(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    plan,
                    algo,
                    temperature=cfg.rollout.temperature,
                    max_response_length=cfg.rollout.max_new_tokens,
                    nan_loss=cfg.debug.nan_loss_at_step == self.step,
                    routing=routing,
                )
            )
            self.counters["skipped_steps"] += int(metrics["train/skipped_steps"])
        t2 = time.perf_counter()
        bump = 2 if cfg.debug.version_gap_at_step == self.step else 1
        version = self.weight_version + bump
        try:
            with self.ahead.around_sync() if self.ahead else contextlib.nullcontext():
                client = engine and engine.client  # colocated: the servers resume around the sync
                sync, hand_over = self.placement.sync(client, lambda: self.weight_sync.sync(client, version))
                self.weight_version += bump
        except FleetTooSmallError:  # every rank: the step trained is kept, the run stops by name
            with self._rollouts_paused():
                self._save(reshardable=cfg.trainer.reshardable_at_end)
            raise
        metrics.update({**sync.metrics(), **hand_over})
        t3 = time.perf_counter()
        metrics.update(
            {
                "weight_version": float(self.weight_version),
                "time/rollout_s": shared["metrics"].get("time/rollout_s", t1 - t0),
                "time/train_s": t2 - t1,
                "time/sync_s": t3 - t2,
                "perf/train_tokens_per_s": shared["train_tokens"] / max(t2 - t1, 1e-9),
                "counters/skipped_steps": float(self.counters["skipped_steps"]),
                "counters/all_zero_adv_batches": float(self.counters["all_zero_adv_batches"]),
                "counters/dropped_groups": float(self.counters["dropped_groups"]),
            }
        )
        return metrics

    def run(self) -> dict[str, Any]:
        """Cold start (or resume), then RL steps; returns the last step's record plus the eval history."""
        cfg = self.cfg
        start_metrics = self._restore_or_cold_start()
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        log = MetricsLogger(
            self.run_dir,
            total_steps=cfg.trainer.steps,
            first_step=self.step + 1 if self.step else 0,
            enabled=self.rank0,
            tensorboard=cfg.logging.tensorboard,
            progress_bar=cfg.logging.progress_bar,
            label=progress_label(cfg),
            wandb=cfg.logging.wandb,
            run_config=dataclasses.asdict(cfg),
        )
        changed = cfg.sft.steps > 0 or self.step > 0 or not cfg.model.hf_path
        start_dir, must_sync = self._startup_weights(changed)
        must_sync = must_sync or cfg.rollout.quantization == "fp8"  # servers start from bf16 weights
        routed = self._routed_experts_layout() is not None
        servers = rollout_servers(
            cfg.rollout, start_dir, weight_version=self.weight_version, seed=cfg.trainer.seed,
            log_dir=self.run_dir / "sglang", routed_experts=routed,
        )  # fmt: skip
        evals: list[dict[str, float]] = []
        with servers if self.rank0 else contextlib.nullcontext() as client:
            engine = (
                RolloutEngine(client, self.task, self.tokenizer, cfg.rollout,
                              vocab_size=self.model_cfg.vocab_size, add_bos=self.add_bos,
                              routed_experts=self._routed_experts_layout(),
                              samples_per_step=cfg.logging.samples_per_step)
                if self.rank0 else None
            )  # fmt: skip
            stale = on_rank0(  # trust no server on its launch flags: ask what each one serves
                lambda: check_servers(
                    client,
                    sync_method=cfg.weight_sync.method,
                    routed_experts=routed,
                    version=self.weight_version,
                    expected_path=start_dir or cfg.model.hf_path,
                    memory_saver=self.placement.colocated,
                )
            )
            for problem in stale:  # named even when a sync is due anyway (SFT ran, a resume)
                logger.warning("start-up: %s", problem)
            must_sync = must_sync or bool(stale)
            if must_sync:
                logger.info(
                    "start-up: syncing the trainer's weights (version %d) to the servers", self.weight_version
                )
                self.weight_sync.sync(client, self.weight_version)
            else:
                logger.info("start-up: the servers already serve the trainer's weights; nothing sent")
            self.placement.start(client)  # colocated: the trainer's state leaves the GPUs to the servers
            if self.step == 0 and cfg.eval.at_start:
                record = {**start_metrics, **self._evaluate(engine), "weight_version": 0.0}
                log.log(0, record)
                evals.append({"step": 0, **record})
                logger.info("cold-start held-out accuracy %.3f", record["eval/accuracy"])
            elif start_metrics:  # what the cold start did is part of the run's record either way
                log.log(0, {**start_metrics, "weight_version": 0.0})
            with self._start_producer(engine):  # stopped (joined) on exit and on an exception
                gc.collect()  # what start-up left behind; the rest (torch, megatron, the model) lives on:
                gc.freeze()  # frozen, it is not rescanned by each full collection (0.2-0.3 s apiece)
                while self.step < cfg.trainer.steps:
                    exit_if_terminated()  # a SIGTERM whose exit was dropped where it landed
                    t0 = time.perf_counter()
                    metrics = self.train_step(engine)
                    last = self.step == cfg.trainer.steps
                    if (cfg.eval.every and self.step % cfg.eval.every == 0) or (last and cfg.eval.at_end):
                        with self._rollouts_paused():
                            metrics.update(self._evaluate(engine))
                        evals.append({"step": self.step, **metrics})
                    save, reshardable = checkpoint_due(self.step, last=last, trainer=cfg.trainer)
                    if save:
                        with self._rollouts_paused():  # the prompt stream's state is not moving
                            self._save(reshardable=reshardable)
                    metrics["time/step_s"] = time.perf_counter() - t0
                    metrics.update(peak_memory_metrics())
                    log.log(self.step, metrics)
                    log.log_samples(self.step, self.sample_rows)
                if cfg.trainer.steps == 0:  # the cold start (SFT) is the run's result: keep it
                    self._save(reshardable=cfg.trainer.reshardable_at_end)
            self.weight_sync.close(client)
            gc.unfreeze()  # the run's objects are collectable again (a process may train again)
        log.close()
        return {"last": log.last, "evals": evals}

    def _start_producer(self, engine: RolloutEngine | None) -> contextlib.AbstractContextManager:
        """Rank 0 with `rollout.max_staleness >= 1`: sample ahead; batches queued at exit are not trained."""
        k = self.cfg.rollout.max_staleness
        if not (self.rank0 and k):
            return contextlib.nullcontext()
        produced = self.step

        def produce(version: int) -> RolloutBatch:
            nonlocal produced
            produced += 1
            return engine.sample_groups(
                self.stream.next_batch(),
                seed=self.cfg.trainer.seed,
                step=produced,
                weight_version=version,
                routed_experts=self._routed_experts_layout() is not None,
            )

        left = self.cfg.trainer.steps - self.step  # no batch beyond the last step
        self.ahead = RolloutsAhead(self.cfg.rollout, engine, produce, lambda: self.weight_version, left)
        return self.ahead

    def _rollouts_paused(self) -> contextlib.AbstractContextManager:
        """No rollout request in flight inside (weight sync, eval, checkpoint); a no-op in lock-step."""
        return self.ahead.paused() if self.ahead is not None else contextlib.nullcontext()

    def _save(self, *, reshardable: bool) -> None:
        """Checkpoint the current step (collective); `reshardable`: loadable at any layout."""
        with self.placement.state_on_device():  # colocated: the state is parked between steps
            save_checkpoint(self.ckpt_root, self.step, model=self.model, optimizer=self.optimizer,
                            scheduler=self.scheduler, trainer_state=self._trainer_state(),
                            keep_last=self.cfg.trainer.keep_last, model_cfg=self.model_cfg,
                            tokenizer=self.tokenizer, reshardable=reshardable)  # fmt: skip

    def _needs_routed_experts(self) -> bool:
        """Whether this step's rows must carry the rollout engine's routing (R3 targets, measured drift)."""
        return self.routing.mode == "r3" or self.routing.drift

    def _routed_experts_layout(self) -> tuple[int, int, int] | None:
        """(layers, k, experts) when rollouts must carry routed experts (R3, drift), else None."""
        if self.cfg.algorithm.routing_replay != "r3" and not self.cfg.drift.enabled:
            return None
        return self.model_cfg.num_layers, self.model_cfg.moe_topk, self.model_cfg.num_experts

    def close(self) -> None:
        """Remove RAM-backed exported weights and tear down the process groups."""
        self.routing.close()
        if self.rank0 and str(self.sync_dir).startswith("/dev/shm/"):
            shutil.rmtree(self.sync_dir.parent, ignore_errors=True)
        destroy_distributed()
        self.lock.release()


def train(cfg: RunConfig) -> dict[str, Any]:
    """Run one training job end to end (every rank calls it)."""
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()
