"""Optional W&B logging of the step metrics, in offline mode (no network, no account).

The offline run file W&B writes (`run-<id>.wandb`: LevelDB-style log blocks of W&B's own
protobuf records) is read back with W&B's protobuf classes, so the test sees what `wandb sync`
would upload: one history row per logged step with the same numbers as metrics.jsonl.
"""

import json
import math
import struct
import time

import pytest

from megatron_gspo.config import ConfigError, WandbConfig, load_config, validate
from megatron_gspo.training.metrics import WANDB_ID_FILE, MetricsLogger, read_metrics

wandb = pytest.importorskip(
    "wandb", reason="W&B logging is an optional extra: pip install 'megatron-gspo[wandb]'"
)

BLOCK = 32 * 1024  # the log format's block size; a record header is crc32 (4), length (2), type (1)


def history(run_file) -> list[dict]:
    """History rows of an offline W&B run file."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = run_file.read_bytes(), 7, b"", []  # 7: the file's own header
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def history_of(run_file, rows: int, timeout: float = 60.0) -> list[dict]:
    """The history once `rows` rows are there: W&B's core process may still be writing after finish()."""
    deadline = time.monotonic() + timeout
    while len(found := history(run_file)) < rows and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # W&B's capture of stdout would fight pytest's
    return WandbConfig(project="megatron-gspo-test", mode="offline", tags=["test"])


def log_steps(run_dir, settings, steps, first_step=0):
    logger = MetricsLogger(
        run_dir, total_steps=4, first_step=first_step, tensorboard=False, progress_bar=False, wandb=settings,
        run_config={"trainer": {"steps": 4}},
    )  # fmt: skip
    for step in steps:
        logger.log(
            step, {"rollout/reward_mean": 0.25 * step, "actor/entropy": math.nan if step == 1 else 1.5}
        )
    logger.close()


def test_offline_wandb_holds_the_metrics_and_a_resume_continues_the_run(tmp_path, offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log_steps(run_dir, offline, [0, 1, 2])
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    (first,) = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    rows = history_of(first, 3)
    assert [r["_step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/reward_mean"] for r in rows] == [0.0, 0.25, 0.5]
    # NaN is not sent (it is null in metrics.jsonl)
    assert [r.get("actor/entropy") for r in rows] == [1.5, None, 1.5]
    assert [r["rollout/reward_mean"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0.0, 0.25, 0.5]
    # W&B names an offline run's directory by the second it starts: a resume in the same
    # second as the first run would write into the first run's directory
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    log_steps(run_dir, offline, [3], first_step=3)  # resumed after step 2: the same W&B run id
    files = sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    (second,) = [f for f in files if f != first]
    assert [r["_step"] for r in history_of(second, 1)] == [3]


def test_wandb_section_is_checked_at_start_up(monkeypatch):
    with pytest.raises(ConfigError, match="section 'logging.wandb': Invalid value 'sometimes'"):
        load_config(overrides=["logging.wandb.mode=sometimes"])
    cfg = load_config(overrides=["logging.wandb.project=p", "logging.wandb.mode=offline"])
    validate(cfg)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"wandb package is not installed: pip install 'megatron-gspo\[wandb\]'"
    ):
        validate(cfg)
