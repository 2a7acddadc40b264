"""`megatron-gspo report` on the metrics of a real short training run (the `short_run` fixture)."""

import base64
import json
import re

import pytest
from cli_in_process import run_cli_in_process

from megatron_gspo.analysis.run_report import drift_heatmap, mismatch_by_length

PNG = b"\x89PNG\r\n\x1a\n"


def report(*args):
    return run_cli_in_process("report", *map(str, args))


def records_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_report_is_one_offline_page_with_every_panel(short_run, tmp_path):
    out = tmp_path / "page.html"
    done = report(short_run, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    page = out.read_text()
    # Self-contained: every src/href is a data URI (no CDN, no file next to it), no script.
    assert re.findall(r"""(?:src|href)=["'](?!data:)""", page) == []
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org", "")
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [title for title, _ in images] == [
        "Training reward",
        "Held-out accuracy",
        "KL",
        "Clip fractions",
        "Rollout/trainer log-prob mismatch by response length",
        "Routing drift per layer (pi_old -&gt; pi_theta)",
        "Routing drift per layer (inference -&gt; training)",
    ]
    assert all(base64.b64decode(data)[:8] == PNG for _, data in images)
    # The summary table holds the run's own numbers: last reward, last accuracy.
    rewards = [r["rollout/reward_mean"] for r in records_of(short_run) if "rollout/reward_mean" in r]
    row = re.search(r"<tr><td>rollout/reward_mean</td>(.*?)</tr>", page).group(1)
    first, last, low, high, points = re.findall(r"<td>([^<]+)</td>", row)
    assert float(first) == pytest.approx(rewards[0], rel=1e-3) and float(last) == pytest.approx(
        rewards[-1], rel=1e-3
    )
    assert float(low) == pytest.approx(min(rewards), rel=1e-3) and int(points) == len(rewards) == 4
    assert "drift:" in page and "enabled: true" in page  # the run's config.yaml follows


def test_heatmaps_hold_the_logged_values(short_run):
    records = records_of(short_run)
    steps, layers, matrix = drift_heatmap(records, "old_new")
    assert steps == [1, 2, 3, 4] and layers == [0, 1]
    for j, step in enumerate(steps):
        (record,) = [r for r in records if r["step"] == step]
        assert [matrix[i][j] for i in layers] == [record[f"drift/old_new/layer_{i}"] for i in layers]
    steps, buckets, matrix = mismatch_by_length(records)
    assert (
        steps == [1, 2, 3, 4] and buckets and buckets == sorted(buckets, key=lambda b: int(b.split("-")[0]))
    )
    for i, bucket in enumerate(buckets):
        logged = [r.get(f"rollout/mismatch_by_len/{bucket}/abs_diff_mean") for r in records if r["step"] >= 1]
        assert [v if v == v else None for v in matrix[i]] == logged
    assert any(v > 0 for row in matrix for v in row)  # bf16 rollouts: a real mismatch


def test_without_drift_metrics_the_page_says_how_to_get_them(short_run, tmp_path):
    lines = [{k: v for k, v in r.items() if not k.startswith("drift/")} for r in records_of(short_run)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    done = report(metrics)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    assert "no drift/old_new/layer_* metrics (drift.enabled=true measures them)" in page
    assert page.count("<img ") == 5


def test_a_directory_without_metrics_is_one_named_line(tmp_path):
    done = report(tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"megatron-gspo report: config error: report: {tmp_path / 'metrics.jsonl'} does not exist; "
        "give a run directory (trainer.run_dir) or its metrics.jsonl"
    ]
