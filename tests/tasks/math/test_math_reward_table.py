"""The agreement table of docs/math-rewards.md: the reward gives the expected verdict on every case."""

import importlib.util
from pathlib import Path

import pytest

from megatron_gspo.tasks.math.reward import math_reward

REPO = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("math_reward_table", REPO / "tools" / "math_reward_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


@pytest.mark.parametrize(
    "completion, reference, expected, note", table.CASES, ids=[c[3] for c in table.CASES]
)
def test_reward_equals_expected(completion, reference, expected, note):
    assert math_reward(completion, reference).reward == expected


def test_table_covers_the_reported_cases_and_more():
    notes = {c[3] for c in table.CASES}
    reported = {"commuted sum", "set order", "unit in words", "Unicode minus", "multiple-choice letter"}
    assert reported | {"GSM8K reference"} <= notes
    assert len(table.CASES) >= len(reported) + 1 + 30
    assert sum(c[2] == 0.0 for c in table.CASES) >= 10  # negatives too: a reward that says 1 always fails


def test_the_docs_show_the_table():
    page = (REPO / "docs" / "math-rewards.md").read_text()
    section = page.split("## Math rewards", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) == len(table.CASES)
    for row, (_, _, expected, note) in zip(rows, table.CASES):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[-1] == note and cells[-2] == cells[-3] == str(int(expected)), row
