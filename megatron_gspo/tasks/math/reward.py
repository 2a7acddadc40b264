r"""Math-answer reward: the final answer of a completion against a reference answer.

Pipeline: `extract_answer` (the last \boxed{...}, balanced braces, else a GSM8K-style
"#### N" line) -> `answers_match`: a fast exact path first (`normalize_answer` removes LaTeX
spellings that do not change the value, units in words included; equal strings or equal
numbers as exact fractions: "0.50" == ".5" == "1/2" == "\frac{1}{2}", "18 dollars" == "18"),
and for everything else HF `math-verify` (LaTeX -> sympy: expressions, sets, intervals, tuples,
matrices, equations). References go through `reference_answer` once, at start-up: the boxed
answer of a MATH solution, the "#### N" of a GSM8K one, or a bare answer.

math-verify bounds its own time with SIGALRM, which works only on the main thread; elsewhere
it runs without that timeout, and `_bounded_cost` keeps out what could run for minutes
(power towers, huge factorials, very long answers) on every thread.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction

from megatron_gspo.optional import require


class ParseStatus(StrEnum):
    """What extraction found, for rollout metrics (e.g. the share of completions with no box)."""

    OK = "ok"
    NO_ANSWER = "no_answer"  # neither a \boxed / \fbox nor a "#### N" line in the completion
    UNBALANCED = "unbalanced"  # the last \boxed{ is never closed (often a truncated completion)
    EMPTY = "empty"  # a box with nothing in it after normalisation


@dataclass(frozen=True)
class MathRewardResult:
    """Reward of one completion.

    Attributes:
        reward: 1.0 when the final answer matches the reference, else 0.0.
        status: what extraction found.
        extracted: normalised final answer, or None when there is none.
    """

    reward: float
    status: ParseStatus
    extracted: str | None


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_last_boxed(text: str) -> tuple[str | None, ParseStatus]:
    r"""Content of the last \boxed{...} (or \fbox{...}, or "\boxed 5") in `text`.

    Braces are matched by depth, skipping escaped ones (\{ \}), so nested groups such as
    \boxed{\frac{1}{2}} and sets \boxed{\{1,2\}} come out whole.

    Returns:
        (content, ParseStatus.OK) or (None, NO_ANSWER / UNBALANCED).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None, ParseStatus.NO_ANSWER
    i = start + 1
    while i < len(text) and text[i].isalpha():  # past the command name
        i += 1
    after_name = text[i:].lstrip()
    if not after_name.startswith("{"):  # "\boxed 5": up to the next space or dollar
        match = re.match(r"\s+([^\s$]+)", text[i:])
        return (match.group(1), ParseStatus.OK) if match else (None, ParseStatus.UNBALANCED)
    i = len(text) - len(after_name)
    depth, content_start = 0, i + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, braces included, never changes the depth
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i], ParseStatus.OK
        i += 1
    return None, ParseStatus.UNBALANCED


