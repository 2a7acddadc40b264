"""RL step costs on the demo policy, as ratios measured in one run (interleaved, paired repeats).

    OMP_NUM_THREADS=1 python benchmarks/bench_train_step.py [--quick]

One demo-shaped RL batch (configs/tiny_moe_cpu.yaml: 16 addition prompts x 8 responses, the
task's answers + EOS as responses, rollout log-probs the model's own) on the real tiny Megatron
MoE with megatron's DDP and optimizer:

- `rl_vs_lm`: the RL update (`train_on_batch`: GSPO loss, entropy, metrics, 4 mini-batches) over
  a plain Megatron LM step (cross-entropy over every token, the same packed micro-batches, the
  same number of optimizer steps: `finalize_model_grads` + `optimizer.step`);
- `rollout_vs_recompute`: the update with pi_old = the rollout log-probs over the update that
  first recomputes pi_old with a no-grad forward, with 1 mini-batch and with the demo's 4;
- `r2_vs_grpo`: the GRPO update (configs/tiny_moe_cpu_grpo.yaml) replaying R2 routing over the
  plain GRPO update, without and with R2's recording forward (the pi_old pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def demo_batch(cfg, model, tokenizer):
    """One step's rollout batch of the demo config, rollout log-probs = the model's own."""
    from megatron_gspo.algorithms import compute_group_advantages
    from megatron_gspo.config import build_task
    from megatron_gspo.model.logprobs import sequence_logprobs
    from megatron_gspo.rollout import RolloutBatch, RolloutSample
    from megatron_gspo.tasks import PromptStream
    from megatron_gspo.tasks.tokenizer import encode_prompt, encode_text, resolve_add_bos

    task = build_task(cfg)
    gen = torch.Generator().manual_seed(0)
    samples = []
    problems = PromptStream(task, cfg.rollout.rollout_batch_size, seed=cfg.trainer.seed).next_batch()
    for g, problem in enumerate(problems):
        prompt = torch.tensor(
            encode_prompt(tokenizer, problem.prompt, add_bos=resolve_add_bos(cfg.task.add_bos, tokenizer))
        )
        response = torch.tensor(encode_text(tokenizer, problem.answer) + [tokenizer.eos_token_id])
        for _ in range(cfg.rollout.group_size):
            reward = float(torch.rand((), generator=gen) > 0.5)
            samples.append(RolloutSample(prompt, response, torch.zeros(len(response)), "stop", "0",
                                         group_index=g, reward=reward))  # fmt: skip
    with torch.no_grad():
        own, _ = sequence_logprobs(
            model,
            [torch.cat([s.prompt_ids, s.response_ids]) for s in samples],
            temperature=cfg.rollout.temperature,
        )
    for b, s in enumerate(samples):
        s.rollout_logprobs = own[b, s.prompt_length : s.prompt_length + s.response_length].float()
    batch = RolloutBatch.from_samples(samples, cfg.rollout.group_size)
    advantages, _ = compute_group_advantages(batch.rewards, cfg.rollout.group_size)
    return batch, advantages


def lm_step(model, optimizer, scheduler, plan) -> None:
    """A plain Megatron LM step per mini-batch: mean cross-entropy over every packed token."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_gspo.model.distributed import compute_device
    from megatron_gspo.model.logprobs import attention_inputs

    device = compute_device()
    for micro_batches in plan:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for micro in micro_batches:
            packed = micro.packed
            valid = torch.zeros(packed.tokens.shape, dtype=torch.bool)
            for row, start, n in packed.segments:
                valid[row, start : start + n - 1] = True  # positions that predict a next token
            loss = model(
                packed.tokens.to(device),
                packed.position_ids.to(device),
                labels=packed.labels.to(device),
                **attention_inputs(model, packed, device),
            )
            valid = valid.to(device)
            ((loss * valid).sum() / valid.sum()).backward()
        finalize_model_grads([model])
        optimizer.step()
        scheduler.step(increment=1)


