import json

import numpy as np
import pytest

from megatron_gspo.tasks import evaluate_accuracy, get_task


@pytest.fixture
def math_file(tmp_path):
    rows = [
        {"problem": f"What is {i} + {i}?", "answer": str(2 * i), "source": "synthetic"} for i in range(200)
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    return path


def test_rows_become_problems_in_the_template(math_file):
    task = get_task("math_jsonl", path=str(math_file), template="Q: {problem} A: \\boxed{}")
    assert len(task.problems) == 200
    assert task.problems[3].prompt == "Q: What is 3 + 3? A: \\boxed{}" and task.problems[3].answer == "6"


def test_reward_uses_the_boxed_answer(math_file):
    task = get_task("math_jsonl", path=str(math_file))
    problem = task.problems[5]
    assert "put your final answer within \\boxed{}" in problem.prompt
    assert task.reward(problem, "5 + 5 = \\boxed{10}") == 1.0
    assert task.reward(problem, "\\boxed{10.0}") == 1.0 and task.is_correct(problem, "\\boxed{10.0}")
    assert task.reward(problem, "10") == 0.0 and task.reward(problem, "\\boxed{11}") == 0.0
    metrics = evaluate_accuracy(task, [problem, problem], ["\\boxed{10}", "\\boxed{1}"])
    assert metrics["accuracy"] == metrics["mean_reward"] == 0.5


def test_heldout_rows_are_never_sampled_for_training(math_file):
    task = get_task("math_jsonl", path=str(math_file))
    heldout = {p.prompt for p in task.heldout(8)}
    training = {p.prompt for p in task.sample_prompts(2000, np.random.default_rng(0))}
    assert heldout and not heldout & training
    assert len(heldout) + len(training) <= 200


def test_bad_rows_and_templates_are_named(tmp_path, math_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1"}\n', encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"line 1 has no field for task.options.answer_key='answer'; its fields: \['problem'\]",
    ):
        get_task("math_jsonl", path=str(bad))
    with pytest.raises(ValueError, match=r"line 2 has no field for task.options.prompt_key='question'"):
        bad.write_text('{"question": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n')
        get_task("math_jsonl", path=str(bad), prompt_key="question")
    bad.write_text('{"problem": "1+1", "answer": "2"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is a JSON list, not an object"):
        get_task("math_jsonl", path=str(bad))
    bad.write_text('{"problem": "1+1", "answer": 2\n')
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        get_task("math_jsonl", path=str(bad))
    with pytest.raises(ValueError, match="chat_template must be true, false or unset"):
        get_task("math_jsonl", path=str(math_file), chat_template="yes")
    with pytest.raises(ValueError, match="template must contain"):
        get_task("math_jsonl", path=str(math_file), template="no placeholder")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no problems"):
        get_task("math_jsonl", path=str(empty))


def test_field_names_of_other_data_sets(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "solution": "5", "answer": "ignored"}) + "\n")
    task = get_task("math_jsonl", path=str(path), prompt_key="question", answer_key="solution")
    assert task.problems[0].prompt.startswith("What is 2 + 3?\nPlease reason step by step")
    assert task.problems[0].answer == "5"


CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(chat_template=None, bos=None):
    """A local word-level tokenizer (no hub) with ChatML-style special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "What", "is", "2", "+", "?"]
    vocab = {w: i for i, w in enumerate([*words, "\n", " "])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"\n| "), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=bos)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = chat_template
    return tok, vocab


def test_chat_template_is_applied_when_the_tokenizer_has_one(tmp_path):
    from megatron_gspo.tasks.tokenizer import encode_prompt

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "What is 2 + 2 ?", "answer": "4"}) + "\n")
    task = get_task("math_jsonl", path=str(path), template="{problem}")
    assert task.chat_template is None  # default: follow the tokenizer
    tok, v = word_tokenizer(CHAT)
    ids = encode_prompt(tok, task.problems[0].prompt, add_bos=False, chat_template=task.chat_template)
    words = ["<|im_start|>", "user", "\n", "What", " ", "is", " ", "2", " ", "+", " ", "2", " ", "?"]
    words += ["<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"]
    assert ids == [v[w] for w in words]  # one user turn, then the assistant header to generate after
    # chat_template=false keeps the raw text; a tokenizer without a template gets the raw text too.
    raw = encode_prompt(tok, "What is 2 + 2 ?", add_bos=False, chat_template=False)
    assert tok.convert_ids_to_tokens(raw)[0] == "What" and v["<|im_start|>"] not in raw
    plain, _ = word_tokenizer(None)
    assert encode_prompt(plain, "What is 2 + 2 ?", add_bos=False) == raw
    with pytest.raises(ValueError, match="chat_template=true, but the tokenizer has no chat template"):
        encode_prompt(plain, "What is 2 ?", add_bos=False, chat_template=True)


def test_bos_with_a_chat_template_is_never_doubled():
    from megatron_gspo.tasks.tokenizer import encode_prompt

    tok, v = word_tokenizer(CHAT, bos="<s>")
    ids = encode_prompt(tok, "What is 2 ?", add_bos=True)
    assert ids[:2] == [v["<s>"], v["<|im_start|>"]]
    with_bos, _ = word_tokenizer("{{ bos_token }}" + CHAT, bos="<s>")
    ids = encode_prompt(with_bos, "What is 2 ?", add_bos=True)
    assert ids[:2] == [v["<s>"], v["<|im_start|>"]]  # the template's own BOS, not a second one
    nobos, _ = word_tokenizer(CHAT)
    with pytest.raises(ValueError, match="tokenizer has no BOS token; set task.add_bos=false"):
        encode_prompt(nobos, "What is 2 ?", add_bos=True)
