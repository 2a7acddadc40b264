"""The code task reads problems as data sets hold them and scores completions through the sandbox."""

import base64
import importlib.util
import json
import logging
import os
import pickle
import zlib
from pathlib import Path

import pytest

from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.code.cases import extract_program, fence, parse_tests
from megatron_gspo.tasks.code.sandbox import sandbox_runner

REPO = Path(__file__).resolve().parents[3]

STDIN_ROW = {  # APPS: the tests as a JSON string column
    "question": "Print the sum of two integers.",
    "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}),
    "solutions": "a, b = map(int, input().split())\nprint(a + b)",
}
FUNCTION_ROW = {
    "question": "Return the larger of a and b.",
    "input_output": {"inputs": [[1, 2], [7, 3]], "outputs": [[2], [7]], "fn_name": "larger"},
    "solutions": "def larger(a, b):\n    return max(a, b)",
}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def task(tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW, FUNCTION_ROW])
    return get_task("code", path=str(path), solution_key="solutions", time_limit_s=1)


def test_rows_become_prompts_with_their_tests(task):
    stdin, function = task.all_problems()
    assert stdin.prompt.startswith("Print the sum of two integers.\n\nWrite a Python 3 program")
    assert "function `larger`" in function.prompt
    assert stdin.metadata["tests"].inputs == ("1 2\n", "5 5\n") and stdin.metadata["tests"].fn_name is None
    assert function.metadata["tests"].fn_name == "larger"


def test_completions_score_through_the_sandbox(task):
    stdin, function = task.all_problems()
    right = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\nprint(3)\n```"
    fn_right = "Try\n```python\nprint('draft')\n```\nthen\n```\ndef larger(a, b):\n    return max(a, b)\n```"
    problems = [stdin, stdin, stdin, function, function]
    completions = [right, half, "no code at all", fn_right, "```python\ndef larger(a, b):\n  return a\n```"]
    rewards, metrics = task.score_batch(problems, completions)
    assert rewards == [1.0, 0.5, 0.0, 1.0, 0.5]
    assert metrics["reward/code_pass_frac"] == 2 / 5
    assert metrics["reward/code_wrong_frac"] == 2 / 5
    assert metrics["reward/code_no_program_frac"] == 1 / 5
    assert metrics["reward/code_tests_passed_frac"] == 6 / 10
    assert task.judge_batch(problems, completions)[1] == [True, False, False, True, False]
    assert [task.has_answer(c) for c in completions] == [True, True, False, True, True]


def test_all_or_nothing_reward(tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW])
    task = get_task("code", path=str(path), reward="all", time_limit_s=1)
    (problem,) = task.all_problems()
    assert task.reward(problem, "```python\nprint(3)\n```") == 0.0
    assert task.reward(problem, "```python\nprint(sum(map(int, input().split())))\n```") == 1.0


def test_sft_targets_are_what_extraction_reads(task):
    stdin, _ = task.all_problems()
    prompt, target = task.sft_example(stdin)
    assert prompt == stdin.prompt
    assert extract_program(target) == STDIN_ROW["solutions"]


def test_livecodebench_tests_and_a_function_name_field(tmp_path):
    row = {
        "question_content": "Double it.",
        "public_test_cases": json.dumps([{"input": "4", "output": "8", "testtype": "functional"}]),
        "metadata": {"func_name": "double"},
    }
    path = write_jsonl(tmp_path / "lcb.jsonl", [row])
    task = get_task(
        "code", path=str(path), prompt_key="question_content", tests_key="public_test_cases",
        fn_name_key="metadata.func_name", time_limit_s=1,
    )  # fmt: skip
    (problem,) = task.all_problems()
    assert problem.metadata["tests"].inputs == ([4],)
    assert (
        task.reward(
            problem, "```python\nclass Solution:\n    def double(self, x):\n        return 2 * x\n```"
        )
        == 1.0
    )


def test_parquet_and_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [STDIN_ROW, {**FUNCTION_ROW, "input_output": json.dumps(FUNCTION_ROW["input_output"])}]
    data = datasets.Dataset.from_list(rows)  # a JSON string column, as APPS has it
    data.to_parquet(str(tmp_path / "code.parquet"))
    data.save_to_disk(str(tmp_path / "code_dir"))
    for path in (tmp_path / "code.parquet", tmp_path / "code_dir"):
        task = get_task("code", path=str(path), time_limit_s=1)
        assert [p.metadata["tests"].fn_name for p in task.all_problems()] == [None, "larger"]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "q"}, "line 1 has no field for task.options.tests_key='input_output'"),
        ({"question": "q", "input_output": {"inputs": ["1"], "outputs": []}}, "1 inputs but 0 outputs"),
        ({"question": "q", "input_output": "{not json"}, "string but not JSON"),
        ({"question": "q", "input_output": {"inputs": [], "outputs": []}}, "no tests"),
        ({"question": "q", "input_output": {"in": [1]}}, "expected inputs/outputs"),
        (
            {"question": "q", "input_output": {"inputs": [1], "outputs": [2], "fn_name": "f"}},
            "argument lists",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        get_task("code", path=str(path))


def test_bad_options_are_refused(tmp_path):
    path = str(write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW]))
    with pytest.raises(ValueError, match="reward must be one of"):
        get_task("code", path=path, reward="most")
    with pytest.raises(ValueError, match="sandbox must be 'bwrap' or 'none'"):
        get_task("code", path=path, sandbox="docker")
    with pytest.raises(ValueError, match="extract must be"):
        get_task("code", path=path, extract="first_block")


def test_a_run_without_bubblewrap_is_refused_by_name(tmp_path, monkeypatch):
    path = str(write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW]))
    sandbox_runner.cache_clear()  # probe again, on a PATH without bwrap
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"sandbox=bwrap: no bubblewrap .*apt-get install -y bubblewrap"):
            get_task("code", path=path)
    finally:
        sandbox_runner.cache_clear()


def test_sandbox_none_warns_loudly(tmp_path, caplog):
    path = str(write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW]))
    with caplog.at_level(logging.WARNING):
        task = get_task("code", path=path, sandbox="none", time_limit_s=1)
    assert "WITHOUT ISOLATION" in caplog.text
    (problem,) = task.all_problems()
    assert task.reward(problem, "```python\nprint(sum(map(int, input().split())))\n```") == 1.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("```python\nprint(1)\n```", "print(1)"),
        ("a\n```py\nx = 1\n```\nb\n```\nprint(2)\n```\nthe end", "print(2)"),
        ("```python\nprint(3)\n", "print(3)\n"),  # truncated: the unclosed last block runs to the end
        ("print(4)", None),
        ("```python\n\n```", None),
    ],
)
def test_extract_last_block(completion, expected):
    assert extract_program(completion) == expected


