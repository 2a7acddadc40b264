"""Start-up check of every prompt a run can see: it encodes, and it fits `max_prompt_len`.

With cold-start SFT on, each row's SFT target (the boxed answer of a math row) must encode too: a target
the tokenizer cannot encode would otherwise stop the run at the first SFT step.

A file-backed task's rows are all encoded once, as the rollouts will encode them (BOS, chat
template), so a prompt the tokenizer cannot encode, a BOS the tokenizer lacks or a prompt
longer than the budget stops the run before any work, naming the row and the key to change.
Generated tasks (the demo's) compute their exact budget; one drawn prompt checks the encoding.
"""

from __future__ import annotations

import numpy as np

from megatron_gspo.tasks.base import Task
from megatron_gspo.tasks.tokenizer import encode_text, problem_prompt_ids


def check_prompts(task: Task, tokenizer, *, add_bos: bool, sft: bool = False) -> dict[str, int]:
    """Encode every prompt of `task`; returns {"prompts", "longest"} (tokens, BOS included).

    `task.max_prompt_len` counts the prompt's own tokens (chat template included); the BOS that
    `add_bos` puts first comes on top, as the sequence-length checks of `validate` count it.

    Args:
        task: the run's task.
        tokenizer: the run's tokenizer.
        add_bos: prompts start with BOS.
        sft: cold-start SFT runs: each row's SFT target must encode as well.

    Raises:
        ValueError: a prompt (or, with `sft`, an SFT target) that does not encode, named by its
            row, or prompts longer than
            `task.options.max_prompt_len` (how many, by how much, which row is the longest).
    """
    problems = task.all_problems()
    if problems is None:
        problems = [task.draw_problem(np.random.default_rng(0))]
    lengths = []
    for problem in problems:
        try:
            ids = problem_prompt_ids(tokenizer, problem, add_bos=add_bos, chat_template=task.chat_template)
        except ValueError as err:
            raise ValueError(f"{_where(problem)}: {err}") from None
        lengths.append(len(ids))
        if sft:
            try:
                encode_text(tokenizer, task.sft_example(problem)[1])
            except ValueError as err:
                raise ValueError(
                    f"the SFT target of {_where(problem).removeprefix('the prompt of ')}: {err}"
                ) from None
    budget = task.max_prompt_len + int(add_bos)  # the budget counts the prompt, the BOS comes on top
    over = [n - budget for n in lengths if n > budget]
    if over:
        longest = int(np.argmax(lengths))
        raise ValueError(
            f"{len(over)} of {len(lengths)} prompts are longer than task.options.max_prompt_len="
            f"{task.max_prompt_len} tokens{' + BOS' * add_bos} and would be cut, by {min(over)} to "
            f"{max(over)} tokens (longest {lengths[longest]} tokens, {_where(problems[longest])}); raise "
            f"task.options.max_prompt_len to {lengths[longest] - int(add_bos)} or drop those rows"
        )
    return {"prompts": len(lengths), "longest": max(lengths)}


def _where(problem) -> str:
    line = problem.metadata.get("line")
    return f"the prompt of row {line}" if line is not None else f"prompt {problem.prompt[:40]!r}"
