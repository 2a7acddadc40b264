"""Rollout servers stood in for at the HTTP client's boundary, with weight syncs landing mid-batch.

Responses are /generate answers in SGLang's documented format (the format
`tests/rollout/test_validation.py` checks against SGLang's own), as `test_rollout_step.py`'s:
every request is answered "7" + EOS, each token with log-prob -0.5.

A batch request can be held in flight until a weight sync in SGLang's `abort` pause mode (what
`PartialRollouts.sync` sends, `rollout.update_mode: partial`) cuts it: each of its requests
then returns the one token generated so far, finish reason abort, under the version the
servers had. The resubmitted rows (`PartialRollouts`: rid "<rid>-seg1", prompt + that token)
get the EOS from whatever the servers hold by then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
VOCAB = 80
ANSWER = TOKENIZER.encode("7") + [TOKENIZER.eos_token_id]
"""The tokens of every response: "7" then EOS."""


def generate_response(body: dict, ids: list[int], version: str, finish: dict) -> dict:
    """One /generate answer to `body` generating `ids` under weight version `version`."""
    meta = {
        "id": body["rid"],
        "prompt_tokens": len(body["input_ids"]),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "finish_reason": finish,
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
        "output_token_logprobs_length": len(ids),
        "weight_version": version,
        "e2e_latency": 0.01,
    }
    return {"text": TOKENIZER.decode(ids, skip_special_tokens=True), "output_ids": ids, "meta_info": meta}


class StandInServers:
    """The client's calls the rollout step and the weight sync make, answered as servers would.

    Args:
        version: the weight version the servers hold (the test moves it at a sync).
        reports: rid (without "-seg1") -> the version the server answering that request
            reports instead (a server that missed a sync, or was restarted from an older
            checkpoint); for a cut request, its resumed segment's.
        hold_call: the batch request (1-based count of `generate_batched` calls) that stays in
            flight until a sync in abort mode cuts it; None: none is held.
        during_hold: called once that request is in flight (e.g. runs the sync in this thread);
            without it another thread syncs, after waiting on `in_flight`.
    """

    def __init__(
        self,
        version: str,
        *,
        reports: dict[str, str] | None = None,
        hold_call: int | None = None,
        during_hold: Callable[[], None] | None = None,
    ) -> None:
        self.version = version
        self.reports = dict(reports or {})
        self.hold_call, self.during_hold = hold_call, during_hold
        self.batch_calls = 0
        self.rids: list[str] = []
        self.control: list[tuple] = []  # pause / continue calls, in order
        self.in_flight = threading.Event()
        self._cut = threading.Event()

    def generate_batched(self, bodies):
        self.batch_calls += 1
        self.rids += [body["rid"] for body in bodies]
        if self.batch_calls != self.hold_call:
            return [self._answer(body) for body in bodies]
        version = self.version
        self.in_flight.set()
        if self.during_hold is not None:
            self.during_hold()
        assert self._cut.wait(60), "no sync cut the batch request held in flight"  # a hang guard
        abort = {"type": "abort", "message": "paused in abort mode"}
        return [generate_response(body, ANSWER[:1], version, abort) for body in bodies]

    def generate(self, bodies):  # PartialRollouts' resubmissions, one request each
        self.rids += [body["rid"] for body in bodies]
        return [self._answer(body) for body in bodies]

    def pause_generation(self, mode="retract"):
        self.control.append(("pause_generation", mode))
        if mode == "abort":
            self._cut.set()

    def cancel_generation(self):  # a stopping run: nothing here outlives its call
        pass

    def continue_generation(self):
        self.control.append(("continue_generation",))

    def _answer(self, body):
        rid = body["rid"]
        resumed = rid.endswith("-seg1")
        ids = ANSWER[1:] if resumed else ANSWER
        version = self.reports.get(rid.removesuffix("-seg1"), self.version)
        return generate_response(body, ids, version, {"type": "stop", "matched": TOKENIZER.eos_token_id})
