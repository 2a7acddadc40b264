"""Cold-start SFT with `sft.target_accuracy` on the real tiny Megatron MoE (world of one).

The task is 1-2 digit sorting, which the tiny policy learns within tens of steps (held-out
accuracy ~0.5 after 20 steps), so both the early stop and the cap are reached in seconds.
"""

import logging

import pytest
import torch

from megatron_gspo.config import SFTConfig
from megatron_gspo.model.builder import build_model
from megatron_gspo.model.config import tiny
from megatron_gspo.model.distributed import ParallelConfig, destroy_distributed, init_distributed
from megatron_gspo.model.generate import greedy_generate
from megatron_gspo.model.optim import wrap_ddp
from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.tokenizer import build_char_tokenizer, encode_prompt
from megatron_gspo.training.sft import heldout_accuracy, run_sft
from megatron_gspo.training.step.micro_batches import DataLayout

TASK = get_task("sort_digits", min_length=1, max_length=2)
HELDOUT = TASK.heldout(10)
TOKENIZER = build_char_tokenizer()
NEW_TOKENS = TASK.max_answer_len + 1


@pytest.fixture
def model():
    init_distributed(ParallelConfig(), seed=1)
    yield wrap_ddp(build_model(tiny(vocab_size=80), ParallelConfig()))
    destroy_distributed()


def sft(model, **options):
    cfg = SFTConfig(**{"lr": 3e-3, "batch_size": 32, **options})
    return run_sft(model, TASK, TOKENIZER, cfg, DataLayout(), heldout=HELDOUT, max_new_tokens=NEW_TOKENS)


def accuracy(model):
    return heldout_accuracy(model, TASK, TOKENIZER, HELDOUT, DataLayout(), max_new_tokens=NEW_TOKENS)


def test_stops_at_the_first_check_that_reaches_the_target(model, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_gspo.training.sft"):
        out = sft(model, steps=300, target_accuracy=0.5, check_every=10)
    checks = [r.getMessage() for r in caplog.records if "held-out accuracy" in r.getMessage()]
    assert out["sft/hit_cap"] == 0.0
    assert out["sft/steps"] < 300 and out["sft/steps"] % 10 == 0
    assert len(checks) == out["sft/steps"] // 10  # one check per 10 steps, none after the stop
    assert out["sft/accuracy"] >= 0.5
    assert accuracy(model) == out["sft/accuracy"]  # the model was not trained past the check


def test_cap_stops_below_the_target_and_says_so(model, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_gspo.training.sft"):
        out = sft(model, steps=15, target_accuracy=1.0, check_every=10)
    checks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SFT step")]
    steps = [m.split(":")[0] for m in checks if "held-out accuracy" in m]
    assert steps == ["SFT step 10", "SFT step 15"]  # the interval, then the last step
    assert out["sft/steps"] == 15.0 and out["sft/hit_cap"] == 1.0
    assert out["sft/accuracy"] < 1.0 and out["sft/accuracy"] == accuracy(model)
    assert any("hit its cap sft.steps=15" in r.getMessage() for r in caplog.records)


def test_without_a_target_every_step_runs_and_nothing_is_measured(model):
    out = sft(model, steps=3)
    assert out["sft/steps"] == 3.0
    assert not {"sft/accuracy", "sft/hit_cap"} & set(out)


def test_greedy_generate_matches_a_step_by_step_argmax(model):
    """Packed greedy decoding equals decoding each prompt alone with full-sequence forwards."""
    sft(model, steps=20)  # a policy whose answers differ by prompt
    prompts = [encode_prompt(TOKENIZER, p.prompt, add_bos=True) for p in HELDOUT]
    eos = TOKENIZER.eos_token_id
    packed = greedy_generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    for prompt, generated in zip(prompts, packed):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                n = len(ids)
                mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
                logits = model(torch.tensor([ids]), torch.arange(n)[None], mask)
                ids.append(int(logits[0, -1].argmax()))
                if ids[-1] == eos:
                    break
        assert generated == ids[len(prompt) :]


def test_window_stops_on_the_mean_of_the_last_checks(model, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_gspo.training.sft"):
        out = sft(model, steps=300, target_accuracy=0.5, check_every=10, target_window=3)
    checks = [float(r.getMessage().split("accuracy ")[1].split(",")[0]) for r in caplog.records
              if r.getMessage().startswith("SFT step") and "held-out" in r.getMessage()]  # fmt: skip
    assert out["sft/hit_cap"] == 0.0 and len(checks) >= 3
    means = [sum(checks[i - 3 : i]) / 3 for i in range(3, len(checks) + 1)]
    assert means[-1] >= 0.5 and all(m < 0.5 for m in means[:-1])  # the first window that reaches it
    assert out["sft/accuracy_window"] == pytest.approx(means[-1], abs=1e-3)
    assert out["sft/accuracy"] == checks[-1]
