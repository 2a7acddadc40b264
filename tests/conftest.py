"""Suite-wide fixtures and markers.

A test that starts several processes (torchrun, gloo) is also `slow`, and so is a test on the
`short_run` fixture (a real training run): `pytest -m "not slow"` is the quick subset, every
module, single-process tests of seconds.

With `MEGATRON_GSPO_NO_SKIPS=1` (set by `.ci/run`) a skip fails the test, unless it is for what
a CPU box cannot have (`tests/gpu/`: CUDA devices, TransformerEngine) or for a megatron-core line
the test does not apply to: a test that skips because SGLang's receiver environment, the router
or a system tool is missing would otherwise pass CI unseen.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from warm_python import WarmServer, python

WARM_SERVER = pytest.StashKey[WarmServer]()

REPO = Path(__file__).resolve().parents[1]
GPU_TESTS = REPO / "tests" / "gpu"
SKIP_ALLOWED_REASONS = ("megatron-core",)  # the test is for another megatron-core line
SHORT_RUN = [
    "--config",
    str(REPO / "configs" / "tiny_moe_cpu.yaml"),
    "trainer.steps=4",
    "trainer.save_every=2",
    "sft.steps=30",
    "task.options.format_reward=0.5",  # partial credit: non-zero advantages in 4 steps
    "rollout.temperature=1.0",
    "rollout.dtype=bf16",  # a bf16 server: non-zero rollout/trainer mismatch
    "rollout.rollout_batch_size=8",
    "rollout.group_size=4",
    "algorithm.num_mini_batches=2",
    "drift.enabled=true",
    "eval.every=2",
    "eval.num_problems=20",
    "logging.progress_bar=false",
]


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> Path:
    """Run directory of a real 4-step `megatron-gspo train` of the tiny MoE (checkpoints at 2 and 4).

    Its metrics hold rewards, accuracy, KL, clip fractions, mismatch by length and per-layer
    drift; tools and reports are tested on it as a user would point them at their own run.
    Under pytest-xdist the workers share one run: the first to need it trains, the others wait.
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's folder, above each worker's own
    run_dir, finished = shared / "short_run" / "run", shared / "short_run" / "finished"
    with FileLock(shared / "short_run.lock"):
        if not finished.is_file():
            cmd = [*python(), "-m", "megatron_gspo.cli", "train", *SHORT_RUN]
            cmd.append(f"trainer.run_dir={run_dir}")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-4000:]
            finished.touch()
    return run_dir


def pytest_collection_modifyitems(items):
    for item in items:
        expensive = item.get_closest_marker("multiprocess") is not None or "short_run" in item.fixturenames
        if expensive and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if _one_stack(item):
            item.add_marker(pytest.mark.one_stack)
    # The modules holding slow tests first, the longest of them first: under pytest-xdist
    # (`-n 2 --dist loadscope`, a module's tests on one worker, its module-scoped fixtures made
    # once) a worker takes the next module when it is free, so the run's tail is a quick module's
    # and not one long module running while the other worker idles.
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.path not in slow_modules, -module_seconds(item.path)))


MODULE_SECONDS = {  # a worker's seconds in the 3.12 stage (-n 2, 2026-11-29): an ordering hint, not a bound
    "model/test_parity_cli.py": 570,
    "training/test_train_multiprocess.py": 540,
    "training/test_checkpoint_reshard.py": 355,
    "training/test_checkpoint_resume.py": 320,
    "training/test_user_flows.py": 295,
    "training/test_fleet_sync.py": 240,
    "training/test_train_cli.py": 240,
    "training/test_export.py": 210,
    "model/test_pipeline_weights.py": 155,
    "patches/test_patches.py": 150,
    "test_cli_user_errors.py": 145,
    "training/test_startup_sync.py": 140,
    "training/test_sft_target_multiprocess.py": 140,  # one test: never the run's tail
    "weight_sync/test_weight_sync_multiprocess.py": 120,
    "training/test_train_routing_replay.py": 120,
    "rollout/test_real_sglang.py": 120,  # with SGLang's start
    "training/test_fleet_real_sglang.py": 110,
    "training/test_train_real_sglang.py": 70,
    "placement/test_colocated_real_sglang.py": 70,
    "placement/test_colocated_run.py": 110,  # one test, two runs
    "training/test_fleet_loss.py": 105,
    "rollout/test_router_fleet.py": 100,
    "training/test_async_rollouts.py": 90,
    "training/test_launcher_signals.py": 90,
    "training/test_math_run.py": 75,
    "training/test_reference_multiprocess.py": 65,
    "model/hf/test_convert_multiprocess.py": 45,
}


