"""A weight sync inside `InFlightUpdates.around_sync` lands while the producer's batch is generating.

The producer's batch is a long generation on a real embedded server; the sync (a disk update
to another checkpoint) must neither wait for it (the gate does not drain it) nor lose it:
under `pause` the request is held and finishes under the new version, under `partial` it is
cut and resumed as a second segment.

The sync begins once the server reports TOKENS_IN output tokens decoded (/get_server_info's
num_generated_tokens), not after a sleep; inside it the count must stay short of LONG: the
generation is held (or cut) mid-way while the weights change.
"""

import threading

import pytest

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import SGLangClient, build_generate_request
from megatron_gspo.rollout.partial import segments_of
from megatron_gspo.rollout.server.launch import launch_embedded_server
from megatron_gspo.tasks.tokenizer import build_char_tokenizer
from megatron_gspo.training.ahead.inflight_updates import InFlightUpdates
from megatron_gspo.training.ahead.queue import RolloutProducer

pytestmark = pytest.mark.slow  # a weight sync landing mid-batch on a live server: ~40 s

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
LONG = 480  # the context is 512: the sync lands mid-generation on a fast box too
TOKENS_IN = 16  # output tokens decoded before the sync begins


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_hf_checkpoint(root / "a", CFG, seed=0), make_tiny_hf_checkpoint(root / "b", CFG, seed=1)


@pytest.mark.parametrize("mode", ["pause", "partial"])
def test_sync_lands_mid_batch_and_the_batch_survives(checkpoints, mode):
    a, b = checkpoints
    body = build_generate_request(
        TOKENIZER.encode("12+34="),
        {"max_new_tokens": LONG, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
        rid="row0",
    )
    with (
        launch_embedded_server(a, extra_args=["--weight-version", "0"]) as server,
        SGLangClient([server.url]) as client,
    ):
        inflight = InFlightUpdates(mode, client, "retract")
        generate = inflight.partial.generate if inflight.partial else client.generate_batched
        started = threading.Event()

        def produce(version):
            started.set()
            return generate([body])[0]

        producer = RolloutProducer(produce, 1, lambda: 0, lambda batch: 1, wait_in_flight=False)
        before = server.generated_tokens()
        with producer:
            assert started.wait(60)
            server.wait_for_tokens(before + TOKENS_IN)
            with inflight.around_sync(producer):
                client.update_weights_from_disk(str(b), weight_version=1)
                during = server.generated_tokens() - before  # held (pause) or cut (partial) here
            response = producer.take(1).item.batch
    # Started at version 0 and finished by version 1: the sync landed while it was generating.
    assert TOKENS_IN <= during < LONG  # the weights changed while the generation was part-way
    assert len(response["output_ids"]) == LONG
    assert response["meta_info"]["weight_version"] == "1"
    if mode == "partial":
        segments = segments_of(response)
        assert [s.weight_version for s in segments] == ["0", "1"]
        assert segments[0].length >= TOKENS_IN
