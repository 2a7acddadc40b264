"""Rows of a data set as users have it: a JSON-lines file, a Parquet file or a `save_to_disk` directory.

JSON lines are read here, line by line, so an error names the file's own line number; Parquet
files and directories written by `datasets.Dataset.save_to_disk` go through the `datasets`
library (a `DatasetDict` directory must name its split, e.g. `data/gsm8k/train`). Rows are
numbered from 1 ("line" for JSON lines, "row" otherwise) in the order the file holds them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gspo.optional import require


def read_rows(path: str, option: str) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """(what a row is called, [(row number, row)]) of the data set at `path`.

    Args:
        path: a .jsonl/.json file, a .parquet file or a `save_to_disk` directory.
        option: the config key that gave `path` (named in errors), e.g. "task.options.path".

    Raises:
        ValueError: a missing path, an unknown format, a line that is not a JSON object.
    """
    source = Path(path)
    if source.is_dir():
        return "row", _from_disk(source, option)
    if not source.is_file():
        raise ValueError(f"{option}={path}: no such file or directory")
    if source.suffix == ".parquet":
        datasets = require("datasets", f"{option}={path} (Parquet)")
        return "row", list(enumerate(datasets.Dataset.from_parquet(str(source)), start=1))
    if source.suffix not in (".jsonl", ".json"):
        raise ValueError(
            f"{option}={path}: unknown data format {source.suffix!r}; "
            "give a .jsonl or .parquet file or a datasets save_to_disk directory"
        )
    return "line", _json_lines(source)


def _json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number} is not JSON: {err.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number} is a JSON {type(row).__name__}, not an object")
            rows.append((number, row))
    return rows


def _from_disk(path: Path, option: str) -> list[tuple[int, dict[str, Any]]]:
    require("datasets", f"{option}={path} (a save_to_disk directory)")
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(f"{option}={path} is not a datasets save_to_disk directory: {err}") from None
    if isinstance(data, DatasetDict):
        splits = ", ".join(f"{path}/{name}" for name in data)
        raise ValueError(f"{option}={path} holds several splits; name one: {splits}")
    assert isinstance(data, Dataset)
    return list(enumerate(data, start=1))


def field(row: Mapping[str, Any], key: str) -> Any:
    """`row[key]`, where a dotted key reaches into nested objects ("reward_model.ground_truth").

    A part of the path that is a JSON object held as a string (LiveCodeBench's `metadata`
    column, `'{"func_name": "f"}'`) is parsed on the way through.

    Raises:
        KeyError: the key (or one of its parts) is absent.
    """
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if isinstance(value, str | bytes) and value.lstrip()[:1] in ("{", b"{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise KeyError(key) from None
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def chat_messages(value: Any) -> list[dict[str, str]] | None:
    """`value` as chat messages if it is a list of {"role", "content"} (verl/DAPO style), else None."""
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(isinstance(m, Mapping) and isinstance(m.get("content"), str) and "role" in m for m in value):
        return None
    return [{"role": str(m["role"]), "content": m["content"]} for m in value]
