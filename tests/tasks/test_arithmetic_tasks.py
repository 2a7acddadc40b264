import numpy as np
import pytest

from megatron_gspo.tasks import Problem, get_task
from megatron_gspo.tasks.base import stable_bucket

ADDITION = Problem("12+5=", "17")


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("17", 1.0),
        (" 17 ", 1.0),
        ("17\n", 1.0),
        ("017", 0.0),
        ("17.0", 0.0),
        ("+17", 0.0),
        ("18", 0.0),
        ("1 7", 0.0),
        ("17 17", 0.0),
        ("", 0.0),
        ("seventeen", 0.0),
    ],
)
def test_addition_reward_is_exact_match(completion, expected):
    assert get_task("addition").reward(ADDITION, completion) == expected


@pytest.mark.parametrize(
    "completion, expected", [("17", 1.0), ("18", 0.1), ("-3", 0.1), ("1a", 0.0), ("", 0.0)]
)
def test_addition_format_partial_credit(completion, expected):
    assert get_task("addition", format_reward=0.1).reward(ADDITION, completion) == expected


def test_addition_answers_and_lengths():
    task = get_task("addition", min_digits=1, max_digits=3)
    problems = task.sample_prompts(5000, np.random.default_rng(0))
    operand_digits = set()
    for p in problems:
        a, b = p.prompt.removesuffix("=").split("+")  # parsed from the text, independently of metadata
        assert p.answer == str(int(a) + int(b)) and (int(a), int(b)) == (p.metadata["a"], p.metadata["b"])
        assert len(p.prompt) <= task.max_prompt_len == 8 and len(p.answer) <= task.max_answer_len == 4
        assert a == str(int(a)) and b == str(int(b))  # no leading zeros
        operand_digits.update((len(a), len(b)))
    assert operand_digits == {1, 2, 3}
    assert any(p.metadata["a"] == 0 for p in problems)


def test_demo_defaults_fit_the_short_sequence_budget():
    for name in ("addition", "sort_digits"):
        task = get_task(name)
        assert task.max_prompt_len <= 12 and task.max_answer_len <= 6


@pytest.mark.parametrize("name", ["addition", "sort_digits"])
def test_heldout_never_appears_in_training_samples(name):
    task = get_task(name)
    training = task.sample_prompts(10_000, np.random.default_rng(1))
    heldout = task.heldout(300, seed=0)
    assert not {p.prompt for p in training} & {p.prompt for p in heldout}
    assert all(task.is_heldout(p) for p in heldout) and not any(task.is_heldout(p) for p in training)
    assert len({p.prompt for p in heldout}) == 300


def test_heldout_is_about_one_prompt_in_ten():
    task = get_task("addition", min_digits=2, max_digits=3)
    rng = np.random.default_rng(2)
    draws = [task.draw_problem(rng) for _ in range(20_000)]
    share = np.mean([task.is_heldout(p) for p in draws])
    assert 0.09 < share < 0.11
    assert task.is_heldout(draws[0]) == (stable_bucket(draws[0].prompt, 10) == 0)


def test_heldout_is_fixed_and_does_not_depend_on_options():
    narrow, wide = get_task("addition", max_digits=2), get_task("addition", max_digits=3)
    assert narrow.heldout(50, seed=3) == narrow.heldout(50, seed=3)
    assert narrow.heldout(50, seed=3) != narrow.heldout(50, seed=4)
    assert all(wide.is_heldout(p) for p in narrow.heldout(100))


def test_heldout_too_large_for_problem_space_raises():
    with pytest.raises(ValueError, match="only about .* distinct held-out problems"):
        get_task("addition", max_digits=1).heldout(50)


@pytest.mark.parametrize("name", ["addition", "sort_digits"])
def test_sampling_is_deterministic_given_the_generator(name):
    task = get_task(name)
    first = task.sample_prompts(64, np.random.default_rng(7))
    assert first == task.sample_prompts(64, np.random.default_rng(7))
    assert first != task.sample_prompts(64, np.random.default_rng(8))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits"),
        ({"max_digits": 10}, "max_digits"),
        ({"format_reward": 1.0}, "format_reward"),
        ({"format_reward": -0.1}, "format_reward"),
    ],
)
def test_addition_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("addition", **options)


def test_sort_digits_answers_lengths_and_reward():
    task = get_task("sort_digits", min_length=2, max_length=6)
    problems = task.sample_prompts(2000, np.random.default_rng(0))
    for p in problems:
        digits = p.prompt.removesuffix(":")
        assert p.answer == "".join(sorted(digits)) and len(p.answer) == len(digits)
        assert 2 <= len(digits) <= 6 and len(p.prompt) <= task.max_prompt_len
    assert {len(p.answer) for p in problems} == {2, 3, 4, 5, 6}
    problem = Problem("3141:", "1134")
    assert [task.reward(problem, c) for c in ("1134", " 1134 ", "1143", "134", "4311", "")] == [
        1,
        1,
        0,
        0,
        0,
        0,
    ]
    with pytest.raises(ValueError, match="min_length"):
        get_task("sort_digits", min_length=4, max_length=3)
