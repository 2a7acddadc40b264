r"""Agreement table of the math reward: the old hand-written reward vs math-verify vs the expected answer.

    python tools/math_reward_table.py                 # print the agreement table of docs/math-rewards.md
    python tools/math_reward_table.py --old-rev REV   # take the old reward from another commit

Each case is (completion, reference, expected reward). Columns: the project's reward before
math-verify (read from git at `--old-rev`, the last commit with the hand-written sympy
reward), math-verify alone (`parse` + `verify` on the raw texts, as its README shows), and
the project's reward now (`megatron_gspo.tasks.math.reward.math_reward`), which
tests/tasks/math/test_math_reward_table.py holds equal to the expected column on every row.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

OLD_REV = "75d82af"  # the hand-written reward (regex, fractions, a sympy fallback)

# (completion, reference, expected reward, what the row checks)
CASES: list[tuple[str, str, float, str]] = [
    # the cases a new user met
    (r"\boxed{x+1}", "1+x", 1.0, "commuted sum"),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0, "set order"),
    (r"\boxed{18 dollars}", "18", 1.0, "unit in words"),
    ("\\boxed{\u22125}", "-5", 1.0, "Unicode minus"),
    (r"\boxed{\text{(A)}}", "A", 1.0, "multiple-choice letter"),
    (r"\boxed{65}", "Natalia sold 48/2 = 24 clips in May.\n#### 65", 1.0, "GSM8K reference"),
    ("She has 72 in all.\n#### 72", "#### 72", 1.0, "GSM8K-style completion"),
    (r"\boxed{1,000}", "#### 1000", 1.0, "thousands separator vs GSM8K"),
    # numbers and fractions
    (r"\boxed{0.50}", "1/2", 1.0, "decimal vs fraction"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0, "dfrac vs short frac"),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0, "negative fraction"),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0, "rounded decimal is not 1/3"),
    (r"\boxed{0.51}", "1/2", 0.0, "near miss"),
    (r"\boxed{-2}", "2", 0.0, "sign"),
    (r"\boxed{1,2}", "12", 0.0, "a list is not a number"),
    # units, percent, degrees, money
    (r"\boxed{12 \text{ cm}}", "12", 1.0, "unit in \\text"),
    (r"\boxed{5\text{ inches}^2}", "5", 1.0, "squared unit"),
    (r"\boxed{90^\circ}", "90", 1.0, "degrees"),
    (r"\boxed{\$18.90}", "18.9", 1.0, "dollar sign"),
    (r"\boxed{50\%}", "50", 1.0, "percent sign"),
    (r"\boxed{10\%}", "0.1", 1.0, "percent as a fraction"),
    # LaTeX forms
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0, "sqrt in a fraction"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, "simplified radical"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", 0.0, "different radical"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0, "left/right tuple"),
    (r"\boxed{x = 7}", "7", 1.0, "assignment"),
    (r"\boxed{y = 2x + 3}", "2x+3", 1.0, "equation vs expression"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0, "expanded polynomial"),
    (r"\boxed{x+1}", "x+2", 0.0, "different polynomial"),
    (r"\boxed{\pi}", r"\pi", 1.0, "constant"),
    (r"\boxed{\infty}", r"\infty", 1.0, "infinity"),
    (r"\boxed{\text{Evelyn}}", "Evelyn", 1.0, "text answer"),
    # sets, intervals, tuples, matrices
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", 1.0, "three-element set"),
    (r"\boxed{(1,2]}", r"(1,2]", 1.0, "half-open interval"),
    (r"\boxed{[1,2)}", r"(1,2]", 0.0, "other half-open interval"),
    (r"\boxed{(-\infty, 0)}", r"(-\infty,0)", 1.0, "unbounded interval"),
    (r"\boxed{(1,2)}", "(2,1)", 0.0, "ordered pair"),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0, "vector"),
    # extraction
    (r"first \boxed{3}, then corrected: \boxed{4}", "4", 1.0, "last box wins"),
    (r"\fbox{17}", "17", 1.0, "fbox"),
    ("The answer is 42.", "42", 0.0, "no final answer"),
    (r"\boxed{42", "42", 0.0, "unclosed box"),
]


def load_old_reward(rev: str = OLD_REV):
    """The `math_reward` function of `rev` (read with git show), or None when git cannot give it."""
    repo = Path(__file__).resolve().parents[1]
    for path in ("megatron_gspo/tasks/math/reward.py", "megatron_gspo/tasks/math_reward.py"):  # now, before
        try:
            source = subprocess.run(
                ["git", "show", f"{rev}:{path}"], cwd=repo, capture_output=True, text=True, check=True
            ).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    else:
        return None
    module = types.ModuleType("old_math_reward")
    sys.modules[module.__name__] = module  # dataclasses look their module up while being built
    exec(compile(source, f"{rev}:math_reward.py", "exec"), module.__dict__)
    return module.math_reward


def math_verify_alone(completion: str, reference: str) -> float:
    """math-verify's verdict on the raw texts, as its README runs it (gold first)."""
    from math_verify import parse, verify

    gold = parse(reference if "\\boxed" in reference else f"${reference}$")
    return float(verify(gold, parse(completion)))


def rows(old_rev: str = OLD_REV) -> list[dict]:
    """One dict per case: completion, reference, old, math_verify, new, expected, note."""
    from megatron_gspo.tasks.math.reward import math_reward

    old = load_old_reward(old_rev)
    out = []
    for completion, reference, expected, note in CASES:
        try:
            old_value = None if old is None else old(completion, reference).reward
        except ValueError:  # the old reward refused the reference (e.g. a GSM8K solution)
            old_value = "error"
        out.append(
            {
                "completion": completion,
                "reference": reference,
                "old": old_value,
                "math_verify": math_verify_alone(completion, reference),
                "new": math_reward(completion, reference).reward,
                "expected": expected,
                "note": note,
            }
        )
    return out


def markdown(table: list[dict]) -> str:
    """The table as Markdown (1 = match, 0 = no match)."""

    def cell(value) -> str:
        return "n/a" if value is None else value if isinstance(value, str) else str(int(value))

    def code(text: str) -> str:
        return "`" + text.replace("\n", "\\n").replace("|", "\\|") + "`"

    lines = [
        "| completion | reference | old | math-verify | now | expected | checks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        cells = [code(r["completion"]), code(r["reference"]), cell(r["old"]), cell(r["math_verify"])]
        cells += [cell(r["new"]), cell(r["expected"]), r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    agree = {k: sum(r[k] == r["expected"] for r in table) for k in ("old", "math_verify", "new")}
    lines.append("")
    lines.append(
        f"Agreement with the expected column over {len(table)} cases: old {agree['old']}, "
        f"math-verify alone {agree['math_verify']}, now {agree['new']}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old-rev", default=OLD_REV, help="commit holding the hand-written reward")
    args = parser.parse_args(argv)
    print(markdown(rows(args.old_rev)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
