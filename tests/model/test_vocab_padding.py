"""A vocabulary the tensor-parallel size does not divide: padded as megatron pads it, never seen.

Megatron pads the embedding and output layer to a multiple of `make_vocab_size_divisible_by`
x TP. The padded logits must never be sampled or enter a softmax (log-probs, entropy), and
export / weight sync must write the real vocabulary only. The checkpoint's vocabulary is 49
(odd); the reference is HF transformers' forward.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_torchrun import torchrun
from test_hf_config import VOCAB, save_hf
from transformers import AutoModelForCausalLM

from megatron_gspo.model.builder import build_model
from megatron_gspo.model.distributed import ParallelConfig, init_distributed
from megatron_gspo.model.generate import greedy_generate
from megatron_gspo.model.hf.checkpoint import load_hf_state_dict
from megatron_gspo.model.hf.convert import (
    load_hf_checkpoint,
    random_tokens,
    read_hf_config,
)
from megatron_gspo.model.hf.export import export_hf_checkpoint
from megatron_gspo.model.hf.stream import iter_hf_tensors
from megatron_gspo.model.logprobs import sequence_logprobs

WORKER = Path(__file__).with_name("vocab_padding_worker.py")
TOLERANCE = 1e-5


def hf_reference(path, tokens):
    """(log-probs [B, T] with column 0 = 0, entropy [B, T - 1]) of HF's forward, float64."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=tokens).logits.double(), -1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], 1), entropy, hf


def test_padding_rows_are_masked_zero_gradient_and_not_exported(tmp_path):
    assert VOCAB % 2 == 1
    path = save_hf(tmp_path / "ckpt", seed=3)
    parallel = ParallelConfig(make_vocab_size_divisible_by=16)
    init_distributed(parallel, seed=3)
    cfg = read_hf_config(path)
    model = build_model(cfg, parallel).eval()
    assert model.vocab_size == 64  # megatron's rows: 49 rounded up to a multiple of 16
    load_hf_checkpoint(model, path)
    out_rows = model.output_layer.weight[VOCAB:]
    assert torch.equal(out_rows, torch.zeros_like(out_rows))
    with torch.no_grad():  # padded logits that would win every argmax and dominate every softmax
        model.output_layer.weight[VOCAB:] = 5.0 * model.output_layer.weight[:VOCAB].abs().max()
        model.embedding.word_embeddings.weight[VOCAB:] = float("nan")  # never looked up either
    tokens = random_tokens(VOCAB, 3, 40, seed=7)
    expected, expected_entropy, hf = hf_reference(path, tokens)
    logprobs, entropy = sequence_logprobs(model, list(tokens), with_entropy=True)
    worst = (logprobs.double() - expected)[:, 1:].abs().max().item()
    worst_entropy = (entropy.double()[:, 1:] - expected_entropy).abs().max().item()
    print(f"padded 49 -> 64: |dlogprob| max={worst:.2e}, |dentropy| max={worst_entropy:.2e}")
    assert worst <= TOLERANCE and worst_entropy <= TOLERANCE
    # The padded rows get no gradient: they are not in the softmax.
    model.zero_grad()
    logprobs, _ = sequence_logprobs(model, list(tokens))
    logprobs.sum().backward()
    assert torch.equal(model.output_layer.weight.grad[VOCAB:], torch.zeros(64 - VOCAB, cfg.hidden_size))
    assert model.output_layer.weight.grad[:VOCAB].abs().sum() > 0
    # Greedy decoding never picks a padded id and agrees with HF's greedy continuation.
    prompts = [tokens[0, :5].tolist(), tokens[1, :9].tolist()]
    ours = greedy_generate(model, prompts, max_new_tokens=6, eos_token_id=-1)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        for _ in range(6):
            with torch.no_grad():
                ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
        assert got == ids[0, len(prompt) :].tolist()
    # Weight sync's stream and export (which writes that stream) carry the real vocabulary only.
    with torch.no_grad():
        model.embedding.word_embeddings.weight[VOCAB:] = 0.0  # export refuses NaN in any row
    original = load_hf_state_dict(path)
    streamed = dict(iter_hf_tensors(model, cfg, sender=True))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert streamed[name].shape == (VOCAB, cfg.hidden_size) and torch.equal(
            streamed[name], original[name]
        )
    out = export_hf_checkpoint(model, tmp_path / "export", cfg)
    written = load_hf_state_dict(out)
    assert written["model.embed_tokens.weight"].shape == (VOCAB, cfg.hidden_size)
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vocab_not_divisible_by_tp2_matches_tp1_and_exports_exactly(tmp_path):
    path = save_hf(tmp_path / "ckpt", seed=4)
    result, out = tmp_path / "result.json", tmp_path / "export"
    cmd = [
        *torchrun(2, WORKER),
        f"--hf={path}",
        f"--out={out}",
        f"--result={result}",
    ]
    proc = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tp2 = json.loads(result.read_text())
    assert tp2["megatron_vocab"] == VOCAB + 1  # padded to a multiple of TP
    # TP=1 in this process, the same checkpoint and tokens.
    init_distributed(ParallelConfig(), seed=4)
    cfg = read_hf_config(path)
    model = build_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, path)
    tokens = random_tokens(VOCAB, 3, 40, seed=6)
    with torch.no_grad():
        tp1, tp1_entropy = sequence_logprobs(model, list(tokens), with_entropy=True)
    expected, expected_entropy, _ = hf_reference(path, tokens)
    logprobs, entropy = torch.tensor(tp2["logprobs"]), torch.tensor(tp2["entropy"])
    vs_tp1 = (logprobs - tp1).abs().max().item()
    vs_hf = (logprobs.double() - expected)[:, 1:].abs().max().item()
    entropy_vs_tp1 = (entropy - tp1_entropy).abs().max().item()
    print(f"TP2 vocab 49 (padded 50): |TP2 - TP1| max={vs_tp1:.2e}, |TP2 - HF| max={vs_hf:.2e}")
    assert vs_tp1 <= TOLERANCE and vs_hf <= TOLERANCE and entropy_vs_tp1 <= TOLERANCE
    assert (entropy.double()[:, 1:] - expected_entropy).abs().max().item() <= TOLERANCE
    original, written = load_hf_state_dict(path), load_hf_state_dict(out)
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
