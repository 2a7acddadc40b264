"""Type and range checks of request fields for the embedded rollout server.

Each check raises `RequestError` (HTTP 400) with a message that starts with the field's name,
so a client sees which field is wrong; JSON's `true` never passes for an integer, nor `1`
for a boolean, and NaN / infinity never pass for a number. Integers are SGLang's int64.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

INT64_MAX = 2**63 - 1


class RequestError(ValueError):
    """A request the embedded server refuses (HTTP 400)."""


def show(value: Any) -> str:
    """`value` as JSON, cut short (for error messages)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def check_bool(value: Any, name: str, default: bool) -> bool:
    """A JSON boolean (null: `default`)."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {show(value)}")
    return value


def check_int(value: Any, name: str, low: int = 0, high: int = INT64_MAX) -> int:
    """A JSON integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {show(value)}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_float(value: Any, name: str, low: float, high: float, *, low_open: bool = False) -> float:
    """A finite JSON number in [low, high] ((low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {show(value)}")
    if not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}")
    if not (low < value if low_open else low <= value) or value > high:
        raise RequestError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def check_str(value: Any, name: str) -> str:
    """A JSON string."""
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {show(value)}")
    return value


def check_object(body: Any, name: str = "request body") -> dict:
    """A JSON object."""
    if not isinstance(body, dict):
        raise RequestError(f"{name} must be a JSON object, got {show(body)}")
    return body


def per_row(value: Any, n: int, name: str, *, batch: bool, check: Callable[[Any, str], Any]) -> list[Any]:
    """A per-row field: one value for all rows, or (batch requests) a list of exactly `n` values.

    `check(value, name)` checks one value; list entries are named `name[i]`.
    """
    if isinstance(value, list):
        if not batch:
            raise RequestError(f"{name} is a list but the request has a single input")
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n} inputs")
        return [check(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return [check(value, name)] * n
