"""Prompts and verifiable rewards: the CPU demo tasks, the math-answer reward, prompt streams.

Importing the package registers the built-in tasks ("addition", "sort_digits", "math_jsonl", "code").
"""

from megatron_gspo.tasks import arithmetic, code, math, sorting  # noqa: F401  (importing registers the tasks)
from megatron_gspo.tasks.base import Problem, Task, available_tasks, get_task, register_task
from megatron_gspo.tasks.data import PromptStream, sft_batches
from megatron_gspo.tasks.evaluation import evaluate_accuracy

__all__ = [
    "Problem",
    "PromptStream",
    "Task",
    "available_tasks",
    "evaluate_accuracy",
    "get_task",
    "register_task",
    "sft_batches",
]
