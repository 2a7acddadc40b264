"""The KL loss's reference pass on the demo policy, as ratios measured in one run (interleaved).

    OMP_NUM_THREADS=1 python benchmarks/bench_reference.py [--quick]

The demo batch (`bench_train_step.demo_batch`: 16 prompts x 8 responses, 4 mini-batches) on the
real tiny Megatron MoE; each variant runs the step's update stage from the same plan:

- `kl_vs_plain`: the reference forward over the step's micro-batches (one schedule run, pi_old
  from the rollout) plus the update with the KL loss, over the update without it;
- `kl_vs_plain_recompute`: the same with pi_old recomputed, the reference forward fused into
  the recompute loop, over recompute + update without the reference.

The reference is a frozen copy of the policy (`training/reference.py`).
"""

from __future__ import annotations

import dataclasses

from bench_train_step import Setup, paired_ratio, print_measured, timed


def measure(quick: bool = False) -> dict[str, float]:
    """Median paired ratios (see the module docstring)."""
    from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
    from megatron_gspo.model.engine import EngineConfig
    from megatron_gspo.training.reference import ReferencePolicy
    from megatron_gspo.training.step.update import recompute_and_measure, train_on_batch

    init_distributed(ParallelConfig(), seed=0)
    try:
        setup = Setup.build("tiny_moe_cpu.yaml", routing_replay=False)
        reference = ReferencePolicy(_model_cfg(setup.cfg), ParallelConfig(), EngineConfig())
        reference.copy_from(setup.model)
        algo = setup.cfg.algorithm
        temperature = setup.cfg.rollout.temperature

        def update(kl: bool, recompute: bool):
            def run():
                plan = setup.plan(algo.num_mini_batches)
                step = dataclasses.replace(
                    algo, use_kl_loss=kl, old_logprobs="recompute" if recompute else "rollout"
                )
                if recompute:
                    recompute_and_measure(setup.model, plan, temperature, reference=reference if kl else None)
                elif kl:
                    reference.fill_plan(plan, temperature)
                train_on_batch(setup.model, setup.optimizer, setup.scheduler, plan, step,
                               temperature=temperature, max_response_length=4)  # fmt: skip

            return run

        variants = {
            "kl": update(True, False),
            "plain": update(False, False),
            "kl_recompute": update(True, True),
            "plain_recompute": update(False, True),
        }
        times = timed(variants, 3 if quick else 15)
        return {
            "kl_vs_plain": paired_ratio(times, "kl", "plain"),
            "kl_vs_plain_recompute": paired_ratio(times, "kl_recompute", "plain_recompute"),
        }
    finally:
        destroy_distributed()


def _model_cfg(cfg):
    from megatron_gspo.config import build_model_config

    return build_model_config(cfg)


if __name__ == "__main__":
    print_measured(measure, __doc__.splitlines()[0])
