"""The generation engine in-process: original-logprob mode, the sampling filters, the test aids."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout.server.decode_aids import DecodeAids
from megatron_gspo.rollout.server.engine import (
    GenerationEngine,
    GenerationInput,
    SamplingOptions,
    filter_probs,
)
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CFG = tiny(vocab_size=len(TOKENIZER), init_std=0.2)
PROMPT = TOKENIZER.encode("3+4=")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine") / "m", CFG, seed=0)


@pytest.mark.parametrize("original", [False, True])
def test_logprob_mode_matches_its_definition(ckpt, original):
    engine = GenerationEngine(ckpt, return_original_logprob=original)
    temp = 0.6
    (out,) = engine.generate(
        [
            GenerationInput(
                PROMPT, SamplingOptions(max_new_tokens=8, temperature=temp, sampling_seed=1, ignore_eos=True)
            )
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.output_ids])).logits[0]
    p = len(PROMPT)
    scale = 1.0 if original else temp
    ref = torch.log_softmax(logits / scale, -1)[p - 1 : -1].gather(1, torch.tensor(out.output_ids)[:, None])[
        :, 0
    ]
    assert (torch.tensor(out.output_logprobs) - ref).abs().max() < 1e-5
    other = torch.log_softmax(logits / (temp if original else 1.0), -1)[p - 1 : -1]
    other = other.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert (torch.tensor(out.output_logprobs) - other).abs().max() > 1e-2  # the two modes really differ


def test_filter_probs_matches_hand_computed_sets():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    assert filter_probs(probs, top_k=2).nonzero().flatten().tolist() == [1, 3]
    # top_p=0.7: sorted 0.4, 0.3 reach 0.7 -> keep exactly those two (mass before each <= 0.7).
    assert filter_probs(probs, top_p=0.7).nonzero().flatten().tolist() == [1, 3]
    assert filter_probs(probs, top_p=0.71).nonzero().flatten().tolist() == [1, 3, 4]
    # min_p=0.3: keep p >= 0.12.
    assert filter_probs(probs, min_p=0.3).nonzero().flatten().tolist() == [1, 3, 4]
    assert filter_probs(probs, top_p=0.01).nonzero().flatten().tolist() == [
        1
    ]  # the top token always survives
    kept = filter_probs(probs, top_k=3)
    assert torch.equal(kept[[1, 3, 4]], probs[[1, 3, 4]])


def test_filter_probs_per_row_options_equal_each_row_alone():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 11, generator=gen)
    top_k = [-1, 3, 20, 1, -1, 5]
    top_p = [1.0, 1.0, 0.5, 1.0, 0.9, 0.3]
    min_p = [0.0, 0.2, 0.0, 0.0, 0.5, 0.0]
    batched = filter_probs(
        probs, top_k=torch.tensor(top_k), top_p=torch.tensor(top_p), min_p=torch.tensor(min_p)
    )
    for b in range(6):
        alone = filter_probs(probs[b], top_k=top_k[b], top_p=top_p[b], min_p=min_p[b])
        assert torch.equal(batched[b], alone), b
    assert (batched == 0).sum() > 20  # the options really filter


def test_seeded_rows_sample_the_same_alone_and_in_a_mixed_batch(ckpt):
    engine = GenerationEngine(ckpt)
    options = [
        SamplingOptions(max_new_tokens=4, temperature=0.7, sampling_seed=5, ignore_eos=True),
        SamplingOptions(max_new_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingOptions(
            max_new_tokens=4, temperature=1.3, top_k=4, top_p=0.8, sampling_seed=9, ignore_eos=True
        ),
    ]
    together = engine.generate([GenerationInput(PROMPT, sp) for sp in options])
    for sp, out in zip(options, together):
        alone = engine.generate([GenerationInput(PROMPT, sp)])[0]
        assert alone.output_ids == out.output_ids
        assert alone.output_logprobs == pytest.approx(out.output_logprobs, abs=1e-5)


def test_rows_with_one_prompt_share_its_prefill_and_get_what_they_get_alone(ckpt):
    engine = GenerationEngine(ckpt)
    other = TOKENIZER.encode("12+9=")
    prompts = [PROMPT, other, PROMPT, PROMPT, other, TOKENIZER.encode("5+5=")]
    rows = [
        GenerationInput(
            prompt,
            SamplingOptions(max_new_tokens=3, temperature=0.8, sampling_seed=100 + i, ignore_eos=True),
            logprob_start_len=0,
            return_routed_experts=True,
        )
        for i, prompt in enumerate(prompts)
    ]
    prefills = []
    forward = engine._forward

    def recording(ids, mask, cache):
        if ids.shape[1] > 1:
            prefills.append(tuple(ids.shape))
        return forward(ids, mask, cache)

    engine._forward = recording
    together = engine.generate(rows)
    assert prefills == [(3, len(other))]  # three distinct prompts, left-padded to the longest
    for row, out in zip(rows, together):
        (alone,) = engine.generate([row])
        assert out.output_ids == alone.output_ids
        assert out.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        assert out.input_logprobs[0] is None and alone.input_logprobs[0] is None
        assert out.input_logprobs[1:] == pytest.approx(alone.input_logprobs[1:], abs=1e-5)
        assert (out.routed_experts == alone.routed_experts).all()


def test_sampling_follows_the_filtered_distribution(ckpt):
    engine = GenerationEngine(ckpt)
    rows = [
        GenerationInput(PROMPT, SamplingOptions(max_new_tokens=1, top_k=3, sampling_seed=s, ignore_eos=True))
        for s in range(300)
    ]
    firsts = [o.output_ids[0] for o in engine.generate(rows)]
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
    top3 = probs.topk(3)
    assert set(firsts) <= set(top3.indices.tolist())
    expected = top3.values / top3.values.sum()
    freq = torch.tensor([firsts.count(t) / len(firsts) for t in top3.indices.tolist()])
    assert (freq - expected).abs().max() < 0.1  # 300 draws: std of a frequency <= 0.03


def test_bad_inputs_are_refused_with_the_reason(ckpt):
    engine = GenerationEngine(ckpt)
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.generate([GenerationInput([])])
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate([GenerationInput(PROMPT, logprob_start_len=len(PROMPT))])


def test_bf16_engine_logprobs_are_those_of_bf16_logits(ckpt):
    """`--dtype bfloat16`: the model runs in bf16 and its logits go to fp32 for the log-softmax (as
    SGLang's); against the fp32 engine the prompt log-probs differ by bf16 rounding (measured on
    this sharp tiny model, init std 0.2: max 0.063, mean 0.017 nats), non-zero but far below a
    wrong model's (O(1))."""
    ids = TOKENIZER.encode("12+34=46") * 4
    request = [GenerationInput(ids, SamplingOptions(max_new_tokens=1, temperature=0.0), logprob_start_len=0)]
    engines = {dtype: GenerationEngine(ckpt, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert {p.dtype for p in engines[torch.bfloat16].model.parameters()} == {torch.bfloat16}
    lps = {d: torch.tensor(e.generate(request)[0].input_logprobs[1:]) for d, e in engines.items()}
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # bf16 values, fp32 softmax
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (lps[torch.bfloat16] - ref).abs().max() < 1e-5
    diff = (lps[torch.bfloat16] - lps[torch.float32]).abs()
    assert 1e-3 < diff.mean() < 0.05 and diff.max() < 0.5, (diff.max(), diff.mean())


def test_tokens_generated_counts_every_decoded_output_token(ckpt):
    """The counter behind /get_server_info's num_generated_tokens: one per output token, all rows."""
    engine = GenerationEngine(ckpt)
    assert engine.tokens_generated == 0
    options = [
        SamplingOptions(max_new_tokens=n, temperature=1.0, sampling_seed=n, ignore_eos=True) for n in (3, 5)
    ]
    outs = engine.generate([GenerationInput(PROMPT, o) for o in options])
    assert [len(o.output_ids) for o in outs] == [3, 5]
    assert engine.tokens_generated == 8
    engine.generate([GenerationInput(PROMPT, SamplingOptions(max_new_tokens=2, ignore_eos=True))])
    assert engine.tokens_generated == 10


def test_the_hold_aid_holds_later_rows_after_one_token_until_a_pause_or_an_abort(ckpt):
    """`DecodeAids(hold_after_responses=1)`: once a response has ended under the weights served, a
    batch decodes one token and waits: an abort ends it with that token, a pause lets it through, and a sync
    (pause, then weights) therefore always lands mid-response, whatever the box's speed."""
    engine = GenerationEngine(ckpt, aids=DecodeAids(hold_after_responses=1))
    options = SamplingOptions(max_new_tokens=32, ignore_eos=True)
    (first,) = engine.generate([GenerationInput(PROMPT, options)])
    assert len(first.output_ids) == 32  # no response had ended: not held

    def started(item: GenerationInput, pool: ThreadPoolExecutor):
        before = engine.tokens_generated
        future = pool.submit(engine.generate, [item])
        deadline = time.monotonic() + 60  # hang guard
        while engine.tokens_generated == before and time.monotonic() < deadline:
            time.sleep(0.01)
        return future

    with ThreadPoolExecutor(1) as pool:
        aborted = GenerationInput(PROMPT, options)
        future = started(aborted, pool)
        aborted.abort.set()
        (out,) = future.result(timeout=60)
        assert len(out.output_ids) == 1 and out.finish_reason["type"] == "abort"

        future = started(GenerationInput(PROMPT, options), pool)
        engine.pause(retract=False)  # returns: the held batch gave way
        try:
            assert not future.done() and engine.tokens_generated == 33 + 1
        finally:
            engine.resume()
        (out,) = future.result(timeout=60)
        assert len(out.output_ids) == 32 and out.finish_reason["type"] == "length"
