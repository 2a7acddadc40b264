"""The unbiased pass@k estimator against values worked out by hand, and its mean over problems."""

import math

import pytest

from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.tasks.evaluation import evaluate_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),  # nothing correct
        (5, 5, 3, 1.0),  # everything correct
        (5, 2, 1, 2 / 5),  # pass@1 is c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c = 3 < k: every draw of 4 holds a correct one
        (10, 1, 5, 0.5),  # one correct in 10: half of the 5-subsets hold it
        (4, 1, 4, 1.0),
    ],
)
def test_pass_at_k_matches_the_binomial_formula_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_a_float():
    """C(2000, 1000) is ~1e600: the ratio form overflows a float, the product does not."""
    n, c, k = 2000, 3, 1000
    assert math.comb(n, k) > 1e308
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact rational via Python's big ints
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert exact == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998), rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_evaluate_pass_at_k_averages_over_problems():
    task = AdditionTask(max_digits=1)
    first, second = task.heldout(2)
    right = [first.answer, second.answer]
    samples = [[right[0], "x", "x", "x"], [right[1], right[1], "x", "x"]]  # c = 1 and c = 2 of n = 4
    got = evaluate_pass_at_k(task, [first, second], samples, ks=[1, 2, 4])
    # pass@1: (1/4 + 2/4) / 2; pass@2: (1 - C(3,2)/C(4,2) + 1 - C(2,2)/C(4,2)) / 2 = (1/2 + 5/6) / 2
    assert got == pytest.approx({"pass@1": 3 / 8, "pass@2": (1 / 2 + 5 / 6) / 2, "pass@4": 1.0})
    with pytest.raises(ValueError, match="same number of samples"):
        evaluate_pass_at_k(task, [first, second], [["x"], ["x", "y"]], ks=[1])
