"""Inference -> training drift against a rollout server whose router is perturbed on purpose.

The server (`megatron-gspo serve`, a separate process) loads a copy of the checkpoint whose last
layer's router has its rows cyclically shifted; once it listens, the original weights replace
the copy's files, so the server reports the path and weight_version the trainer starts from
(the start-up checks see nothing to sync) while it routes the last layer differently. One RL
step with `drift.enabled` compares the rollouts' `routed_experts` with the pi_old pass.

The expected drift is computed here, independently of the trainer, with HF transformers' own
forward (`output_router_logits`) of both checkpoints on the trained samples' routed tokens:
per layer, the mean over tokens of `1 - |top-k(served) ∩ top-k(original)| / k`. With
`max_new_tokens=1` a sample's routed tokens (all but its last) are exactly its prompt, which
samples.jsonl records. Layers before the perturbed one must show ~0; the negative control
(the server on the unperturbed weights) must show ~0 on the perturbed layer too.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from warm_python import python

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.tasks.tokenizer import build_char_tokenizer, encode_prompt
from megatron_gspo.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # a rollout server and a training run, each its own process

MODEL = tiny(vocab_size=80)
PERTURBED_LAYER = MODEL.num_layers - 1  # the last: its routing cannot change the layers before it
BATCH, GROUP = 8, 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(original, perturbed): the perturbed copy's last router has rows e <- e + 1 (mod E)."""
    root = tmp_path_factory.mktemp("hf")
    original = make_tiny_hf_checkpoint(root / "original", MODEL, build_char_tokenizer())
    perturbed = root / "perturbed"
    shutil.copytree(original, perturbed)
    (weights,) = perturbed.glob("*.safetensors")
    tensors = load_file(weights)
    key = f"model.layers.{PERTURBED_LAYER}.mlp.gate.weight"
    tensors[key] = tensors[key].roll(-1, dims=0).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return original, perturbed


def _serve_then_swap(served, original, serve_dir):
    """Start a server on a copy of `served` at `serve_dir`, then put `original`'s weights there."""
    shutil.copytree(served, serve_dir)
    cmd = [*python(), "-m", "megatron_gspo.cli", "serve", "--model", str(serve_dir), "--port", "0"]
    cmd += ["--dtype", "float32", "--weight-version", "0"]
    server = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    assert "listening on " in line, line
    for weights in original.glob("*.safetensors"):  # a new file: the server's loaded copy is untouched
        shutil.copy(weights, serve_dir / (weights.name + ".tmp"))
        os.replace(serve_dir / (weights.name + ".tmp"), serve_dir / weights.name)
    return server, line.split("listening on ")[1].strip()


def _train(url, hf_path, tmp_path):
    run_dir = tmp_path / "run"
    (tmp_path / "run.yaml").write_text(
        f"model: {{hf_path: {hf_path}}}\n"
        # format_reward pays a bare digit, so a random policy's groups differ and step 1 trains
        "task: {name: addition, add_bos: true, options: {min_digits: 1, max_digits: 2, format_reward: 0.5}}\n"
        "sft: {steps: 0}\n"
        f"rollout: {{rollout_batch_size: {BATCH}, group_size: {GROUP}, max_new_tokens: 1, "
        f"temperature: 1.0, server_urls: [{url}]}}\n"
        "algorithm: {num_mini_batches: 1}\n"
        "drift: {enabled: true, every: 1}\n"
        "eval: {at_start: false, at_end: false, every: 0}\n"
        f"trainer: {{steps: 1, run_dir: {run_dir}}}\n"
        f"logging: {{progress_bar: false, samples_per_step: {BATCH * GROUP}}}\n"
    )
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", "--config", str(tmp_path / "run.yaml")]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "start-up: the servers already serve" in done.stderr  # nothing synced before step 1
    return run_dir


def _topk(model, ids):
    """Per layer `[tokens, k]` expert ids HF transformers' router picks on `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True, use_cache=False).router_logits
    return [layer.view(len(ids), -1).topk(MODEL.moe_topk, dim=-1).indices for layer in logits]


def expected_drift(served, original, prompts):
    """Expected `drift/infer_train`: per layer and overall, served routing against the original.

    Returns:
        Per layer the mean over all routed tokens of `1 - overlap / k`, and the fraction of
        tokens routed differently in at least one layer.
    """
    served, original = (
        AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (served, original)
    )
    changed, tokens, tokens_changed = torch.zeros(MODEL.num_layers, dtype=torch.float64), 0, 0
    for ids in prompts:
        differs = torch.zeros(len(ids), dtype=torch.bool)
        for layer, (a, b) in enumerate(zip(_topk(served, ids), _topk(original, ids), strict=True)):
            overlap = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)
            changed[layer] += (1 - overlap.double() / MODEL.moe_topk).sum()
            differs |= overlap < MODEL.moe_topk
        tokens += len(ids)
        tokens_changed += int(differs.sum())
    return changed / tokens, tokens_changed / tokens


@pytest.mark.parametrize("perturb", [True, False], ids=["perturbed_server", "control"])
def test_infer_train_drift_is_the_servers_router_change(checkpoints, tmp_path, perturb):
    original, perturbed = checkpoints
    served = perturbed if perturb else original
    server, url = _serve_then_swap(served, original, tmp_path / "served")
    try:
        run_dir = _train(url, tmp_path / "served", tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=60)
    (step,) = read_metrics(run_dir / "metrics.jsonl")
    assert step["train/all_zero_adv_batch"] == 0  # the step trained, so drift was measured
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == BATCH * GROUP  # every trained sample
    tokenizer = build_char_tokenizer()
    prompts = [encode_prompt(tokenizer, row["prompt"], add_bos=True) for row in rows]
    expected, tokens_changed = expected_drift(served, original, prompts)
    got = [step[f"drift/infer_train/layer_{i}"] for i in range(MODEL.num_layers)]
    print(f"perturb={perturb}: trainer {got}, expected {expected.tolist()}")
    one_token = 1 / MODEL.moe_topk / sum(map(len, prompts))
    for layer in range(MODEL.num_layers):
        assert got[layer] == pytest.approx(float(expected[layer]), abs=2 * one_token)
    assert step["drift/infer_train/tokens_changed"] == pytest.approx(
        tokens_changed, abs=2 * one_token * MODEL.moe_topk
    )
    if perturb:
        assert expected[PERTURBED_LAYER] > 0.3  # the perturbation is visible (the check can fail)
    assert float(expected[:PERTURBED_LAYER].abs().max()) == 0.0  # the layers before it route alike
