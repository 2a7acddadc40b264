"""Prompts for the analysis tools (`drift`, `mismatch`), encoded as the trainer encodes them.

Where they come from, first match wins:

- `--prompts FILE`: JSON lines (`.jsonl` / `.json`), one prompt per line: a string, a list of
  token ids, or an object with `input_ids` (used as is), `prompt` (text, or a list of chat
  messages `{"role", "content"}`) or the field `--prompt-key` names; any other file is plain
  text, one prompt per line.
- `--task NAME --task-option KEY=VALUE ...`: the task's held-out prompts (e.g. `--task math_jsonl
  --task-option path=gsm8k.jsonl --task-option prompt_key=question`).
- `--config YAML`: the `task` section of a training config (a run's `config.yaml` included).

Text goes through `tasks.tokenizer.encode_prompt`: the tokenizer's chat template when it has
one (or as the task's `chat_template` option says) and BOS as `task.add_bos` says; unset, BOS
is added when the tokenizer has one.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.config import ConfigError
from megatron_gspo.tasks.tokenizer import encode_prompt, encode_text, has_chat_template

DEFAULT_TASK = "addition"


def add_prompt_args(parser: argparse.ArgumentParser, default_num_prompts: int) -> None:
    """The prompt-source arguments shared by `drift` and `mismatch`."""
    parser.add_argument(
        "--prompts", help="prompt file: JSON lines (.jsonl) or plain text, one prompt per line"
    )
    parser.add_argument("--prompt-key", default="prompt", help="field of a JSON-lines prompt object")
    parser.add_argument("--task", help=f"task whose held-out prompts are used (default: {DEFAULT_TASK})")
    parser.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task constructor option, repeatable (values parsed as YAML: 3, true, [1, 2])",
    )
    parser.add_argument("--config", help="training config (e.g. RUN/config.yaml) whose task section is used")
    parser.add_argument(
        "--add-bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepend BOS to text prompts (default: config task.add_bos, else if the tokenizer has one)",
    )
    parser.add_argument("--num-prompts", type=int, default=default_num_prompts)


def parse_task_options(pairs: list[str]) -> dict[str, Any]:
    """`--task-option KEY=VALUE` pairs as task options (values read as YAML)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--task-option {pair!r}: expected KEY=VALUE (e.g. path=data/gsm8k.jsonl)")
        parsed = yaml.safe_load(value) if value else ""
        # "{problem}" is YAML for a mapping; a template is meant, unless it reads like one ("{a: 1}")
        options[key] = value if isinstance(parsed, dict) and ":" not in value else parsed
    return options


def task_spec(args: argparse.Namespace) -> tuple[str, dict[str, Any], bool | None, str]:
    """(task name, options, add_bos or None, eval file or "") from `--config`, `--task`, `--task-option`.

    A run's `eval.path` is where its held-out prompts come from: with it set the run trained on
    every row of its training file, so the training file's hash split would not be held out.
    """
    name, options, add_bos, eval_path = DEFAULT_TASK, {}, None, ""
    if args.config:
        from megatron_gspo.config import load_config

        cfg = load_config(args.config)
        name, options, add_bos = cfg.task.name, dict(cfg.task.options), cfg.task.add_bos
        eval_path = cfg.eval.path or ""
    if args.task:
        if args.config and args.task != name:
            options, eval_path = {}, ""  # another task's options would not fit
        name = args.task
    options.update(parse_task_options(args.task_option))
    return name, options, args.add_bos if args.add_bos is not None else add_bos, eval_path


def _build_task(name: str, options: dict[str, Any]):
    from megatron_gspo.tasks import get_task

    try:
        return get_task(name, **options)
    except KeyError as err:
        raise ConfigError(f"--task: {err.args[0]}") from None
    except TypeError as err:
        raise ConfigError(f"--task {name}: {err} (pass them as --task-option KEY=VALUE)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--task {name}: {err}") from None


def _encode(tokenizer, prompt, add_bos: bool, chat_template: bool | None) -> list[int]:
    """Text (or chat messages) -> token ids as the trainer's rollouts encode them."""
    if isinstance(prompt, list):  # chat messages: the template renders them as given
        if not has_chat_template(tokenizer):
            raise ValueError("a prompt of chat messages needs a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = encode_text(tokenizer, text)
        bos = tokenizer.bos_token_id
        return [bos] + ids if add_bos and bos is not None and ids[0] != bos else ids
    return encode_prompt(tokenizer, prompt, add_bos=add_bos, chat_template=chat_template)


def _file_prompts(path: Path, key: str) -> list[Any]:
    """Rows of a prompt file: token-id lists, text, or lists of chat messages."""
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix not in (".jsonl", ".json"):
        return lines
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--prompts {path} line {number} is not JSON: {err.msg}") from None
        if isinstance(row, dict):
            found = row.get("input_ids", row.get(key))
            if found is None:
                raise ConfigError(
                    f"--prompts {path} line {number} has neither input_ids nor {key!r} "
                    f"(--prompt-key); its fields: {sorted(row)}"
                )
            row = found
        if not isinstance(row, str | list) or not row:
            raise ConfigError(f"--prompts {path} line {number}: expected text, token ids or chat messages")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class PromptSource:
    """Prompts read and checked before any model is loaded, encoded later with its tokenizer.

    Attributes:
        rows: text, chat messages or token ids, one per prompt.
        add_bos: BOS for text prompts (None: when the tokenizer has one).
        chat_template: the task's chat-template choice (None: when the tokenizer has one).
    """

    rows: list[Any]
    add_bos: bool | None
    chat_template: bool | None

    def encode(self, tokenizer) -> list[list[int]]:
        """Token ids of every prompt, as the trainer's rollouts encode them."""
        add_bos = self.add_bos
        if add_bos is None:
            add_bos = getattr(tokenizer, "bos_token_id", None) is not None
        out = []
        for number, row in enumerate(self.rows, start=1):
            if isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                if min(row) < 0:
                    raise ConfigError(f"prompt {number}: token ids must be >= 0, got {min(row)}")
                out.append(row)
                continue
            try:
                out.append(_encode(tokenizer, row, add_bos, self.chat_template))
            except ValueError as err:
                raise ConfigError(f"prompt {number}: {err}") from None
        return out


def prompt_source(args: argparse.Namespace) -> PromptSource:
    """Up to `--num-prompts` prompts from the configured source (module docstring)."""
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    name, options, add_bos, eval_path = task_spec(args)
    if args.prompts:
        rows = _file_prompts(Path(args.prompts), args.prompt_key)[: args.num_prompts]
        if not rows:
            raise ConfigError(f"--prompts {args.prompts}: no prompts")
        return PromptSource(rows, add_bos, None)
    task = _build_task(name, options)
    where = f"task {name}'s held-out split"
    if eval_path and hasattr(task, "use_eval_file"):
        try:
            task.use_eval_file(eval_path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--config {args.config}: eval.path {eval_path}: {err}") from None
        where = f"eval.path {eval_path} (the run trained on every row of its training file)"
    try:
        rows = [p.prompt for p in task.heldout(args.num_prompts)]
    except ValueError as err:
        raise ConfigError(f"--num-prompts {args.num_prompts}: {err}") from None
    print(f"prompts: {len(rows)} from {where}", file=sys.stderr, flush=True)
    return PromptSource(rows, add_bos, task.chat_template)
