"""User errors through the CLI as a user meets them: one named line on stderr, exit 2, no traceback.

What is refused before any work runs through the CLI's `main` in this process (`refused`); a
case that starts processes, or whose traceback is the point, runs `megatron-gspo` in a subprocess.
`--debug` brings the traceback back.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli_in_process as refused

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_moe_cpu.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        cwd=REPO,
    )


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("trainer: {steps: 3\n", "is not valid YAML"),  # syntax error
        ("trainer: !!python/object:os.system {}\n", "is not valid YAML"),  # unsafe tag refused
        ("trainer: !custom {steps: 3}\n", "is not valid YAML"),  # unknown tag
        ("a: &x [*x]\n", "recursive aliases"),
        (b"trainer: {run_dir: \xff}\n", "UTF-8"),
    ],
)
def test_bad_yaml_is_one_named_line(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_user_error(refused("train", "--config", str(path)), str(path), needle)


def test_config_directory_is_named(tmp_path):
    assert_user_error(refused("train", "--config", str(tmp_path)), "is a directory")


def test_unknown_logging_level():
    assert_user_error(refused("train", "--config", TINY, "logging.level=LOUD"), "logging.level", "LOUD")


def test_nproc_below_one():
    assert_user_error(refused("train", "--config", TINY, "--nproc", "0"), "--nproc must be >= 1")


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("train", "--debug", "--config", str(tmp_path))
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "is a directory" in result.stderr


def test_error_after_startup_is_named(tmp_path):
    """vocab smaller than the tokenizer is found after distributed start-up: still exit 2, one line."""
    result = run_cli(
        "train", "--config", TINY, "model.overrides.vocab_size=8", f"trainer.run_dir={tmp_path}/run"
    )
    assert_user_error(result, "vocab_size=8 is smaller than the tokenizer")


def test_nproc_layout_error_before_workers_start(tmp_path):
    result = run_cli(
        "train", "--config", TINY, "--nproc", "3", "parallel.expert_parallel=2", f"trainer.run_dir={tmp_path}"
    )
    assert_user_error(result)
    assert "ChildFailedError" not in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.multiprocess
def test_nproc_worker_error_reported_once(tmp_path):
    """An error raised inside the torchrun workers: the message once, no torchrun failure dump."""
    result = run_cli(
        "train",
        "--config",
        TINY,
        "--nproc",
        "2",
        "model.overrides.vocab_size=8",
        f"trainer.run_dir={tmp_path}/run",
    )
    assert_user_error(result, "vocab_size=8 is smaller than the tokenizer")
    assert result.stderr.count("vocab_size=8") == 1, result.stderr
    assert "ChildFailedError" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.temperature=nan", "rollout.temperature=nan: every number in the config must be finite"),
        ("optim.lr=inf", "optim.lr=inf"),
        ("algorithm.loss_options.clip_low=nan", "option clip_low must be a real number"),
        ("rollout.top_k=0", "rollout.top_k=0"),
        ("rollout.max_retries=-1", "rollout.max_retries must be >= 0"),
        ("rollout.request_timeout_s=-5", "rollout.request_timeout_s must be > 0"),
        ("rollout.batch_timeout_s=0", "rollout.batch_timeout_s must be > 0"),
        ("rollout.server_threads=0", "rollout.server_threads must be >= 1"),
        ("rollout.server_urls=[ftp://host:1]", "is not an http(s) URL"),
        ("rollout.server_urls=[localhost:30000]", "is not an http(s) URL"),
        ("model.overrides.hidden_size=0", "model hidden_size=0 must be >= 1"),
        ("model.overrides.num_experts=-8", "num_experts=-8"),
        ("model.overrides.num_layers=100000", "model num_layers=100000 exceeds 1024"),
        ("rollout.rollout_batch_size=10000000", "responses per step exceeds"),
        ("eval.num_problems=100000000", "eval.num_problems=100000000 exceeds"),
        ("eval.pass_k=[4]", "eval.pass_k=[4] needs eval.samples_per_problem > 0"),
        ("eval.samples_per_problem=-1", "eval.samples_per_problem=-1 must be in [0, 1024]"),
    ],
)
def test_values_refused_at_startup(tmp_path, override, needle):
    result = refused("train", "--config", TINY, override, f"trainer.run_dir={tmp_path}/run")
    assert_user_error(result, needle)
    assert not (tmp_path / "run").exists(), "refused before creating the run dir"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["eval.samples_per_problem=4", "eval.pass_k=[1,8]"], "each k must be in [1, 4]"),
        (["eval.samples_per_problem=4", "eval.temperature=0"], "eval.temperature=0.0 must be > 0"),
    ],
)
def test_pass_at_k_options_refused_at_startup(tmp_path, overrides, needle):
    result = refused("train", "--config", TINY, *overrides, f"trainer.run_dir={tmp_path}/run")
    assert_user_error(result, needle)


def test_unwritable_run_dir_refused_before_sft(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = refused("train", "--config", TINY, f"trainer.run_dir={blocker}/run")
    assert_user_error(result, "cannot be written")
    assert "SFT" not in result.stderr


def test_resume_without_checkpoint(tmp_path):
    run_dir = f"trainer.run_dir={tmp_path}/run"
    assert_user_error(refused("train", "--config", TINY, "--resume", run_dir), "holds no checkpoint")


@pytest.mark.slow  # a real training run: ~11 s on a shared box
def test_resume_or_start_starts_fresh(tmp_path):
    result = run_cli(
        "train",
        "--config",
        TINY,
        "--resume-or-start",
        f"trainer.run_dir={tmp_path}/run",
        "trainer.steps=1",
        "sft.steps=2",
        "eval.num_problems=4",
        "eval.at_start=false",
        "rollout.rollout_batch_size=4",
        "rollout.group_size=2",
        "algorithm.num_mini_batches=1",
        "logging.progress_bar=false",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_overrides_before_and_after_options_are_all_read():
    result = refused("train", "--config", TINY, "trainer.save_every=1", "--nproc", "2", "trainer.steps=-1")
    assert_user_error(result, "config error", "trainer.steps")


def test_serve_on_a_busy_port_is_one_line_before_the_model_loads(tmp_path):
    import socket

    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=80))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = run_cli("serve", "--model", str(model), "--port", str(port))
    assert_user_error(result, f"cannot listen on 127.0.0.1:{port}", "choose another --port")


def test_drift_metrics_without_drift_is_refused_before_any_work(tmp_path):
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path / "hf", tiny(vocab_size=80))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    out = tmp_path / "report"
    result = refused(
        "drift", "--a", str(model), "--b", str(model), "--metrics", str(metrics), "--out", str(out)
    )
    assert_user_error(result, f"--metrics {metrics} has no drift/* metrics", "drift.enabled=true")
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["{data}", "--row", "9", "--program", "{program}"], ["score --row 9", "has lines 1 to 2"]),
        (["{data}", "--id", "nope", "--program", "{program}"], ["score --id nope", "problem_id"]),
        (["{data}", "--row", "2", "--program", "{program}"], ["line 2", "the problem has no tests"]),
        (["{data}", "--row", "1", "--program", "{data}.missing"], ["score --program", "No such file"]),
        (["--row", "1", "--program", "{program}"], ["give the data file (DATA) or a --config"]),
        (["--config", TINY, "--row", "1", "--program", "{program}"], ["score is for the code task"]),
        (["{data}", "--row", "1", "--program", "{program}", "--task-option", "bogus=1"], ["bogus"]),
    ],
)
def test_score_refusals_are_one_named_line(tmp_path, args, needles):
    """A row out of range, an id no row has, a bad row (APPS's empty tests), a missing file, no
    data, a config of another task, an unknown option: named, exit 2 (1 is a failing program)."""
    import json

    data = tmp_path / "apps.jsonl"
    rows = [{"problem_id": 1, "question": "q", "input_output": {"inputs": ["1\n"], "outputs": ["1\n"]}},
            {"problem_id": 2, "question": "q", "input_output": {"inputs": [], "outputs": []}}]  # fmt: skip
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    program = tmp_path / "main.py"
    program.write_text("print(input())\n")
    filled = [a.replace("{data}", str(data)).replace("{program}", str(program)) for a in args]
    assert_user_error(refused("score", *filled), *needles)