_UNIT_COMMANDS = r"\\(?:text|textbf|mbox|mathrm|textrm)"
_SPACING = re.compile(r"\\[!,;: ]|\\(?:left|right|displaystyle)(?![a-zA-Z])|\\q?quad(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_TRAILING_UNIT = re.compile(rf"^(.*?\S)\s*{_UNIT_COMMANDS}\{{[^{{}}]*\}}(?:\^\{{?\d\}}?)?$")
_UNWRAP_TEXT = re.compile(rf"{_UNIT_COMMANDS}\{{([^{{}}]*)\}}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?=([^=]+)$")
_SHORT_FRAC = re.compile(r"\\frac(\d)(\d)")  # \frac12 -> \frac{1}{2} (whitespace already gone)
_SHORT_FRAC_NUMERATOR = re.compile(r"\\frac(\d)\{")  # \frac1{x} -> \frac{1}{x}
_SHORT_SQRT = re.compile(r"\\sqrt(\d)")  # \sqrt2 -> \sqrt{2}
_UNIT_WORDS = re.compile(r"^([-+]?[\d.,]+)\s*[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*\.?$")  # "18 dollars" -> "18"
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


def normalize_answer(answer: str) -> str:
    r"""Canonical spelling of an answer; spellings that differ only cosmetically map to one string.

    Maps Unicode minus signs to "-". Removes: spacing commands (\! \, \; \quad), \left / \right,
    \displaystyle, dollars, degrees (^\circ, ^{\circ}, °), percent signs, a trailing unit in
    \text{...}/\mbox{...}/\mathrm{...} or in words after a number ("18 dollars"; other \text{X} is
    unwrapped to X), all whitespace, a trailing ".", an assignment prefix ("x=5" -> "5"),
    thousands separators ("1,000" -> "1000", "1{,}000").
    Rewrites \dfrac / \tfrac to \frac, and \frac12 / \sqrt2 to \frac{1}{2} / \sqrt{2}.
    """
    s = answer.strip().translate(_MINUS_SIGNS)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    while (match := _TRAILING_UNIT.match(s.strip())) is not None:
        s = match.group(1)
    s = _UNWRAP_TEXT.sub(r"\1", s)
    if (match := _UNIT_WORDS.match(s.strip())) is not None:
        s = match.group(1)
    s = re.sub(r"\s+", "", s).replace("{,}", ",").rstrip(".")
    if (match := _ASSIGNMENT.match(s)) is not None:
        s = match.group(1)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", s)
    s = _SHORT_FRAC_NUMERATOR.sub(r"\\frac{\1}{", s)
    return _SHORT_SQRT.sub(r"\\sqrt{\1}", s)


_DECIMAL = r"[+-]?(?:\d+\.?\d*|\.\d+)"
_NUMBER_FORMS = (
    re.compile(rf"^(?P<num>{_DECIMAL})$"),
    re.compile(rf"^(?P<num>{_DECIMAL})/(?P<den>{_DECIMAL})$"),
    re.compile(rf"^(?P<sign>[+-]?)\\frac\{{(?P<num>{_DECIMAL})\}}\{{(?P<den>{_DECIMAL})\}}$"),
)


def parse_number(answer: str) -> Fraction | None:
    r"""Exact value of a normalised plain number, "a/b" or "\frac{a}{b}" (decimals allowed), else None."""
    for form in _NUMBER_FORMS:
        if (match := form.match(answer)) is not None:
            groups = match.groupdict()
            value = Fraction(groups["num"])
            if groups.get("den") is not None:
                den = Fraction(groups["den"])
                if den == 0:
                    return None
                value /= den
            return -value if groups.get("sign") == "-" else value
    return None


_HASH_ANSWER = re.compile(r"^\s*####\s*(\S.*?)\s*$", re.MULTILINE)  # GSM8K: "#### 72" on its own line
_MAX_BARE_REFERENCE = 200  # a longer reference without a final-answer marker is a solution, not an answer


def extract_answer(text: str) -> tuple[str | None, ParseStatus]:
    r"""The final answer of a completion: its last \boxed{...}, else its last "#### N" line.

    Returns:
        (content, ParseStatus.OK) or (None, NO_ANSWER / UNBALANCED).
    """
    content, status = extract_last_boxed(text)
    if status != ParseStatus.NO_ANSWER:
        return content, status
    hashes = _HASH_ANSWER.findall(text)
    return (hashes[-1], ParseStatus.OK) if hashes else (None, ParseStatus.NO_ANSWER)


def reference_answer(reference: str) -> str:
    r"""The answer a reference states: a solution's last \boxed{...}, its "#### N" line, or the bare text.

    Raises:
        ValueError: a reference with no final answer (an unclosed box, an empty one, or a long
            or multi-line text without \boxed{} or "#### N"), a data error rather than a model's.
    """
    content, status = extract_answer(reference)
    if status == ParseStatus.UNBALANCED:
        raise ValueError(f"reference {_clip(reference)!r}: its last \\boxed{{ is never closed")
    if content is None:
        bare = reference.strip()
        if "\n" in bare or len(bare) > _MAX_BARE_REFERENCE:
            raise ValueError(
                f"reference {_clip(reference)!r} has no final answer: no \\boxed{{...}} and no '#### N' line"
            )
        content = bare
    if not normalize_answer(content):
        raise ValueError(f"reference {_clip(reference)!r} has an empty final answer")
    return content


def check_reference(reference: str) -> str:
    """`reference_answer`, and that it parses as a number or as math (math-verify); returns the answer.

    Raises:
        ValueError: no final answer, or one that neither parses as a number nor as LaTeX math.
    """
    answer = reference_answer(reference)
    if parse_number(normalize_answer(answer)) is not None:
        return answer
    parsed = _parse_reference(answer)
    if not parsed or isinstance(parsed[0], str):
        raise ValueError(f"reference answer {_clip(answer)!r} does not parse as math (math-verify)")
    return answer


def _clip(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Cost guard: sympy evaluates powers and factorials exactly, so 9^{99^{99}} or 1000000! would run
# for minutes (math-verify's alarm stops them only on the main thread). Bounded: at most two
# powers, exponents without nesting and of at most 3 digits, factorials of at most 3 digits.
_MAX_ANSWER_CHARS = 300
_EXPONENT = re.compile(r"\^\s*(\{[^{}]*\}|\\?\w+)")
_BIG_FACTORIAL = re.compile(r"\d{4,}\s*!|!\s*!|\)\s*!")
_LONG_DIGITS = re.compile(r"\d{4,}")


def _bounded_cost(answer: str) -> bool:
    """Whether sympy can evaluate `answer` quickly (see the cost guard above)."""
    if len(answer) > _MAX_ANSWER_CHARS or answer.count("^") > 2 or _BIG_FACTORIAL.search(answer):
        return False
    for exponent in _EXPONENT.findall(answer):
        if "^" in exponent or "!" in exponent or _LONG_DIGITS.search(exponent):
            return False
    return answer.count("^") == len(_EXPONENT.findall(answer))  # a caret without a readable exponent


def _timeout_s() -> int | None:
    """math-verify's SIGALRM timeout on the main thread; None elsewhere, where signals cannot be set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str) -> list:
    parse = require("math_verify", "Math rewards (math-verify)").parse
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout_s())


@functools.lru_cache(maxsize=1 << 16)
def _parse_reference(answer: str) -> tuple:
    """A reference parsed once (~5-20 ms of LaTeX parsing), not once per scored completion."""
    return tuple(_parse(answer))


def math_verify_equal(prediction: str, reference: str) -> bool:
    """math-verify's judgement of two bare answers (False for answers outside the cost guard)."""
    verify = require("math_verify", "Math rewards (math-verify)").verify
    if not (_bounded_cost(prediction) and _bounded_cost(reference)):
        return False
    gold, target = list(_parse_reference(reference)), _parse(prediction)
    return bool(gold and target and verify(gold, target, timeout_seconds=_timeout_s()))


def exact_match(pred: str, ref: str) -> bool | None:
    """The fast path on normalised answers: True / False when it can decide, None to ask math-verify.

    Equal strings match; two plain numbers are equal or not as exact fractions (a percent sign
    is left to math-verify, which knows 10% = 0.1).
    """
    if pred == ref:
        return True
    pred_number, ref_number = parse_number(pred), parse_number(ref)
    if pred_number is not None and ref_number is not None:
        return pred_number == ref_number
    return None


def answers_match(prediction: str, reference: str) -> bool:
    """Whether two bare answers (not yet normalised) denote the same value: fast path, then math-verify."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred or not ref:
        return False
    fast = exact_match(pred, ref)
    if fast is not None and (fast or "%" not in prediction + reference):
        return fast
    if math_verify_equal(prediction, reference):
        return True
    return (pred, ref) != (prediction, reference) and math_verify_equal(pred, ref)


def math_reward(completion: str, reference: str) -> MathRewardResult:
    r"""Reward 1.0 if the final answer of `completion` matches `reference`, else 0.0.

    Args:
        completion: decoded model output; its answer is the last \boxed{...}, else a "#### N" line.
        reference: the reference: a bare answer, a solution ending in \boxed{...} or "#### N".

    Raises:
        ValueError: a reference without a final answer (see `reference_answer`).
    """
    ref = reference_answer(reference)
    content, status = extract_answer(completion)
    if content is None:
        return MathRewardResult(0.0, status, None)
    extracted = normalize_answer(content)
    if not extracted:
        return MathRewardResult(0.0, ParseStatus.EMPTY, extracted)
    return MathRewardResult(1.0 if answers_match(content, ref) else 0.0, ParseStatus.OK, extracted)
