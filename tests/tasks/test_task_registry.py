import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_gspo.tasks import Problem, Task, available_tasks, get_task, register_task
from megatron_gspo.tasks.arithmetic import AdditionTask
from megatron_gspo.tasks.sorting import SortDigitsTask


def test_builtin_tasks_are_registered():
    assert {"addition", "sort_digits"} <= set(available_tasks())
    assert isinstance(get_task("addition", max_digits=3), AdditionTask)
    assert isinstance(get_task("sort_digits"), SortDigitsTask)
    assert get_task("addition").name == "addition"


def test_unknown_task_lists_available_ones():
    with pytest.raises(KeyError, match="available: .*addition.*sort_digits"):
        get_task("additon")


def test_unknown_option_lists_accepted_ones():
    with pytest.raises(TypeError, match=r"\['digits'\].*min_digits.*max_digits.*format_reward"):
        get_task("addition", digits=3)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_task("addition")(AdditionTask)


def test_problem_equality_ignores_metadata():
    a = Problem("1+2=", "3", {"a": 1, "b": 2})
    assert a == Problem("1+2=", "3") and hash(a) == hash(Problem("1+2=", "3"))
    assert a != Problem("1+2=", "4")


def test_sft_example_is_prompt_and_bare_answer():
    problem = Problem("12+5=", "17")
    assert get_task("addition").sft_example(problem) == ("12+5=", "17")


def test_task_without_reward_cannot_be_built():
    class Incomplete(Task):
        def draw_problem(self, rng):
            return Problem("x", "y")

    with pytest.raises(TypeError):
        Incomplete()


def test_heldout_split_is_the_same_in_processes_with_different_hash_salts():
    code = (
        "from megatron_gspo.tasks import get_task\n"
        "print([p.prompt for p in get_task('addition').heldout(20)])"
    )
    outputs = set()
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert outputs.pop().strip() == str([p.prompt for p in get_task("addition").heldout(20)])


def test_task_whose_space_is_all_heldout_raises_instead_of_looping():
    class OnlyHeldout(Task):
        def draw_problem(self, rng):
            return Problem("7+1=", "8")

        def reward(self, problem, completion):
            return 0.0

    task = OnlyHeldout()
    assert task.is_heldout(Problem("7+1=", "8"))
    assert task.heldout(1) == [Problem("7+1=", "8")]
    with pytest.raises(ValueError, match="nearly all held out"):
        task.sample_prompts(3, np.random.default_rng(0))
