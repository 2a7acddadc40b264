"""Expert-activation drift between two checkpoints, or a checkpoint and a rollout dump.

Both sides are run teacher-forced on the same token sequences with HF `Qwen3MoeForCausalLM`
(`output_router_logits`): a token's routing in a layer is the top-k of its router logits, the
same rule SGLang and megatron use. Sequences come from a rollout dump, or from greedy
completions of checkpoint A on the given prompts.

Rollout dump format (JSON lines, one sample per line):

    {"tokens": [int, ...], "prompt_length": P, "routed_experts": [[[int] * k] * layers] * (T - 1)}

`routed_experts` row t is the routing of the token at position t (SGLang's layout, T - 1 rows).

Outputs (`write_report`): drift_per_layer.png, ratio_spread.png (two checkpoints),
drift_over_steps.png (when a metrics.jsonl is given), summary.md and summary.json.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_gspo.algorithms.drift import DriftSummary, drift_counts


@dataclass
class Sample:
    """One token sequence with its prompt length and, from a dump, its recorded routing.

    Attributes:
        tokens: [T] int64.
        prompt_length: P (response tokens are tokens[P:]).
        routed_experts: [T - 1, layers, k] expert ids, or None.
    """

    tokens: torch.Tensor
    prompt_length: int
    routed_experts: torch.Tensor | None = None


def save_dump(path: str | os.PathLike, samples: Sequence[Sample]) -> None:
    """Write samples in the rollout dump format (JSON lines)."""
    with open(path, "w") as f:
        for s in samples:
            row = {"tokens": s.tokens.tolist(), "prompt_length": s.prompt_length}
            if s.routed_experts is not None:
                row["routed_experts"] = s.routed_experts.tolist()
            f.write(json.dumps(row) + "\n")


def load_dump(path: str | os.PathLike) -> list[Sample]:
    """Read a rollout dump; errors name the line and the field."""
    samples = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not a JSON line ({err.msg})") from None
        if not isinstance(row, dict) or "tokens" not in row or "prompt_length" not in row:
            raise ValueError(f"{path}:{i}: a dump line needs 'tokens' and 'prompt_length'")
        tokens = torch.tensor(row["tokens"], dtype=torch.long)
        routes = row.get("routed_experts")
        routes = None if routes is None else torch.tensor(routes, dtype=torch.long)
        if routes is not None and (routes.ndim != 3 or routes.shape[0] != len(tokens) - 1):
            raise ValueError(
                f"{path}:{i}: routed_experts shape {tuple(routes.shape)}, "
                f"expected [T-1={len(tokens) - 1}, layers, k]"
            )
        samples.append(Sample(tokens, int(row["prompt_length"]), routes))
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


ROUTING_FIELDS = ("num_hidden_layers", "num_experts", "num_experts_per_tok")
"""What two models' routings must share to be compared expert by expert."""


def check_same_routing(model_a, model_b) -> None:
    """Refuse two models whose routings cannot be compared, naming what differs."""
    differ = [
        f"{field} {getattr(model_a.config, field)} vs {getattr(model_b.config, field)}"
        for field in ROUTING_FIELDS
        if getattr(model_a.config, field) != getattr(model_b.config, field)
    ]
    if differ:
        raise ValueError(
            f"the checkpoints route differently ({', '.join(differ)}): drift compares the same experts "
            "of the same layers; give two checkpoints of one architecture"
        )


def load_hf(path: str | os.PathLike):
    """An HF causal LM in fp32 eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing `[T - 1, layers, k]` and per-token log-probs `[T]` (entry 0 is 0) of one sequence."""
    out = model(tokens[None], output_router_logits=True)
    k = model.config.num_experts_per_tok
    router = torch.stack([r.float() for r in out.router_logits], dim=1)  # [T, layers, E]
    routing = router[:-1].topk(k, dim=-1).indices
    logp = torch.log_softmax(out.logits[0].double(), -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
    return routing, torch.cat([logp.new_zeros(1), logp])


@torch.no_grad()
def greedy_samples(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Sample]:
    """Greedy completions of `model` (the sequences both checkpoints are compared on)."""
    samples = []
    for ids in prompts:
        prompt = torch.tensor([list(ids)], dtype=torch.long)
        out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        samples.append(Sample(out[0], len(ids)))
    return samples


@dataclass
class DriftReport:
    """What `compare` measured.

    Attributes:
        label: what was compared (for titles).
        drift: per-layer drift of side b against side a over all positions with routing.
        num_sequences: sequences compared.
        log_token_ratios: per response token, log pi_b - log pi_a (two checkpoints only).
        log_seq_ratios: per response, the length-normalised (GSPO) log ratio.
    """

    label: str
    drift: DriftSummary
    num_sequences: int
    log_token_ratios: list[float] = field(default_factory=list)
    log_seq_ratios: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        """JSON-ready numbers."""
        out = {
            "label": self.label,
            "num_sequences": self.num_sequences,
            "num_tokens": self.drift.num_tokens,
            "drift_per_layer": self.drift.per_layer.tolist(),
            "drift_mean": self.drift.mean,
            "tokens_changed_any_layer": self.drift.tokens_changed,
            "load_shift_per_layer": self.drift.load_shift.tolist(),
        }
        if self.log_token_ratios:
            out["log_token_ratio_std"] = _std(self.log_token_ratios)
            out["log_seq_ratio_std"] = _std(self.log_seq_ratios)
        return out


def _std(values: Sequence[float]) -> float:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.std()) if len(t) > 1 else 0.0


