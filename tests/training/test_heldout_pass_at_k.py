"""Held-out evaluation: greedy `eval/accuracy` beside sampled `eval/pass@k`, through the rollout engine.

The client is the stand-in at the HTTP boundary: it answers greedy requests and chosen sampled
rows with the right sum, so pass@k is known by hand (`tests/tasks/test_pass_at_k.py` checks the
estimator itself).
"""

import pytest
from rollout_standin import TOKENIZER, VOCAB, generate_response

from megatron_gspo.config import EvalConfig, RolloutConfig
from megatron_gspo.tasks import Problem
from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.training.heldout import heldout_metrics, pass_ks
from megatron_gspo.training.step.rollouts import RolloutEngine

PROBLEMS = [Problem("3+4=", "7"), Problem("1+1=", "2")]
RIGHT_SAMPLES = {"eval-p0-s0", "eval-p0-s2"}  # problem 0: 2 of 4 sampled answers right; problem 1: none


class Answers:
    def __init__(self):
        self.bodies = []

    def generate_batched(self, bodies):
        self.bodies += bodies
        out = []
        for body in bodies:
            greedy = body["sampling_params"]["temperature"] == 0.0
            p = 0 if body["rid"] in ("eval-0", *RIGHT_SAMPLES) else 1 if body["rid"] == "eval-1" else None
            text = PROBLEMS[p].answer if p is not None and (greedy or body["rid"] in RIGHT_SAMPLES) else "9"
            ids = TOKENIZER.encode(text) + [TOKENIZER.eos_token_id]
            out.append(generate_response(body, ids, "0", {"type": "stop", "matched": TOKENIZER.eos_token_id}))
        return out


def test_greedy_accuracy_and_sampled_pass_at_k():
    client = Answers()
    engine = RolloutEngine(client, AdditionTask(max_digits=1), TOKENIZER, RolloutConfig(max_new_tokens=4),
                           vocab_size=VOCAB)  # fmt: skip
    cfg = EvalConfig(samples_per_problem=4, temperature=0.7, pass_k=[1, 2, 4])
    metrics = heldout_metrics(engine, AdditionTask(max_digits=1), PROBLEMS, cfg, seed=5)
    # greedy: both right; sampled: c = 2 and 0 of n = 4
    # pass@1 = (2/4 + 0) / 2; pass@2 = (1 - C(2,2)/C(4,2) + 0) / 2 = (5/6) / 2; pass@4 = (1 + 0) / 2
    assert metrics == pytest.approx({"eval/accuracy": 1.0, "eval/mean_reward": 1.0, "eval/pass@1": 0.25,
                                     "eval/pass@2": 5 / 12, "eval/pass@4": 0.5})  # fmt: skip
    sampled = [b for b in client.bodies if b["sampling_params"]["temperature"] != 0.0]
    assert len(sampled) == 8 and {b["sampling_params"]["temperature"] for b in sampled} == {0.7}
    seeds = [b["sampling_params"]["sampling_seed"] for b in sampled]
    assert len(set(seeds)) == 8  # one seed per row
    client.bodies.clear()
    heldout_metrics(engine, AdditionTask(max_digits=1), PROBLEMS, cfg, seed=5)
    again = [
        b["sampling_params"]["sampling_seed"] for b in client.bodies if b["sampling_params"]["temperature"]
    ]
    assert again == seeds  # every evaluation of a run draws with the same seeds


def test_greedy_only_by_default_and_the_default_ks():
    client = Answers()
    engine = RolloutEngine(client, AdditionTask(max_digits=1), TOKENIZER, RolloutConfig(max_new_tokens=4),
                           vocab_size=VOCAB)  # fmt: skip
    assert set(heldout_metrics(engine, AdditionTask(max_digits=1), PROBLEMS, EvalConfig(), seed=5)) == {
        "eval/accuracy", "eval/mean_reward"
    }  # fmt: skip
    assert len(client.bodies) == 2
    assert pass_ks(EvalConfig(samples_per_problem=8)) == [1, 8]
    assert pass_ks(EvalConfig(samples_per_problem=1)) == [1]
