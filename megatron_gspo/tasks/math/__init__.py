"""The math task: a completion's final answer against a reference answer.

- `dataset`: the task ("math_jsonl"), problems from a data file;
- `reward`: the answer extracted, normalised and compared.
"""

from megatron_gspo.tasks.math.dataset import MathJsonlTask
from megatron_gspo.tasks.math.reward import MathRewardResult, extract_answer, math_reward

__all__ = ["MathJsonlTask", "MathRewardResult", "extract_answer", "math_reward"]