def compare(model_a, samples: Sequence[Sample], *, model_b=None, label: str = "") -> DriftReport:
    """Drift of model_b (or of the dump's recorded routing) against model_a on `samples`.

    With `model_b`, also the token- and sequence-level log ratios on the response tokens.
    Without it every sample must carry `routed_experts` (a rollout dump): drift is then
    inference (dump) -> model_a.
    """
    num_experts = model_a.config.num_experts
    total, tok_ratios, seq_ratios = None, [], []
    for i, s in enumerate(samples):
        routing_a, logp_a = teacher_forced(model_a, s.tokens)
        if model_b is not None:
            routing_b, logp_b = teacher_forced(model_b, s.tokens)
            diff = (logp_b - logp_a)[s.prompt_length :]
            tok_ratios += diff.tolist()
            seq_ratios.append(float(diff.mean()) if len(diff) else 0.0)
            reference, other = routing_a, routing_b
        else:
            if s.routed_experts is None:
                raise ValueError(f"sample {i} has no routed_experts to compare the checkpoint with")
            if s.routed_experts.shape != routing_a.shape:
                raise ValueError(
                    f"sample {i}: routed_experts {tuple(s.routed_experts.shape)} vs the checkpoint's "
                    f"{tuple(routing_a.shape)} (layers or k differ)"
                )
            ids = s.routed_experts
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < num_experts:
                raise ValueError(
                    f"sample {i}: routed_experts ids {int(ids.min())}..{int(ids.max())} are not experts "
                    f"of the checkpoint's {num_experts}"
                )
            reference, other = s.routed_experts, routing_a
        counts = drift_counts(reference, other, num_experts=num_experts)
        total = counts if total is None else total + counts
    return DriftReport(label, total.summary(), len(samples), tok_ratios, seq_ratios)


def _plt():
    from megatron_gspo.optional import require

    matplotlib = require("matplotlib", "megatron-gspo drift's figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_drift_per_layer(report: DriftReport, path: Path) -> None:
    """Bar chart: drift per layer, with the mean as a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = report.drift.per_layer.tolist()
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.axhline(report.drift.mean, color="tab:red", ls="--", label=f"mean {report.drift.mean:.3f}")
    ax.set(
        xlabel="MoE layer", ylabel="fraction of top-k experts changed", title=f"Expert drift {report.label}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ratio_spread(report: DriftReport, path: Path) -> None:
    """Histograms of log token ratios vs log (length-normalised) sequence ratios."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(report.log_token_ratios, bins=40, alpha=0.6, density=True, label="token log-ratio (GRPO)")
    ax.hist(report.log_seq_ratios, bins=40, alpha=0.6, density=True, label="sequence log-ratio (GSPO)")
    ax.set(xlabel="log pi_b / pi_a", ylabel="density", title="Importance-ratio spread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drift_metric_keys(metrics_path: Path) -> tuple[list[dict], list[str]]:
    """The records of a metrics.jsonl and its `drift/*/mean` and `drift/*/tokens_changed` keys.

    Raises:
        ValueError: the file cannot be read, or holds no drift metrics (named, with the setting
            that records them).
    """
    try:
        text = Path(metrics_path).read_text()
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError) as err:
        raise ValueError(f"--metrics {metrics_path} is not a readable metrics.jsonl: {err}") from None
    keys = sorted(
        {k for r in records for k in r if k.startswith("drift/") and k.endswith(("/mean", "changed"))}
    )
    if not keys:
        raise ValueError(
            f"--metrics {metrics_path} has no drift/* metrics: the run was trained without "
            "drift.enabled=true (drop --metrics, or give such a run's metrics.jsonl)"
        )
    return records, keys


def plot_drift_over_steps(metrics_path: Path, path: Path) -> list[str]:
    """Lines of every `drift/*/mean` and `drift/*/tokens_changed` key of a metrics.jsonl over steps."""
    records, keys = drift_metric_keys(metrics_path)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=key)
    ax.set(xlabel="RL step", ylabel="drift", title="Expert drift during training")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return keys


def write_report(report: DriftReport, out_dir: str | os.PathLike, *, metrics: str | None = None) -> dict:
    """PNGs, summary.md and summary.json in `out_dir`; returns the summary dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = report.summary()
    plot_drift_per_layer(report, out / "drift_per_layer.png")
    files = ["drift_per_layer.png"]
    if report.log_token_ratios:
        plot_ratio_spread(report, out / "ratio_spread.png")
        files.append("ratio_spread.png")
    if metrics:
        summary["metrics_keys"] = plot_drift_over_steps(Path(metrics), out / "drift_over_steps.png")
        files.append("drift_over_steps.png")
    summary["figures"] = files
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Expert-activation drift: {report.label}",
        "",
        f"{summary['num_sequences']} sequences, {summary['num_tokens']} routed tokens.",
        f"Mean drift {summary['drift_mean']:.4f}; tokens whose routing differs in >= 1 layer: "
        f"{summary['tokens_changed_any_layer']:.4f}.",
        "",
        "| layer | drift | load shift (L1) |",
        "|---:|---:|---:|",
    ]
    for i, (d, s) in enumerate(zip(summary["drift_per_layer"], summary["load_shift_per_layer"])):
        lines.append(f"| {i} | {d:.4f} | {s:.4f} |")
    if "log_token_ratio_std" in summary:
        lines += [
            "",
            f"Std of log ratios: token {summary['log_token_ratio_std']:.4f}, "
            f"sequence (length-normalised) {summary['log_seq_ratio_std']:.4f}.",
        ]
    lines += ["", *[f"![{f}]({f})" for f in files], ""]
    (out / "summary.md").write_text("\n".join(lines))
    return summary