def _module(path: Path) -> str:
    return path.relative_to(REPO / "tests").as_posix()


def module_seconds(path: Path) -> int:
    """A module's measured run time (0 when not measured: it keeps its place)."""
    return MODULE_SECONDS.get(_module(path), 0)


# Modules whose quick tests never import megatron-core nor start torch.distributed, in the test's
# process or in any process it starts (servers, CLIs): `one_stack`, which `.ci/run` runs on the
# 3.11 stage only. Found by running each module's quick tests alone with an import hook in every
# process (tests/README.md, "One stage only"); the fixture below fails a listed test that imports
# megatron-core where it was not imported yet.
ONE_STACK_MODULES = frozenset(
    """
algorithms/test_drift.py algorithms/test_group_advantages.py
algorithms/test_gspo_token_equivalence.py algorithms/test_kl_and_aggregation.py
algorithms/test_mismatch_by_length.py algorithms/test_policy_loss_errors.py
algorithms/test_policy_loss_properties.py algorithms/test_policy_loss_values.py
algorithms/test_rollout_correction.py algorithms/test_split_invariance.py
algorithms/test_token_kl.py
analysis/test_drift_report.py analysis/test_logprob_mismatch.py analysis/test_run_report.py
analysis/test_tool_prompts.py
benchmarks/test_reproduce_quick.py benchmarks/test_run_quick.py
benchmarks/test_stability_grid.py benchmarks/test_staleness_sweep.py
model/fp8/test_fp8.py model/hf/test_hf_checkpoint.py model/hf/test_hf_stream.py
model/test_routing_layout.py
rollout/test_batch.py rollout/test_client.py rollout/test_client_embedded.py
rollout/test_client_router_args.py rollout/test_parent_watch.py rollout/test_partial_merge.py
rollout/test_serve_checkpoints.py rollout/test_server.py rollout/test_server_engine.py
rollout/test_server_robustness.py rollout/test_server_scheduler.py weight_sync/test_update_group.py
rollout/test_validation.py rollout/test_weight_version_spans.py
tasks/test_arithmetic_tasks.py tasks/code/test_code_dataset.py tasks/code/test_code_reward_table.py
tasks/math/test_math_data_files.py tasks/math/test_math_dataset.py tasks/math/test_math_reward.py
tasks/math/test_math_reward_table.py tasks/test_prompt_stream.py tasks/code/test_sandbox.py
tasks/test_task_evaluation.py tasks/test_task_registry.py tasks/test_task_tokenizer.py
test_config.py test_docs.py test_fp8_serving.py test_gpu_smoke_wheels.py test_import_floors.py
test_plan.py test_sglang_launcher.py test_sglang_launcher_bind.py
training/test_async_rollouts.py training/test_balance.py training/test_batch_scoring.py
training/test_checkpoint_source.py training/test_drift_sampling.py training/test_export.py
training/test_math_run.py training/test_metrics_wandb.py training/test_micro_batching.py
training/test_progress_bar.py training/test_rollout_queue.py training/test_rollout_step.py
training/test_rollouts_ahead.py training/test_samples_log.py training/test_sampling_seeds.py
training/test_save_schedule.py training/test_segment_staleness.py weight_sync/test_shm_exports.py
test_termination.py
""".split()
)


# End-to-end modules of the control plane: what they check is processes, signals, HTTP, files, the
# rollout fleet and the run directory. Their runs use megatron-core only as the default model at a
# world of one (or two plain data-parallel ranks), which the modules left on both stages train, save,
# resume, reshard and compare at every layout on each megatron-core line. Their slow tests run on the
# 3.11 stage only (tests/README.md, "One stage only").
ONE_STACK_RUN_MODULES = frozenset(
    """
analysis/test_drift_report.py analysis/test_logprob_mismatch.py analysis/test_tool_prompts.py
rollout/test_partial_rollouts.py rollout/test_router_fleet.py rollout/test_serve_checkpoints.py
rollout/test_server_pause.py
test_cli_user_errors.py
training/test_async_rollouts.py training/test_checkpoint_kill.py placement/test_colocated_run.py
placement/test_colocated_real_sglang.py
training/test_fleet_loss.py training/test_fleet_real_sglang.py training/test_fleet_sync.py
training/test_infer_train_drift_server.py
training/test_inflight_updates.py training/test_launcher_signals.py training/test_math_run.py
weight_sync/test_sender_memory.py rollout/test_server_checks.py training/test_startup_sync.py
test_termination.py training/test_train_cli.py training/test_user_flows.py
weight_sync/test_weight_sync.py weight_sync/test_weight_sync_tensor_handles.py
""".split()
)


