"""Write the CPU code demo's problems: one-line Python functions from a chain of arithmetic steps.

    python tools/make_code_tiny_data.py            # (re)writes configs/data/code_tiny.jsonl

A problem is a chain of one or two steps applied to x, e.g. "add 3 mul 2"; the answer is the
function `def f(x): return (x+3)*2`, checked by calling `f` on five inputs (function-call tests,
APPS layout: `question`, `input_output` = {"inputs", "outputs", "fn_name"}, `solution`). Every
character is in the character tokenizer's alphabet. The file is deterministic: the 27 one-step
and 729 two-step chains in a fixed order, so regenerating it gives the same bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

OPS = {"add": "+", "sub": "-", "mul": "*"}
INPUTS = [0, 1, 2, 5, -3]
OUT = Path(__file__).resolve().parents[1] / "configs" / "data" / "code_tiny.jsonl"


def expression(steps: list[tuple[str, int]]) -> str:
    """The Python expression of `steps` applied to x, parenthesised only where precedence needs it."""
    expr = "x"
    for op, k in steps:
        if op == "mul" and expr != "x":
            expr = f"({expr})*{k}"
        else:
            expr = f"{expr}{OPS[op]}{k}"
    return expr


def apply(steps: list[tuple[str, int]], x: int) -> int:
    """`steps` applied to `x`, computed directly (not through the expression)."""
    for op, k in steps:
        x = x + k if op == "add" else x - k if op == "sub" else x * k
    return x


def rows() -> list[dict]:
    """Every problem, one-step chains first."""
    single = [(op, k) for op in OPS for k in range(1, 10)]
    chains = [[s] for s in single] + [[a, b] for a, b in itertools.product(single, single)]
    return [
        {
            "question": " ".join(f"{op} {k}" for op, k in steps),
            "input_output": {"inputs": [[x] for x in INPUTS], "outputs": [apply(steps, x) for x in INPUTS],
                             "fn_name": "f"},
            "solution": f"def f(x): return {expression(steps)}",
        }
        for steps in chains
    ]  # fmt: skip


def main() -> None:
    """Write the problems (one JSON object per line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    out.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {len(rows())} problems to {out}")


if __name__ == "__main__":
    main()
