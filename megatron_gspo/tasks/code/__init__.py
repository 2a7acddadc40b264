"""The code task: programs from a completion run on a problem's tests in a sandbox.

- `dataset`: the task ("code"), problems from a data file;
- `cases`: test cases as data sets spell them, and the program in a completion;
- `reward`: a program scored on its tests, many in a pool;
- `compare`: whether an output is the expected one;
- `sandbox`: one untrusted program under bubblewrap and rlimits;
- `function_harness.py`: runs inside the sandbox for function-call problems.
"""

from megatron_gspo.tasks.code.cases import TestSuite, extract_program, parse_tests
from megatron_gspo.tasks.code.dataset import CodeTask
from megatron_gspo.tasks.code.reward import CodeResult, CodeScorer, Outcome, ScoringOptions, score_program
from megatron_gspo.tasks.code.sandbox import Limits, SandboxUnavailableError, sandbox_runner

__all__ = [
    "CodeResult",
    "CodeScorer",
    "CodeTask",
    "Limits",
    "Outcome",
    "SandboxUnavailableError",
    "ScoringOptions",
    "TestSuite",
    "extract_program",
    "parse_tests",
    "sandbox_runner",
    "score_program",
]
