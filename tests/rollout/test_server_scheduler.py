"""The embedded server's batcher: which rows run together, and when a batch starts."""

import threading

from megatron_gspo.rollout.server.engine import GenerationOutput
from megatron_gspo.rollout.server.scheduler import BatchScheduler


class RecordingEngine:
    """Returns one output per row and records the batches it was given."""

    weight_version = "0"

    def __init__(self):
        self.batches = []

    def generate(self, items):
        self.batches.append(list(items))
        return [
            GenerationOutput(
                output_ids=[item],
                output_logprobs=[0.0],
                input_logprobs=None,
                routed_experts=None,
                finish_reason={"type": "length", "length": 1},
                weight_version=self.weight_version,
            )
            for item in items
        ]


def test_a_batch_request_starts_without_waiting_out_the_window():
    engine = RecordingEngine()
    scheduler = BatchScheduler(engine, batch_window_s=600.0)  # waiting it out would time out below
    try:
        futures = scheduler.submit_many(["r-0", "r-1", "r-2"], [10, 11, 12])
        outputs = [f.result(timeout=60.0) for f in futures]
        assert [o.output_ids for o in outputs] == [[10], [11], [12]]
        assert engine.batches == [[10, 11, 12]]
    finally:
        scheduler.close()


def test_single_row_requests_are_gathered_within_the_window():
    engine = RecordingEngine()
    scheduler = BatchScheduler(engine, batch_window_s=0.5)
    try:
        futures = []
        threads = [
            threading.Thread(target=lambda i=i: futures.append(scheduler.submit(f"r{i}", i)))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(f.result(timeout=5.0).output_ids[0] for f in futures) == [0, 1, 2, 3]
        assert len(engine.batches) == 1 and sorted(engine.batches[0]) == [0, 1, 2, 3]
    finally:
        scheduler.close()


def test_rows_beyond_max_batch_size_run_in_the_next_batch_at_once():
    engine = RecordingEngine()
    scheduler = BatchScheduler(engine, batch_window_s=5.0, max_batch_size=2)
    try:
        futures = scheduler.submit_many([f"r-{i}" for i in range(5)], list(range(5)))
        assert [f.result(timeout=2.0).output_ids[0] for f in futures] == [0, 1, 2, 3, 4]
        assert engine.batches == [[0, 1], [2, 3], [4]]
    finally:
        scheduler.close()