def _one_stack(item) -> bool:
    module, slow = _module(item.path), item.get_closest_marker("slow") is not None
    return module in (ONE_STACK_RUN_MODULES if slow else ONE_STACK_MODULES)


def _on_megatron_or_distributed() -> bool:
    dist = sys.modules.get("torch.distributed")
    started = dist is not None and dist.is_available() and dist.is_initialized()
    return started or "megatron.core" in sys.modules


@pytest.fixture(autouse=True)
def _one_stack_stays_off_megatron(request):
    quick = request.node.get_closest_marker("slow") is None
    watch = quick and request.node.get_closest_marker("one_stack") and not _on_megatron_or_distributed()
    yield
    assert not (watch and _on_megatron_or_distributed()), (
        f"{request.node.nodeid} imports megatron-core or starts torch.distributed: take "
        f"{_module(request.node.path)} out of ONE_STACK_MODULES (tests/conftest.py), so that it runs on "
        "both megatron-core lines"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not os.environ.get("MEGATRON_GSPO_NO_SKIPS") or GPU_TESTS in item.path.parents:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in SKIP_ALLOWED_REASONS):
        report.outcome = "failed"
        report.longrepr = f"skipped, and MEGATRON_GSPO_NO_SKIPS=1 wants it run: {reason}"


class StageTimeline:
    """Where a `-n 2` run's wall time ends: each worker's last tests and how long it idled at the end.

    On with MEGATRON_GSPO_TIMELINE=1 (`.ci/run`). A test's span runs from its set-up's start to its
    tear-down's end, so a module fixture made by its first test counts there.
    """

    def __init__(self) -> None:
        self.spans: dict[str, list] = {}  # nodeid -> [worker, start, stop]

    def pytest_runtest_logreport(self, report) -> None:
        worker = getattr(getattr(report, "node", None), "gateway", None)
        where = worker.id if worker else "main"
        span = self.spans.setdefault(report.nodeid, [where, report.start, report.stop])
        span[1], span[2] = min(span[1], report.start), max(span[2], report.stop)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.spans:
            return
        start = min(s for _, s, _ in self.spans.values())
        end = max(e for _, _, e in self.spans.values())
        terminalreporter.section("stage timeline (seconds from the first test's start)")
        for worker in sorted({w for w, _, _ in self.spans.values()}):
            mine = sorted((e, s, nodeid) for nodeid, (w, s, e) in self.spans.items() if w == worker)
            busy = sum(e - s for e, s, _ in mine)
            terminalreporter.write_line(
                f"{worker}: {len(mine)} tests, busy {busy:.0f} s, done at {mine[-1][0] - start:.0f} s "
                f"(idle for the last {end - mine[-1][0]:.0f} s); its last tests:"
            )
            for e, s, nodeid in mine[-5:]:
                terminalreporter.write_line(f"  {s - start:7.0f} -> {e - start:7.0f}  {nodeid}")


def pytest_configure(config):
    # pytest-xdist >= 3.8 hands out `--dist loadscope` modules largest (most tests) first, which put
    # the long multi-process modules with few tests (test_train_multiprocess: 5 tests, ~9 minutes of
    # a worker) at the 3.12 stage's end. The order of collection above is the schedule.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("MEGATRON_GSPO_TIMELINE") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(StageTimeline(), "megatron-gspo-stage-timeline")
    # Each process that runs tests forks its CLIs and embedded servers from a warm Python
    # (tests/warm_python.py); MEGATRON_GSPO_FRESH_PYTHON=1 starts every one afresh instead. Not
    # on a GPU machine: importing megatron-core asks the CUDA driver for devices, and a process
    # forked after that cannot use CUDA.
    runs_tests = os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None)
    gpu_machine = Path("/dev/nvidiactl").exists()
    if runs_tests and not gpu_machine and not os.environ.get("MEGATRON_GSPO_FRESH_PYTHON"):
        # MKL takes OMP_NUM_THREADS when MKL_NUM_THREADS is unset. Saying so keeps forkable the
        # programs launched with both set (benchmarks/reproduce.py's training runs).
        if "OMP_NUM_THREADS" in os.environ:
            os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
        config.stash[WARM_SERVER] = WarmServer()


def pytest_unconfigure(config):
    if WARM_SERVER in config.stash:
        config.stash[WARM_SERVER].stop()
