r"""Math problems from a data file (JSON lines, Parquet, `datasets` directory), scored by the math reward."""

from __future__ import annotations

from megatron_gspo.tasks.base import Problem, register_task
from megatron_gspo.tasks.data_files import chat_messages, field, read_rows
from megatron_gspo.tasks.file_task import FileTask
from megatron_gspo.tasks.math.reward import check_reference, extract_answer, math_reward

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


@register_task("math_jsonl")
class MathJsonlTask(FileTask):
    r"""One problem per row; reward 1.0 when the completion's final answer matches the reference.

    The data set is a JSON-lines file, a Parquet file or a `datasets` `save_to_disk` directory
    (`tasks.data_files`). The field names follow it: MATH `problem`/`solution`, GSM8K
    `question`/`answer`, DAPO/verl `prompt` (a list of chat messages) and
    `reward_model.ground_truth` (a dotted key reaches into nested fields). References may be
    bare answers or whole solutions (their last \boxed{} or "#### N"); each is checked when the
    file is read, and one without a parseable final answer is refused naming its row.

    A text problem is placed in `template`, then goes through the tokenizer's chat template as
    one user turn when `chat_template` says so; a chat-message prompt is used as it is (its own
    instructions, no template) and needs the chat template. Held-out problems are the usual
    prompt-hash split of the rows, or the rows of a separate file (`use_eval_file`, `eval.path`).

    Args:
        path: the data set (`task.options.path`).
        prompt_key: field holding the problem text or the chat messages.
        answer_key: field holding the reference answer or solution.
        template: prompt text; "{problem}" is replaced by the problem (other braces are literal).
        chat_template: apply the tokenizer's chat template (None: when the tokenizer has one).
        max_prompt_len: prompt budget in tokens (every prompt is checked against it at start-up).
        max_answer_len: response budget in tokens.
    """

    def __init__(
        self,
        path: str,
        prompt_key: str = "problem",
        answer_key: str = "answer",
        template: str = DEFAULT_TEMPLATE,
        chat_template: bool | None = None,
        max_prompt_len: int = 1024,
        max_answer_len: int = 4096,
    ):
        if "{problem}" not in template:
            raise ValueError(f"template must contain '{{problem}}', got {template!r}")
        if chat_template not in (None, True, False):
            raise ValueError(f"chat_template must be true, false or unset, got {chat_template!r}")
        self.chat_template = chat_template
        self.max_prompt_len, self.max_answer_len = max_prompt_len, max_answer_len
        self.prompt_key, self.answer_key, self.template = prompt_key, answer_key, template
        self._load(path)

    def _read(self, path: str, option: str) -> list[Problem]:
        unit, rows = read_rows(path, option)
        keys = {"prompt_key": self.prompt_key, "answer_key": self.answer_key}
        problems = []
        for number, row in rows:
            values = {}
            for name, key in keys.items():
                try:
                    values[name] = field(row, key)
                except KeyError:
                    raise ValueError(
                        f"{path} {unit} {number} has no field for task.options.{name}={key!r}; "
                        f"its fields: {sorted(row)}"
                    ) from None
            try:
                answer = check_reference(str(values["answer_key"]))
            except ValueError as err:
                raise ValueError(
                    f"{path} {unit} {number} (task.options.answer_key={self.answer_key!r}): {err}"
                ) from None
            messages = chat_messages(values["prompt_key"])
            if messages is not None:
                prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
                metadata = {"line": number, "messages": messages}
            else:
                prompt = self.template.replace("{problem}", str(values["prompt_key"]))
                metadata = {"line": number}
            problems.append(Problem(prompt, answer, metadata))
        if not problems:
            raise ValueError(f"{option}={path} holds no problems")
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        r"""1.0 if the final answer of `completion` matches the reference answer, else 0.0."""
        return math_reward(completion, problem.answer).reward

    def has_answer(self, completion: str) -> bool:
        r"""Whether `completion` states a final answer (a closed \boxed{} or a "#### N" line)."""
        return extract_answer(completion)[0] is not None

    def sft_example(self, problem: Problem) -> tuple[str | list[dict[str, str]], str]:
        r"""(prompt or chat messages, "\boxed{answer}"): cold start teaches the form the reward reads."""
        return problem.metadata.get("messages") or problem.prompt, f"\\boxed{{{problem.answer}}}"

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """Correct means full reward (the final answer matches)."""
        return self.reward(problem, completion) == 1.0