def timed(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of every call of each variant, calls interleaved to share the machine's drift."""
    for fn in variants.values():
        fn()  # warm-up
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repeats of a / b within each repeat: load changes slower than one repeat cancel."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


@dataclass
class Setup:
    """A model with its optimizer and the demo batch it trains on."""

    cfg: object
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    batch: object
    advantages: torch.Tensor

    @classmethod
    def build(cls, config: str, *, routing_replay: bool) -> Setup:
        from megatron_gspo.config import build_model_config, load_config
        from megatron_gspo.model.builder import build_model
        from megatron_gspo.model.optim import build_optimizer, wrap_ddp
        from megatron_gspo.tasks.tokenizer import build_char_tokenizer

        cfg = load_config(REPO / "configs" / config)
        model = wrap_ddp(build_model(build_model_config(cfg), cfg.parallel, routing_replay=routing_replay))
        optimizer, scheduler = build_optimizer(model, cfg.optim, total_steps=10_000)
        return cls(cfg, model, optimizer, scheduler, *demo_batch(cfg, model, build_char_tokenizer()))

    def plan(self, mini_batches: int):
        from megatron_gspo.training.step.micro_batches import DataLayout
        from megatron_gspo.training.step.update import plan_mini_batches

        return plan_mini_batches(self.batch, self.advantages, mini_batches, DataLayout())

    def update(self, algo, mini_batches: int, *, recompute: bool = False, routing=None, record: bool = False):
        """A callable running one RL update; `recompute`/`record`: with the pi_old pass first.

        With `routing` (R2) and no `record`, the replay targets are recorded once here.
        """
        from megatron_gspo.training.step.update import recompute_old_logprobs, train_on_batch

        plan, temperature = self.plan(mini_batches), self.cfg.rollout.temperature

        def old_pass():
            if routing is not None:
                routing.begin_step(self.batch)
            recompute_old_logprobs(self.model, plan, temperature, routing=routing, set_logprobs=recompute)

        if routing is not None and not record:
            old_pass()

        def run():
            if recompute or record:
                old_pass()
            train_on_batch(self.model, self.optimizer, self.scheduler, plan, algo, temperature=temperature,
                           max_response_length=self.cfg.rollout.max_new_tokens, routing=routing)  # fmt: skip

        return run


def measure(quick: bool = False) -> dict[str, float]:
    """The ratios (and the median milliseconds behind them) of the module docstring."""
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.training.step.routing import StepRouting

    repeats = 3 if quick else 15
    init_distributed(ParallelConfig(), seed=0)
    try:
        gspo = Setup.build("tiny_moe_cpu.yaml", routing_replay=False)
        algo, minis = gspo.cfg.algorithm, gspo.cfg.algorithm.num_mini_batches
        recompute = dataclasses.replace(algo, old_logprobs="recompute")
        lm_plan = gspo.plan(minis)
        t = timed(
            {
                "rl": gspo.update(algo, minis),
                "lm": lambda: lm_step(gspo.model, gspo.optimizer, gspo.scheduler, lm_plan),
                "rollout_1mb": gspo.update(algo, 1),
                "recompute_1mb": gspo.update(recompute, 1, recompute=True),
                "recompute": gspo.update(recompute, minis, recompute=True),
            },
            repeats,
        )
        grpo = Setup.build("tiny_moe_cpu_grpo.yaml", routing_replay=True)
        r2 = StepRouting(grpo.model, mode="r2", drift=False)
        algo = grpo.cfg.algorithm
        # Two timings: recording the targets at every step would clear the ones recorded once.
        t.update(
            timed(
                {"grpo": grpo.update(algo, minis), "grpo_r2": grpo.update(algo, minis, routing=r2)}, repeats
            )
        )
        record = grpo.update(algo, minis, routing=r2, record=True)
        t.update(timed({"grpo_again": grpo.update(algo, minis), "grpo_r2_record": record}, repeats))
        r2.close()
    finally:
        destroy_distributed()
    out = {f"{name}_ms": statistics.median(seconds) * 1e3 for name, seconds in t.items()}
    out.update(
        {
            "rl_vs_lm": paired_ratio(t, "rl", "lm"),
            "rollout_vs_recompute_1mb": paired_ratio(t, "rollout_1mb", "recompute_1mb"),
            "rollout_vs_recompute": paired_ratio(t, "rl", "recompute"),
            "r2_vs_grpo": paired_ratio(t, "grpo_r2", "grpo"),
            "r2_record_vs_grpo": paired_ratio(t, "grpo_r2_record", "grpo_again"),
            "mini_batches": float(minis),
            "rows": float(gspo.batch.batch_size),
            "repeats": float(repeats),
        }
    )
    return out


def print_measured(measure, description: str) -> None:
    """A benchmark's command line: `--quick` (3 repeats instead of 15), then each measured value.

    Args:
        measure: takes `quick` and returns the named values to print.
        description: the `--help` text (the benchmark's first docstring line).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 15")
    args = parser.parse_args()
    for key, value in measure(args.quick).items():
        print(f"{key:28s} {value:10.3f}")


if __name__ == "__main__":
    print_measured(measure, __doc__.splitlines()[0])