def test_fence_round_trips():
    assert extract_program(fence("x = 1\nprint(x)\n")) == "x = 1\nprint(x)"


def test_codecontests_lines_form():
    suite = parse_tests({"input": [["1 2", "3"]], "output": ["x\n"]})
    assert suite.inputs == ("1 2\n3\n",)


def test_demo_data_is_the_generators_and_every_solution_is_right():
    spec = importlib.util.spec_from_file_location(
        "make_code_tiny_data", REPO / "tools" / "make_code_tiny_data.py"
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    rows = maker.rows()
    assert (REPO / "configs" / "data" / "code_tiny.jsonl").read_text() == "".join(
        json.dumps(r) + "\n" for r in rows
    )
    assert len(rows) == 27 + 27 * 27
    for row in rows:  # our own solutions, checked in-process against the directly computed outputs
        namespace = {}
        exec(row["solution"], namespace)
        tests = row["input_output"]
        assert [namespace["f"](*args) for args in tests["inputs"]] == tests["outputs"], row["question"]
    assert rows[27 + 9 * 27 + 18]["solution"] == "def f(x): return (x-1)*1"  # "sub 1 mul 1": brackets


def packed(value) -> str:
    """LiveCodeBench's private_test_cases encoding: base64(zlib(pickle(value)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(value))).decode()


LCB_ROWS = [  # as LiveCodeBench ships them: metadata a JSON string, private tests packed
    {
        "question_content": "Given nums and target, return the indices of the two numbers adding to target.",
        "starter_code": (
            "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        "
        ),
        "public_test_cases": json.dumps(
            [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]
        ),
        "private_test_cases": packed(json.dumps([
            {"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"},
            {"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"},
        ])),
        "metadata": json.dumps({"func_name": "twoSum"}),
    },
    {
        "question_content": "Read n and print n squared.",
        "starter_code": "",
        "public_test_cases": json.dumps([{"input": "3\n", "output": "9\n", "testtype": "stdin"}]),
        "private_test_cases": packed(json.dumps([{"input": "12\n", "output": "144\n", "testtype": "stdin"}])),
        "metadata": "{}",  # a stdin row has no func_name
    },
]  # fmt: skip
TWO_SUM = (
    "```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
    "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
    "                return [seen[target - x], i]\n            seen[x] = i\n```"
)


def lcb_task(tmp_path, tests_key, **options):
    path = write_jsonl(tmp_path / "lcb.jsonl", LCB_ROWS)
    return get_task(
        "code", path=str(path), prompt_key="question_content", tests_key=tests_key,
        fn_name_key="metadata.func_name", time_limit_s=1, **options,
    )  # fmt: skip


def test_livecodebench_as_shipped_loads_and_scores(tmp_path):
    """metadata is a JSON string; stdin rows have no func_name; the starter code is in the prompt."""
    task = lcb_task(tmp_path, "public_test_cases")
    function, stdin = task.all_problems()
    assert function.metadata["tests"].fn_name == "twoSum" and stdin.metadata["tests"].fn_name is None
    assert (
        "```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n```"
        in (function.prompt)
    )
    assert task.reward(function, TWO_SUM) == 1.0  # List without an import: the prelude has it
    assert task.reward(stdin, "```python\nprint(int(input()) ** 2)\n```") == 1.0


def test_livecodebench_private_tests_are_decoded(tmp_path):
    task = lcb_task(tmp_path, "private_test_cases")
    function, stdin = task.all_problems()
    assert function.metadata["tests"].inputs == ([[3, 2, 4], 6], [[3, 3], 6])
    assert function.metadata["tests"].outputs == ([1, 2], [0, 1])
    assert stdin.metadata["tests"].inputs == ("12\n",)
    assert task.reward(function, TWO_SUM) == 1.0


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mgspo-pwned",))


@pytest.mark.parametrize(
    "blob, message",
    [
        (packed(_Boom()), "names posix.system"),  # a pickle that would run a command is never run
        (packed({1, 2}), "holds a set; only plain values"),  # no class lookup, but not a plain value
        (packed("[{not json"), "unpickles to a string that is not JSON"),
        (base64.b64encode(b"not zlib at all, certainly").decode(), "not base64 \\+ zlib"),
        ("this is neither json nor base64!", "string but not JSON"),
    ],
)
def test_packed_tests_never_run_code_and_errors_say_why(blob, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(blob)
    assert not os.path.exists("/tmp/mgspo-pwned")


def test_packed_tests_cannot_decompress_without_bound(monkeypatch):
    from megatron_gspo.tasks.code import cases

    monkeypatch.setattr(cases, "MAX_PACKED_BYTES", 1 << 20)
    bomb = base64.b64encode(zlib.compress(b"\0" * (4 << 20))).decode()
    with pytest.raises(ValueError, match="decompresses to over 1 MiB"):
        parse_tests(bomb)


def test_apps_solutions_column_gives_its_first_program(tmp_path):
    row = {
        **STDIN_ROW,
        "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)", "print(0)"]),
    }
    path = write_jsonl(tmp_path / "apps.jsonl", [row])
    task = get_task("code", path=str(path), solution_key="solutions", time_limit_s=1)
    (problem,) = task.all_problems()
    _, target = task.sft_example(problem)
    assert target == "```python\na, b = map(int, input().split())\nprint(a + b)\n```"  # not '["a, b = ...'
    assert task.reward(problem, target) == 1.0


@pytest.mark.parametrize("solutions", [json.dumps([]), json.dumps(["ok", 3]), ["", ""]])
def test_apps_solutions_that_are_no_programs_are_refused_by_name(tmp_path, solutions):
    path = write_jsonl(tmp_path / "apps.jsonl", [{**STDIN_ROW, "solutions": solutions}])
    with pytest.raises(ValueError, match="line 1: task.options.solution_key holds"):
        get_task("code", path=str(path), solution_key="solutions", time_limit_s=1)


def test_function_rows_without_starter_code_get_a_signature(tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", [FUNCTION_ROW])
    (problem,) = get_task("code", path=str(path), time_limit_s=1).all_problems()
    assert "```python\ndef larger(arg1, arg2):\n```" in problem.prompt


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path, caplog):
    empty = {"question": "q", "input_output": ""}  # APPS has rows like this
    path = write_jsonl(tmp_path / "apps.jsonl", [STDIN_ROW, empty, FUNCTION_ROW, {"question": "q"}])
    with pytest.raises(ValueError, match="line 2"):
        get_task("code", path=str(path), time_limit_s=1)
    with caplog.at_level(logging.WARNING):
        task = get_task("code", path=str(path), time_limit_s=1, on_bad_row="skip")
    assert [p.metadata["line"] for p in task.all_problems()] == [1, 3]
    assert "skipped 2 bad row(s) of 4 (task.options.on_bad_row=skip)" in caplog.text
    assert "line 2" in caplog.text and "line 4" in caplog.text
    _, metrics = task.score_batch(task.all_problems()[:1], ["```python\nprint(3)\n```"])
    assert metrics["reward/code_rows_skipped"] == 2.0
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        get_task("code", path=str(path), on_bad_row="ignore")


def test_a_row_tolerance_field(tmp_path):
    rows = [
        {**STDIN_ROW, "input_output": {"inputs": ["\n"], "outputs": ["0.5\n"]}, "tol": 0.01},
        {**STDIN_ROW, "input_output": {"inputs": ["\n"], "outputs": ["0.5\n"]}},
    ]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    task = get_task("code", path=str(path), time_limit_s=1, float_tolerance_key="tol")
    own, default = task.all_problems()
    assert task.reward(own, "```python\nprint(0.505)\n```") == 1.0
    assert task.reward(default, "```python\nprint(0.505)\n```") == 0.0  # the task's: exact
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**rows[0], "tol": "loose"}])
    with pytest.raises(ValueError, match="float_tolerance_key='tol' holds 'loose'"):
        get_task("code", path=str(bad), float_tolerance_key="tol")
