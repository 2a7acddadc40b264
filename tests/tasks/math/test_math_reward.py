from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from megatron_gspo.tasks.math.reward import (
    ParseStatus,
    answers_match,
    check_reference,
    extract_answer,
    extract_last_boxed,
    math_reward,
    normalize_answer,
    parse_number,
    reference_answer,
)

# (completion, reference, reward): each row is a spelling question a grader must get right.
REWARD_TABLE = [
    # positives
    (r"so the answer is $\boxed{42}$.", "42", 1.0),
    (r"\boxed{ 42 }", "42", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{0.50}", "1/2", 1.0),
    (r"\boxed{.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
    (r"\boxed{\tfrac{6}{8}}", "0.75", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{90^{\circ}}", "90", 1.0),
    (r"\boxed{\$18.90}", "18.9", 1.0),
    (r"\boxed{12 \text{ cm}}", "12", 1.0),
    (r"\boxed{5\text{ inches}^2}", "5", 1.0),
    (r"\boxed{\text{Evelyn}}", "Evelyn", 1.0),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
    (r"\boxed{x = 7}", "7", 1.0),
    (r"\boxed{7.}", "7", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{10\!000}", "10000", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"first \boxed{3}, then corrected: \boxed{4}", "4", 1.0),
    (r"\fbox{17}", "17", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),
    (r"\boxed{12}", r"\boxed{12}", 1.0),
    # negatives
    (r"\boxed{43}", "42", 0.0),
    (r"first \boxed{4}, then corrected: \boxed{3}", "4", 0.0),
    (r"\boxed{0.51}", "1/2", 0.0),
    (r"\boxed{1,2}", "12", 0.0),
    (r"\boxed{1,000}", "1", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{-2}", "2", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", 0.0),
    (r"\boxed{(1,2)}", "(2,1)", 0.0),
    (r"\boxed{x+1}", "x+2", 0.0),
    (r"\boxed{1/0}", "1", 0.0),
    ("The answer is 42.", "42", 0.0),
    (r"\boxed{42", "42", 0.0),
    (r"\boxed{}", "42", 0.0),
]


@pytest.mark.parametrize("completion, reference, reward", REWARD_TABLE)
def test_math_reward_table(completion, reference, reward):
    assert math_reward(completion, reference).reward == reward


@pytest.mark.parametrize("completion, reference", [(c, ref) for c, ref, r in REWARD_TABLE if r == 1.0])
def test_a_rewarded_completion_scores_zero_against_another_reference(completion, reference):
    """The negative control of each rewarded row: the same completion, a reference it does not state."""
    assert math_reward(completion, "12345").reward == 0.0


@pytest.mark.parametrize(
    "completion, status, extracted",
    [
        (r"\boxed{\frac{1}{2}}", ParseStatus.OK, r"\frac{1}{2}"),
        ("no box here", ParseStatus.NO_ANSWER, None),
        (r"\boxed{\frac{1}{2}", ParseStatus.UNBALANCED, None),
        (r"truncated \boxed", ParseStatus.UNBALANCED, None),
        (r"\boxed{ }", ParseStatus.EMPTY, ""),
        (r"\boxed{$\,$}", ParseStatus.EMPTY, ""),
    ],
)
def test_parse_status(completion, status, extracted):
    result = math_reward(completion, "1")
    assert (result.status, result.extracted) == (status, extracted)
    assert result.reward == 0.0 or status == ParseStatus.OK


@pytest.mark.parametrize(
    "text, content",
    [
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
        (r"\boxed{\}}", r"\}"),
        (r"\boxed {5}", "5"),
        (r"$\boxed 5$.", "5"),
        (r"\boxed{1} and \fbox{2}", "2"),
        (r"\fbox{1} and \boxed{2} text } after", "2"),
    ],
)
def test_extract_last_boxed(text, content):
    assert extract_last_boxed(text) == (content, ParseStatus.OK)


@pytest.mark.parametrize(
    "raw, normal",
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\left\{1\right\}", r"\{1\}"),
        (r"a \rightarrow b", r"a\rightarrowb"),  # \right inside \rightarrow is not touched
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{x}", r"\frac{1}{x}"),
        (r"\text{(B)}", "(B)"),
        ("1,234,567.5", "1234567.5"),
        ("1,23", "1,23"),
        (r"k_{2} = 9", "9"),
        (r"\displaystyle 3", "3"),
        ("45°", "45"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    "text, value",
    [
        ("7", Fraction(7)),
        ("-0.25", Fraction(-1, 4)),
        (".5", Fraction(1, 2)),
        ("3/6", Fraction(1, 2)),
        (r"\frac{2}{0.5}", Fraction(4)),
        (r"-\frac{1}{3}", Fraction(-1, 3)),
        ("1/0", None),
        ("1e3", None),
        ("1_000", None),
        ("x", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_answers_match_is_symmetric_on_the_table():
    for completion, reference, reward in REWARD_TABLE:
        content, status = extract_last_boxed(completion)
        reference = extract_last_boxed(reference)[0] or reference
        if status == ParseStatus.OK and normalize_answer(content):
            assert answers_match(reference, content) == answers_match(content, reference) == (reward == 1.0)


# Answers sympy would evaluate for minutes (exact powers, factorials) or that are too long to try.
COSTLY = [r"9^{99^{99}}", r"((9^{99})^{99})^{99}", "1" * 500, r"10^{10^{10}}", "1000000!", "99!!"]


@pytest.fixture
def math_verify_calls(monkeypatch):
    """math-verify's parse and verify as the reward calls them, each call's arguments recorded.

    A call that carries one of the COSTLY answers fails at once (AssertionError) instead of
    running sympy on it: what would take minutes is seen as a call, not as a time.
    """
    import math_verify

    calls = []

    def spy(name, real):
        def call(*args, **kwargs):
            calls.append((name, args))
            if any(costly in str(args) for costly in COSTLY):
                raise AssertionError(f"math-verify {name} got {str(args)[:80]}: past the cost guard")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(math_verify, "parse", spy("parse", math_verify.parse))
    monkeypatch.setattr(math_verify, "verify", spy("verify", math_verify.verify))
    return calls


@pytest.mark.parametrize("costly", COSTLY)
def test_costly_answers_are_rejected_before_math_verify(costly, math_verify_calls):
    """The cost guard (or the fast path) decides: no call reaches sympy, so none can run for minutes."""
    assert math_reward(rf"\boxed{{{costly}}}", "1").reward == 0.0
    assert math_verify_calls == []


def test_code_in_an_answer_is_parsed_never_run(tmp_path, math_verify_calls):
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path('{marker}').touch()"
    assert math_reward(rf"\boxed{{{code}}}", "1").reward == 0.0
    assert [name for name, _ in math_verify_calls][:1] == ["parse"]  # math-verify did read it
    assert not marker.exists()


def test_empty_reference_is_a_data_error():
    with pytest.raises(ValueError, match="has an empty final answer"):
        math_reward(r"\boxed{1}", "$ $")


@pytest.mark.parametrize(
    "reference, answer",
    [
        ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72"),
        ("#### 1,000", "1,000"),
        (r"So $x = 2$ and the area is $\boxed{\frac{\pi}{4}}$.", r"\frac{\pi}{4}"),
        ("  -3  ", "-3"),
        (r"\{1,2\}", r"\{1,2\}"),
    ],
)
def test_reference_answer_of_gsm8k_math_and_bare_references(reference, answer):
    assert reference_answer(reference) == answer
    assert check_reference(reference) == answer


@pytest.mark.parametrize(
    "reference, message",
    [
        ("We add them.\nSo the total is seventy-two.", "no final answer"),
        ("x" * 300, "no final answer"),
        (r"the area is \boxed{\frac{1}{2}", "never closed"),
        (r"\boxed{ }", "empty final answer"),
        ("####  $ $", "empty final answer"),
    ],
)
def test_references_without_a_final_answer_are_refused(reference, message):
    with pytest.raises(ValueError, match=message):
        reference_answer(reference)


def test_check_reference_refuses_what_math_verify_cannot_parse():
    with pytest.raises(ValueError, match="does not parse as math"):
        check_reference(r"\frac{1}{")


def test_gsm8k_completion_line_is_an_answer():
    assert math_reward("48 + 24 = 72\n#### 72", "#### 72").reward == 1.0
    assert math_reward("#### 71", "#### 72").reward == 0.0
    assert extract_answer("no answer here") == (None, ParseStatus.NO_ANSWER)


def test_math_verify_runs_on_worker_threads(math_verify_calls):
    """math-verify's SIGALRM timeout only works on the main thread; off it the reward still works
    (no "signal only works in main thread" error) and the cost guard still keeps towers from sympy."""
    cases = [
        (r"\boxed{x+1}", "1+x", 1.0),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
        (r"\boxed{x+1}", "x+2", 0.0),
    ]
    cases += [
        (rf"\boxed{{{h}}}", "1", 0.0) for h in (r"9^{99^{99}}", r"((9^{99})^{99})^{99}", "1000000!", "99!!")
    ]
    with ThreadPoolExecutor(2) as pool:
        rewards = list(pool.map(lambda case: math_reward(case[0], case[1]).reward, cases))
    assert rewards == [reward for *_, reward in cases]
    assert {name for name, _ in math_verify_calls} == {"parse", "verify"}  # the first three asked it
