"""A programming problem's test cases as data sets spell them, and the program in a completion.

`parse_tests` reads the common spellings into one `TestSuite`:

- APPS / verl / PRIME: `{"inputs": [...], "outputs": [...], "fn_name": ...}`, often as a JSON
  string column; without `fn_name` the inputs are standard input texts, with it argument lists;
- CodeContests: `{"input": [...], "output": [...]}` (stdin/stdout);
- LiveCodeBench: a list (or JSON string) of `{"input", "output", "testtype"}`, where a
  "functional" test's input is one JSON argument per line and its output one JSON value; its
  `private_test_cases` column is that JSON string pickled, zlib-compressed and base64-encoded,
  which `decode_packed_tests` opens without running anything (a restricted unpickler that builds
  only strings, numbers, lists and dicts: a data set is untrusted input too).

`extract_program` takes the program out of a completion: the last fenced code block
(```python ... ``` or bare ```), or, with `extract="whole"`, the whole completion.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EXTRACT_MODES = ("last_block", "whole")
_BASE64 = re.compile(rb"[A-Za-z0-9+/=\s]+")
MAX_PACKED_BYTES = 256 << 20  # a packed test field decompresses to at most this (no zip bomb)
_PLAIN = (str, bytes, int, float, bool, type(None), list, tuple, dict)
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class TestSuite:
    """A problem's tests.

    Attributes:
        inputs: standard-input texts, or (with `fn_name`) argument lists.
        outputs: expected standard outputs, or expected return values (JSON values).
        fn_name: the function (or `Solution` method) the tests call; None for stdin/stdout tests.
        float_tolerance: this problem's own tolerance for non-integer numbers (None: exact),
            used instead of the task's when `own_tolerance` is set.
        own_tolerance: whether `float_tolerance` is the row's own (else the task's applies).
    """

    inputs: tuple
    outputs: tuple
    fn_name: str | None = None
    float_tolerance: float | None = None
    own_tolerance: bool = False

    def __len__(self) -> int:
        return len(self.inputs)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles only what needs no class lookup: strings, numbers, lists, tuples and dicts."""

    def find_class(self, module, name):
        raise ValueError(f"the packed test field names {module}.{name}; only plain values are unpickled")

    def persistent_load(self, pid):
        raise ValueError(
            "the packed test field holds a persistent reference; only plain values are unpickled"
        )


def _check_plain(value: Any) -> None:
    """Every node is a plain type; shared nodes are visited once (a pickle's memo can share them)."""
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, _PLAIN):
            raise ValueError(
                f"the packed test field holds a {type(node).__name__}; only plain values are unpickled"
            )
        if isinstance(node, list | tuple | dict) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.items() if isinstance(node, dict) else node)


def decode_packed_tests(text: str | bytes) -> Any:
    """LiveCodeBench's `private_test_cases`: base64 of zlib of a pickle of (usually) a JSON string.

    Nothing in it is executed: the unpickler refuses every class lookup (`find_class`), so only
    strings, numbers, lists, tuples and dicts can come out, and the decompressed size is capped.

    Raises:
        ValueError: not base64, not zlib, larger than `MAX_PACKED_BYTES`, or a pickle that is
            not plain values.
    """
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    try:
        packed = base64.b64decode(raw, validate=False)
        inflater = zlib.decompressobj()
        data = inflater.decompress(packed, MAX_PACKED_BYTES)
        if inflater.unconsumed_tail:
            raise ValueError(f"the packed test field decompresses to over {MAX_PACKED_BYTES >> 20} MiB")
        value = _PlainUnpickler(io.BytesIO(data)).load()
    except (binascii.Error, zlib.error) as err:
        raise ValueError(f"not base64 + zlib ({err})") from None
    except (pickle.UnpicklingError, EOFError, IndexError, KeyError, TypeError) as err:
        raise ValueError(f"not a pickle of plain values ({type(err).__name__}: {err})") from None
    _check_plain(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"it unpickles to a string that is not JSON ({err.msg})") from None


