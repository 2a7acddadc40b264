import pytest

from megatron_gspo.tasks import PromptStream, get_task, sft_batches


def test_resumed_stream_continues_with_the_same_prompts():
    task = get_task("addition", max_digits=3)
    stream = PromptStream(task, batch_size=16, seed=5)
    before = [stream.next_batch() for _ in range(3)]
    state = stream.state_dict()
    after = [stream.next_batch() for _ in range(2)]

    resumed = PromptStream(get_task("addition", max_digits=3), batch_size=16, seed=123)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(2)] == after
    assert after[0] not in before and after[0] != after[1]  # batches move on


def test_same_seed_same_stream_other_seed_other_stream():
    task = get_task("sort_digits")
    first = [PromptStream(task, 8, seed=1).next_batch() for _ in range(2)]
    assert first[0] == first[1]
    assert PromptStream(task, 8, seed=2).next_batch() != first[0]


def test_stream_draws_training_problems_only():
    task = get_task("addition")
    stream = PromptStream(task, batch_size=256, seed=0)
    for batch in (stream.next_batch() for _ in range(8)):
        assert len(batch) == 256 and not any(task.is_heldout(p) for p in batch)


def test_state_for_another_stream_is_rejected():
    state = PromptStream(get_task("addition"), 16).state_dict()
    with pytest.raises(ValueError, match="batch_size=16"):
        PromptStream(get_task("addition"), 32).load_state_dict(state)
    with pytest.raises(ValueError, match="task='addition'"):
        PromptStream(get_task("sort_digits"), 16).load_state_dict(state)


def test_bad_batch_size_is_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream(get_task("addition"), 0)


def test_sft_batches_pair_training_prompts_with_bare_answers():
    task = get_task("addition")
    reference = PromptStream(task, 4, seed=9)
    batches = sft_batches(PromptStream(task, 4, seed=9))
    for _ in range(3):
        problems, examples = reference.next_batch(), next(batches)
        assert examples == [(p.prompt, p.answer) for p in problems]
        for prompt, target in examples:
            a, b = prompt.removesuffix("=").split("+")
            assert target == str(int(a) + int(b))
