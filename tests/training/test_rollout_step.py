"""`RolloutEngine.sample_groups` with a bad response in the batch: dropped with its group and
counted (`rollout.on_invalid=drop`), or refused naming the request (`raise`, the default).

The client is a stand-in at the HTTP boundary returning /generate responses in SGLang's
documented format (the format `tests/rollout/test_validation.py` checks against SGLang's own).
"""

import numpy as np
import pytest

from megatron_gspo.config import RolloutConfig
from megatron_gspo.rollout import RolloutValidationError
from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.training.rollout_step import RolloutEngine

TOKENIZER = build_char_tokenizer()
VOCAB = 80


class GenerateResponses:
    """Answers each request with "7" + EOS; the request whose rid is `bad_rid` gets a token id
    outside the vocabulary."""

    def __init__(self, bad_rid):
        self.bad_rid = bad_rid
        self.rids = []

    def generate_batched(self, bodies):
        self.rids += [body["rid"] for body in bodies]
        return [self._response(body) for body in bodies]

    def _response(self, body):
        ids = TOKENIZER.encode("7") + [TOKENIZER.eos_token_id]
        if body["rid"] == self.bad_rid:
            ids[0] = VOCAB + 3
        meta = {
            "id": body["rid"],
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": TOKENIZER.eos_token_id},
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "output_token_logprobs_length": len(ids),
            "weight_version": "0",
            "e2e_latency": 0.01,
        }
        return {"text": "7", "output_ids": ids, "meta_info": meta}


def sample(on_invalid, bad_rid="step1-p1-r0"):
    client = GenerateResponses(bad_rid)
    cfg = RolloutConfig(group_size=2, rollout_batch_size=3, max_new_tokens=4, on_invalid=on_invalid)
    engine = RolloutEngine(client, AdditionTask(max_digits=1), TOKENIZER, cfg, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    problems = [AdditionTask(max_digits=1).draw_problem(rng) for _ in range(3)]
    return engine, client, problems


def test_on_invalid_drop_drops_the_group_and_counts_it():
    engine, client, problems = sample("drop")
    batch = engine.sample_groups(problems, seed=1, step=1, weight_version=0)
    assert len(client.rids) == 6
    assert batch.stats["unparseable_samples"] == 1
    assert batch.stats["dropped_groups"] == 1 and batch.stats["groups_kept"] == 2
    kept = [engine.prompt_ids(problems[p]) for p in (0, 2)]  # group 1 lost its bad response
    assert [batch.samples[i].prompt_ids.tolist() for i in (0, 2)] == kept
    assert len(batch.rewards) == 4


def test_on_invalid_raise_names_the_request():
    engine, _, problems = sample("raise")
    with pytest.raises(RolloutValidationError, match="step1-p1-r0"):
        engine.sample_groups(problems, seed=1, step=1, weight_version=0)
    engine, _, problems = sample("drop", bad_rid=None)  # the control: nothing bad, nothing dropped
    batch = engine.sample_groups(problems, seed=1, step=1, weight_version=0)
    assert batch.stats["unparseable_samples"] == 0 and batch.stats["dropped_groups"] == 0