def _json(value: Any, what: str) -> Any:
    if isinstance(value, str | bytes):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            stripped = value.strip()
            if (
                len(stripped) < 16
                or _BASE64.fullmatch(stripped.encode() if isinstance(stripped, str) else stripped) is None
            ):
                raise ValueError(f"{what} is a string but not JSON: {err.msg}") from None
            try:  # LiveCodeBench's private tests
                return decode_packed_tests(stripped)
            except (ValueError, UnicodeDecodeError) as packed_err:
                raise ValueError(
                    f"{what} is a string but not JSON ({err.msg}) nor LiveCodeBench's packed tests "
                    f"(base64 + zlib + pickle): {packed_err}"
                ) from None
    return value


def _functional_args(text: Any) -> list:
    if not isinstance(text, str):
        return list(text) if isinstance(text, list | tuple) else [text]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def parse_tests(value: Any, fn_name: str | None = None, max_tests: int | None = None) -> TestSuite:
    """A `TestSuite` from a data set's test field (see the module docstring).

    Args:
        value: the field: a dict, a list of test dicts, or either as a JSON string.
        fn_name: the function name when the field does not carry one (LiveCodeBench's metadata).
        max_tests: keep at most this many tests (the first ones); None keeps all.

    Raises:
        ValueError: a field of none of these shapes, lists of different lengths, no tests, a
            stdin input that is not text.
    """
    value = _json(value, "the test field")
    if isinstance(value, Mapping):
        keys = ("inputs", "outputs") if "inputs" in value else ("input", "output")
        if not all(k in value for k in keys):
            raise ValueError(
                f"the test field has keys {sorted(value)}; expected inputs/outputs (APPS) or input/output "
                "(CodeContests)"
            )
        inputs, outputs = list(value[keys[0]]), list(value[keys[1]])
        fn_name = value.get("fn_name") or fn_name
    elif isinstance(value, Sequence) and all(isinstance(t, Mapping) for t in value):
        if any("input" not in t or "output" not in t for t in value):
            raise ValueError("every test in the list needs 'input' and 'output' (LiveCodeBench style)")
        functional = {t.get("testtype", "stdin") == "functional" for t in value}
        if len(functional) > 1:
            raise ValueError("the tests mix 'functional' and 'stdin' test types")
        if functional == {True}:
            if not fn_name:
                raise ValueError("functional tests need a function name (task.options.fn_name_key)")
            inputs = [_functional_args(t["input"]) for t in value]
            outputs = [_json(t["output"], "a functional test's output") for t in value]
        else:  # stdin tests: a function name from the row (LiveCodeBench's metadata) does not apply
            inputs, outputs, fn_name = [t["input"] for t in value], [t["output"] for t in value], None
    else:
        raise ValueError(f"the test field is a {type(value).__name__}; expected a dict or a list of tests")
    if len(inputs) != len(outputs):
        raise ValueError(f"the tests have {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("the problem has no tests")
    if fn_name is None:
        inputs = [_stdin_text(x) for x in inputs]
        outputs = [_stdin_text(x) for x in outputs]
    elif not all(isinstance(args, list | tuple) for args in inputs):
        raise ValueError(f"function-call tests of {fn_name!r} need argument lists as inputs")
    if max_tests is not None:
        inputs, outputs = inputs[:max_tests], outputs[:max_tests]
    return TestSuite(tuple(inputs), tuple(outputs), fn_name)


def _stdin_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"  # some data sets store a text as its lines
    raise ValueError(f"a stdin/stdout test holds a {type(value).__name__}, not text")


def extract_program(completion: str, mode: str = "last_block") -> str | None:
    """The program in `completion`, or None when there is none.

    Args:
        completion: the decoded response.
        mode: "last_block": the last fenced block (an unclosed last fence runs to the end, as
            a truncated response leaves it); "whole": the whole completion.
    """
    if mode == "whole":
        return completion if completion.strip() else None
    if mode != "last_block":
        raise ValueError(f"extract must be one of {EXTRACT_MODES}, got {mode!r}")
    blocks = _FENCE.findall(completion)
    if not blocks:
        return None
    program = blocks[-1][1]
    return program if program.strip() else None


def fence(program: str, language: str = "python") -> str:
    """`program` in a fenced block, the form `extract_program` reads (cold-start SFT targets)."""
    return f"```{language}\n{program.rstrip()}\n```"
