"""Whether a program's output is the expected one, as programming-contest data sets define it.

Standard output (`outputs_match`): the texts are compared line by line, each line as its
whitespace-separated tokens, ignoring blank lines at the start and end: trailing spaces, a
missing final newline and CRLF line ends do not matter; a token's spelling does ("1.0" is not
"1") unless a float tolerance is given, when two tokens that both parse as numbers match within
it (absolute or relative to the expected value, whichever is looser: `math.isclose`).
`mode="exact"` compares the texts byte for byte instead.

Function results (`values_match`): the returned value against the expected JSON value, after a
JSON round trip (tuples are lists, dict keys strings); APPS wraps an expected value in a
one-element list, so `[returned] == expected` also matches. Floats, also inside lists and dicts,
use the tolerance when one is given.
"""

from __future__ import annotations

import math
from typing import Any

COMPARE_MODES = ("tokens", "exact")


def _lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def tokens_match(got: str, expected: str, float_tolerance: float | None) -> bool:
    """Two tokens are equal, or both numbers within `float_tolerance` (when given)."""
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


def outputs_match(
    got: str, expected: str, *, mode: str = "tokens", float_tolerance: float | None = None
) -> bool:
    """Whether standard output `got` is `expected` (see the module docstring).

    Args:
        got: the program's output.
        expected: the test's expected output.
        mode: "tokens" (line by line, whitespace-insensitive) or "exact".
        float_tolerance: absolute-or-relative tolerance for numeric tokens (None: spelling must match).
    """
    if mode == "exact":
        return got == expected
    if mode != "tokens":
        raise ValueError(f"compare mode must be one of {COMPARE_MODES}, got {mode!r}")
    got_lines, expected_lines = _lines(got), _lines(expected)
    if len(got_lines) != len(expected_lines):
        return False
    for a, b in zip(got_lines, expected_lines):
        if len(a) != len(b) or not all(tokens_match(x, y, float_tolerance) for x, y in zip(a, b)):
            return False
    return True


def _values_equal(got: Any, expected: Any, tol: float | None) -> bool:
    if isinstance(got, bool) or isinstance(expected, bool):
        return got is expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if tol is None or (isinstance(got, int) and isinstance(expected, int)):
            return got == expected
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
