r"""Math-answer reward: the last \boxed{...} of a completion against a reference answer.

Pipeline: `extract_last_boxed` (balanced braces) -> `normalize_answer` (LaTeX spelling
variants that do not change the value) -> `answers_match`: equal strings, else equal
numbers as exact fractions ("0.50" == ".5" == "1/2" == "\frac{1}{2}"), else, for constant
expressions built from numbers, + - * /, powers, \sqrt and \pi, equal values under sympy
(sympy ships with torch; without it that last step is skipped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction


class ParseStatus(StrEnum):
    """What extraction found, for rollout metrics (e.g. the share of completions with no box)."""

    OK = "ok"
    NO_BOXED = "no_boxed"  # no \boxed / \fbox in the completion
    UNBALANCED = "unbalanced"  # the last \boxed{ is never closed (often a truncated completion)
    EMPTY = "empty"  # a box with nothing in it after normalisation


@dataclass(frozen=True)
class MathRewardResult:
    """Reward of one completion.

    Attributes:
        reward: 1.0 when the boxed answer matches the reference, else 0.0.
        status: what extraction found.
        extracted: normalised boxed answer, or None when there is none.
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
        (content, ParseStatus.OK) or (None, NO_BOXED / UNBALANCED).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None, ParseStatus.NO_BOXED
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


def _take_group(text: str, open_index: int) -> int:
    """Index just past the brace group opening at `open_index`, or -1 if it never closes."""
    depth = 0
    for i in range(open_index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return -1


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


def normalize_answer(answer: str) -> str:
    r"""Canonical spelling of an answer; spellings that differ only cosmetically map to one string.

    Removes: spacing commands (\! \, \; \quad), \left / \right, \displaystyle, dollars,
    degrees (^\circ, ^{\circ}, °), percent signs, a trailing unit in \text{...}/\mbox{...}/
    \mathrm{...} (other \text{X} is unwrapped to X), all whitespace, a trailing ".", an
    assignment prefix ("x=5" -> "5"), thousands separators ("1,000" -> "1000", "1{,}000").
    Rewrites \dfrac / \tfrac to \frac, and \frac12 / \sqrt2 to \frac{1}{2} / \sqrt{2}.
    """
    s = answer.strip()
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    while (match := _TRAILING_UNIT.match(s.strip())) is not None:
        s = match.group(1)
    s = _UNWRAP_TEXT.sub(r"\1", s)
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


def _latex_to_sympy_text(s: str) -> str | None:
    r"""Python-syntax text of a constant LaTeX expression (\frac, \sqrt, \pi, ^, \cdot), else None."""
    out, i = [], 0
    while i < len(s):
        for command, template in (("\\frac", "(({})/({}))"), ("\\sqrt", "sqrt({})")):
            if s.startswith(command + "{", i):
                args, j = [], i + len(command)
                for _ in range(template.count("{}")):
                    end = _take_group(s, j) if j < len(s) and s[j] == "{" else -1
                    if end < 0:
                        return None
                    inner = _latex_to_sympy_text(s[j + 1 : end - 1])
                    if inner is None:
                        return None
                    args.append(inner)
                    j = end
                out.append(template.format(*args))
                i = j
                break
        else:
            if s.startswith("\\pi", i):
                out.append("pi")
                i += 3
            elif s.startswith(("\\cdot", "\\times"), i):
                out.append("*")
                i += 5 if s.startswith("\\cdot", i) else 6
            elif s[i] in "0123456789.+-*/()^{}":
                out.append({"^": "**", "{": "(", "}": ")"}.get(s[i], s[i]))
                i += 1
            else:
                return None  # variables, sets, text: not a constant we can evaluate safely
    return "".join(out)


# parse_expr evaluates Python text, so only numbers, operators, sqrt and pi get through; at
# most three powers with literal exponents of <= 2 digits, evaluated in floating point
# (evaluate=False, then N) so a tower like 9^{99^{99}} cannot stall the reward.
_SAFE_EXPRESSION = re.compile(r"^(?:[0-9.+\-*/()]|sqrt|pi)+$")
_SAFE_POWER = re.compile(r"\*\*(?>\(?\d{1,2}\)?)(?!\d|\*\*)")  # atomic: no backtracking to fewer digits
_MAX_POWERS = 3


def _sympy_equal(prediction: str, reference: str) -> bool:
    try:
        from sympy import N
        from sympy.parsing.sympy_parser import (
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return False
    values = []
    for latex in (prediction, reference):
        text = _latex_to_sympy_text(latex)
        if text is None or len(text) > 200 or not _SAFE_EXPRESSION.match(text):
            return False
        powers = text.count("**")
        if powers > _MAX_POWERS or powers != len(_SAFE_POWER.findall(text)):
            return False
        try:
            transformations = (*standard_transformations, implicit_multiplication_application)
            expr = parse_expr(text, transformations=transformations, evaluate=False)
            values.append(complex(N(expr, 30)))
        except Exception:  # malformed model output (e.g. "1/0", unbalanced parentheses): no match
            return False
    return abs(values[0] - values[1]) <= 1e-12 * max(1.0, abs(values[1]))


def answers_match(prediction: str, reference: str) -> bool:
    """Whether two raw answers (not yet normalised) denote the same value."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred or not ref:
        return False
    if pred == ref:
        return True
    pred_number, ref_number = parse_number(pred), parse_number(ref)
    if pred_number is not None and ref_number is not None:
        return pred_number == ref_number
    return _sympy_equal(pred, ref)


def math_reward(completion: str, reference: str) -> MathRewardResult:
    r"""Reward 1.0 if the last \boxed{...} of `completion` matches `reference`, else 0.0.

    Args:
        completion: decoded model output.
        reference: the reference answer, bare or itself in \boxed{...}.

    Raises:
        ValueError: if the reference normalises to nothing (a data error, not a model error).
    """
    ref_boxed, _ = extract_last_boxed(reference)
    ref = ref_boxed if ref_boxed is not None else reference
    if not normalize_answer(ref):
        raise ValueError(f"reference answer {reference!r} is empty after normalisation")
    content, status = extract_last_boxed(completion)
    if content is None:
        return MathRewardResult(0.0, status, None)
    extracted = normalize_answer(content)
    if not extracted:
        return MathRewardResult(0.0, ParseStatus.EMPTY, extracted)
    return MathRewardResult(1.0 if answers_match(content, ref) else 0.0, ParseStatus.OK, extracted)
