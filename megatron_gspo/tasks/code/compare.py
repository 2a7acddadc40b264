"""Whether a program's output is the expected one, as programming-contest data sets define it.

Standard output (`outputs_match`): the texts are compared line by line, each line as its
whitespace-separated tokens, ignoring blank lines at the start and end: trailing spaces, a
missing final newline and CRLF line ends do not matter; a token's spelling does ("1.0" is not
"1"). With a float tolerance, two tokens that are both non-integer numbers ("0.5", "1e-9",
"2.0") match within it (absolute or relative to the expected value, whichever is looser:
`math.isclose`); integers are always compared exactly, so "1000001" never passes for "1000000".
`mode="exact"` compares the texts byte for byte instead.

The comparison streams: both texts are walked line by line and token by token in step, and it
stops at the first difference, so its time and memory are bounded by the expected output (plus
one token), whatever the program printed. A line with fewer or more tokens than the expected one
is a mismatch (no truncation to the shorter).

Function results (`values_match`): the returned value against the expected JSON value, after a
JSON round trip (tuples are lists, dict keys strings); APPS wraps an expected value in a
one-element list, so `[returned] == expected` also matches. Floats, also inside lists and dicts,
use the tolerance when one is given; integers (and bools) compare exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

COMPARE_MODES = ("tokens", "exact")
# the line ends str.splitlines knows, so the streaming walk splits lines as it would
_LINE_END = re.compile(r"\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_TOKEN = re.compile(r"\S+")
_NON_SPACE = re.compile(r"\S")
_INTEGER = re.compile(r"[+-]?\d+")


def _number(token: str) -> float | None:
    """The token as a non-integer number (None for an integer, a word, inf or nan)."""
    if _INTEGER.fullmatch(token) or len(token) > 64:  # integers compare exactly; no float parse of floods
        return None
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def tokens_match(got: str, expected: str, float_tolerance: float | None) -> bool:
    """Two tokens are equal, or both non-integer numbers within `float_tolerance` (when given)."""
    if got == expected:
        return True
    if float_tolerance is None:
        return False
    a, b = _number(got), _number(expected)
    return (
        a is not None
        and b is not None
        and math.isclose(a, b, rel_tol=float_tolerance, abs_tol=float_tolerance)
    )


def _lines(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each line of `text`, lazily, from its first non-blank character on."""
    first = _NON_SPACE.search(text)
    if first is None:
        return
    start = first.start()  # what comes before it on its line is whitespace, which tokens ignore
    for sep in _LINE_END.finditer(text, start):
        yield start, sep.start()
        start = sep.end()
    yield start, len(text)


def _line_matches(got: str, g: tuple[int, int], expected: str, e: tuple[int, int], tol) -> bool:
    got_tokens, expected_tokens = _TOKEN.finditer(got, *g), _TOKEN.finditer(expected, *e)
    for want in expected_tokens:
        have = next(got_tokens, None)
        if have is None or not tokens_match(have.group(), want.group(), tol):
            return False
    return next(got_tokens, None) is None  # as many tokens as expected, not a longer line


def outputs_match(
    got: str, expected: str, *, mode: str = "tokens", float_tolerance: float | None = None
) -> bool:
    """Whether standard output `got` is `expected` (see the module docstring).

    Args:
        got: the program's output.
        expected: the test's expected output.
        mode: "tokens" (line by line, whitespace-insensitive) or "exact".
        float_tolerance: absolute-or-relative tolerance for non-integer numeric tokens (None:
            spelling must match).
    """
    if mode == "exact":
        return got == expected
    if mode != "tokens":
        raise ValueError(f"compare mode must be one of {COMPARE_MODES}, got {mode!r}")
    got_lines = _lines(got)
    last_got_end = None
    for e in _lines(expected):
        if _NON_SPACE.search(expected, e[0]) is None:
            break  # only blank lines are left of the expected output
        g = next(got_lines, None)
        if g is None or not _line_matches(got, g, expected, e, float_tolerance):
            return False
        last_got_end = g[1]
    # whatever the program printed past the expected lines must be blank
    rest = last_got_end if last_got_end is not None else 0
    return _NON_SPACE.search(got, rest) is None


def _values_equal(got: Any, expected: Any, tol: float | None) -> bool:
    if isinstance(got, bool) or isinstance(expected, bool):
        return got is expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if tol is None or isinstance(got, int) or isinstance(expected, int):
            return got == expected  # an integer on either side is compared exactly
        return math.isclose(got, expected, rel_tol=tol, abs_tol=tol)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(_values_equal(a, b, tol) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_values_equal(got[k], expected[k], tol) for k in got)
    return got == expected


def values_match(got: Any, expected: Any, *, float_tolerance: float | None = None) -> bool:
    """Whether a function's JSON-round-tripped return value `got` is `expected` (see the module docstring)."""
    if _values_equal(got, expected, float_tolerance):
        return True
    return (
        isinstance(expected, list) and len(expected) == 1 and _values_equal(got, expected[0], float_tolerance)
    )
