"""`megatron-gspo score`: one program scored on one code problem's tests, as training scores it.

megatron-gspo score DATA --row N --program main.py
megatron-gspo score DATA --id 4000 --completion response.txt --json
megatron-gspo score --config RUN/config.yaml --row N --completion response.txt
megatron-gspo score lcb.jsonl --row 2 --program sol.py --task-option fn_name_key=metadata.func_name

The problem is row N of DATA (`--row`: the number the task's messages use, line N of a .jsonl,
row N from 1 of Parquet or a save_to_disk directory) or the row whose `--id-key` field is
`--id`; its tests are read by the code task with the config's `task.options` (`--config`) and
`--task-option`s. A `--completion` is a whole response: its program is taken out as training
takes it (`task.options.extract`). The program runs in the task's sandbox with the task's
limits and comparison (`tasks/code/reward.py`), so the reward is the one training gives.

Prints each test's outcome and time and the first failing test's input, expected and actual
output and standard error (cut to `--max-chars`); `--json` writes the same as one JSON object.
Exit status: 0 every test passed, 1 the program failed (wrong, error, timeout, no program),
2 it could not be scored (bad arguments, config, data row or no sandbox).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gspo.analysis.tool_prompts import parse_task_options
from megatron_gspo.config import ConfigError

ID_KEYS = ("problem_id", "question_id", "task_id", "id")
"""Fields `--id` is looked up in when `--id-key` is not given, first present wins."""


def add_score_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-gspo score`."""
    parser.add_argument("data", nargs="?", help="the data file (default: the --config's task.options.path)")
    parser.add_argument(
        "--config", help="training config whose task section reads the data (a run's config.yaml)"
    )
    parser.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="code task option, repeatable (e.g. fn_name_key=metadata.func_name); values read as YAML",
    )
    row = parser.add_mutually_exclusive_group(required=True)
    row.add_argument("--row", type=int, help="row number: line N of a .jsonl, row N (from 1) of Parquet")
    row.add_argument("--id", help="the row whose --id-key field equals this")
    parser.add_argument(
        "--id-key", help=f"field --id is matched against (default: the first of {', '.join(ID_KEYS)})"
    )
    program = parser.add_mutually_exclusive_group(required=True)
    program.add_argument("--program", help="file holding the program, run as is")
    program.add_argument("--completion", help="file holding a model's response; its program is extracted")
    parser.add_argument("--json", action="store_true", help="write the result as one JSON object")
    parser.add_argument("--max-chars", type=int, default=400, help="cut each input/output/stderr to this")


def run_score(args: argparse.Namespace) -> int:
    """Entry point: score the program and print the result; 0 pass, 1 fail (2 comes from a ConfigError)."""
    from megatron_gspo.tasks.code.explain import result_record
    from megatron_gspo.tasks.code.reward import score_program

    if args.max_chars < 1:
        raise ConfigError(f"score: --max-chars must be >= 1, got {args.max_chars}")
    text = _read_text(args.program or args.completion, "--program" if args.program else "--completion")
    task, path = _code_task(args)
    unit, number, problem = _pick_row(task, path, args)
    program = text if args.program else task.program(text)
    tests = problem.metadata["tests"]
    result = score_program(program, tests, task.options)
    record = {
        "data": path,
        "unit": unit,
        "row": number,
        "kind": "function" if tests.fn_name else "stdin",
        "fn_name": tests.fn_name,
        "reward_mode": task.options.reward,
        **result_record(result, tests, args.max_chars),
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(render(record))
    return 0 if record["outcome"] == "pass" else 1


def _read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"score {option} {path}: {getattr(err, 'strerror', None) or err}") from None


def _code_task(args: argparse.Namespace):
    """(the code task built as training builds it, its data path); one bad row elsewhere is skipped."""
    from megatron_gspo.tasks import get_task

    options: dict = {}
    if args.config:
        from megatron_gspo.config import load_config

        cfg = load_config(args.config)
        if cfg.task.name != "code":
            raise ConfigError(f"score is for the code task; {args.config} has task.name={cfg.task.name!r}")
        options = dict(cfg.task.options)
    options.update(parse_task_options(args.task_option))
    if args.data:
        options["path"] = args.data
    if not options.get("path"):
        raise ConfigError("score: give the data file (DATA) or a --config whose task.options.path names it")
    options["on_bad_row"] = "skip"  # the chosen row is checked on its own below
    options["workers"] = 1
    try:
        return get_task("code", **options), str(options["path"])
    except TypeError as err:
        raise ConfigError(f"score: {err} (pass code task options as --task-option KEY=VALUE)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"score: {err}") from None


def _pick_row(task, path: str, args: argparse.Namespace):
    """(what a row is called, its number, its problem) of `--row` or `--id`; a bad row is refused, named."""
    from megatron_gspo.tasks.data_files import field, read_rows

    unit, rows = read_rows(path, "task.options.path")
    if args.row is not None:
        found = [(n, row) for n, row in rows if n == args.row]
        if not found:
            first, last = rows[0][0], rows[-1][0]
            raise ConfigError(f"score --row {args.row}: {path} has {unit}s {first} to {last}")
    else:
        keys = [args.id_key] if args.id_key else list(ID_KEYS)
        found = []
        for n, row in rows:
            key = next((k for k in keys if _has(row, k, field)), None)
            if key is not None and str(field(row, key)) == args.id:
                found.append((n, row))
        if not found:
            named = f"--id-key {args.id_key}" if args.id_key else f"any of {', '.join(ID_KEYS)} (--id-key)"
            raise ConfigError(f"score --id {args.id}: no {unit} of {path} has it in {named}")
    number, row = found[0]
    try:
        return unit, number, task.row_problem(row, number, f"{path} {unit} {number}")
    except ValueError as err:
        raise ConfigError(f"score: {err}") from None


def _has(row: dict, key: str, field) -> bool:
    try:
        field(row, key)
    except KeyError:
        return False
    return True


def _indented(text: str | None) -> str:
    if text is None:
        return "    (none)"
    if not text:
        return "    (empty)"
    return "\n".join(f"    {line}" for line in text.rstrip("\n").split("\n"))


def render(record: dict) -> str:
    """The human-readable form of a score record (`run_score`'s JSON)."""
    kind = f"function {record['fn_name']}" if record["kind"] == "function" else "stdin/stdout"
    lines = [f"{record['data']} {record['unit']} {record['row']}: {kind} problem, {record['total']} test(s)"]
    for test in record["tests"]:
        took = "       -" if test["time_s"] is None else f"{test['time_s'] * 1000:8.2f} ms"
        lines.append(f"  test {test['test']:>3}  {test['outcome']:<8} {took}")
    if record["not_run"]:
        why = " (reward=all stops at the first failure)" if record["reward_mode"] == "all" else ""
        lines.append(f"  {record['not_run']} test(s) not run{why}")
    passed = f"passed {record['passed']}/{record['total']}"
    lines.append(f"outcome: {record['outcome']}  {passed}  reward {record['reward']:.4g}")
    failure = record["first_failure"]
    if record["outcome"] == "no_program":
        lines.append("the completion holds no program (task.options.extract: the last fenced code block)")
    elif failure is not None:
        where = f"test {failure['test']}" if failure["test"] is not None else "before any test ran"
        lines.append(f"first failure: {where}")
        for name in ("input", "expected", "actual", "stderr"):
            if failure["test"] is None and name in ("input", "expected"):
                continue
            lines.append(f"  {name}:")
            lines.append(_indented(failure[name]))
    return "\n".join(lines)
