"""Data as users have it: JSON lines, Parquet, `datasets` directories, GSM8K/MATH/verl fields, eval files,
and the start-up prompt check (encoding, length against task.options.max_prompt_len)."""

import json

import pytest

from megatron_gspo.config import ConfigError, build_task, load_config
from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.prompt_check import check_prompts
from megatron_gspo.tasks.tokenizer import build_char_tokenizer, resolve_add_bos

GSM8K = [
    {"question": f"Tom has {i} apples and buys {i + 2} more. How many apples?",
     "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}"}
    for i in range(100)
]  # fmt: skip
MATH = [
    {"problem": f"Simplify $\\frac{{{i}}}{{{2 * i}}}$.", "solution": "Divide: $\\boxed{\\frac{1}{2}}$.",
     "level": "Level 1"}
    for i in range(1, 31)
]  # fmt: skip
VERL = [
    {"prompt": [{"role": "system", "content": "Answer in a box."}, {"role": "user", "content": f"{i}+{i}?"}],
     "reward_model": {"ground_truth": str(2 * i), "style": "rule"}}
    for i in range(30)
]  # fmt: skip


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def files(tmp_path):
    from datasets import Dataset, DatasetDict

    out = {"gsm8k.jsonl": write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)}
    Dataset.from_list(MATH).to_parquet(str(tmp_path / "math.parquet"))
    out["math.parquet"] = str(tmp_path / "math.parquet")
    Dataset.from_list(VERL).save_to_disk(str(tmp_path / "verl"))
    out["verl"] = str(tmp_path / "verl")
    DatasetDict({"train": Dataset.from_list(GSM8K), "test": Dataset.from_list(GSM8K[:5])}).save_to_disk(
        str(tmp_path / "gsm8k_dict")
    )
    out["gsm8k_dict"] = str(tmp_path / "gsm8k_dict")
    return out


def test_gsm8k_jsonl_references_become_their_final_answers(files):
    task = get_task("math_jsonl", path=files["gsm8k.jsonl"], prompt_key="question", answer_key="answer")
    assert [p.answer for p in task.problems[:3]] == ["2", "4", "6"]
    assert task.problems[1].prompt.startswith("Tom has 1 apples and buys 3 more.")
    assert task.reward(task.problems[1], "1 + 3 = \\boxed{4}") == 1.0
    assert task.reward(task.problems[1], "so\n#### 4") == 1.0
    assert task.reward(task.problems[1], "\\boxed{5}") == 0.0
    assert not task.has_answer("four apples") and task.has_answer("\\boxed{4}")
    prompt, target = task.sft_example(task.problems[1])  # SFT teaches the form the reward reads
    assert target == "\\boxed{4}" and task.reward(task.problems[1], target) == 1.0


def test_math_parquet_solutions_give_their_boxed_answer(files):
    task = get_task("math_jsonl", path=files["math.parquet"], answer_key="solution")
    assert len(task.problems) == 30 and task.problems[0].answer == "\\frac{1}{2}"
    assert task.problems[0].metadata["line"] == 1
    assert task.reward(task.problems[0], "It is \\boxed{0.5}.") == 1.0


def test_verl_chat_message_prompts_from_a_saved_dataset(files):
    task = get_task(
        "math_jsonl", path=files["verl"], prompt_key="prompt", answer_key="reward_model.ground_truth"
    )
    problem = task.problems[3]
    assert problem.answer == "6"
    assert problem.metadata["messages"] == VERL[3]["prompt"]
    assert "Please reason" not in problem.prompt  # the data set brings its own instructions


def test_dataset_dict_needs_its_split_named(files):
    with pytest.raises(ValueError, match="holds several splits; name one: .*gsm8k_dict/train"):
        get_task("math_jsonl", path=files["gsm8k_dict"], prompt_key="question")
    task = get_task("math_jsonl", path=files["gsm8k_dict"] + "/test", prompt_key="question")
    assert len(task.problems) == 5


def test_unparseable_reference_is_refused_with_its_line(tmp_path):
    rows = [*GSM8K[:3], {"question": "q", "answer": "He has some apples, we do not know how many.\nSo many."}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"bad.jsonl line 4 \(task.options.answer_key='answer'\): .*no final answer"
    ):
        get_task("math_jsonl", path=path, prompt_key="question")
    path = write_jsonl(tmp_path / "bad2.jsonl", [{"problem": "p", "answer": "\\boxed{\\frac{1}{"}])
    with pytest.raises(ValueError, match="line 1 .*never closed"):
        get_task("math_jsonl", path=path)


def test_unknown_formats_and_missing_paths_name_the_key(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"task.options.path=.*data.csv: unknown data format '.csv'"):
        get_task("math_jsonl", path=str(tmp_path / "data.csv"))
    with pytest.raises(ValueError, match=r"task.options.path=.*nope.jsonl: no such file or directory"):
        get_task("math_jsonl", path=str(tmp_path / "nope.jsonl"))


def test_eval_path_replaces_the_hash_split(files, tmp_path):
    test_file = write_jsonl(tmp_path / "test.jsonl", GSM8K[:4])
    options = f"{{path: {files['gsm8k.jsonl']}, prompt_key: question}}"
    cfg = load_config(None, ["task.name=math_jsonl", f"task.options={options}", f"eval.path={test_file}"])
    task = build_task(cfg)
    assert [p.answer for p in task.heldout(10)] == ["2", "4", "6", "8"]  # the eval file's rows, in order
    assert not any(task.is_heldout(p) for p in task.problems)  # every training row is trained on
    hashed = build_task(load_config(None, ["task.name=math_jsonl", f"task.options={options}"]))
    assert any(hashed.is_heldout(p) for p in hashed.problems)
    cfg = load_config(None, [f"eval.path={test_file}"])
    with pytest.raises(ConfigError, match="eval.path is for tasks read from a file"):
        build_task(cfg)
    cfg = load_config(None, ["task.name=math_jsonl", f"task.options={options}", "eval.path=/nope.jsonl"])
    with pytest.raises(ConfigError, match="eval.path=/nope.jsonl: no such file"):
        build_task(cfg)


def test_prompt_lengths_are_checked_against_max_prompt_len(tmp_path):
    rows = [{"problem": "What is 2 + 3?" + " abc" * k, "answer": "5"} for k in range(10)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    tok = build_char_tokenizer()
    task = get_task("math_jsonl", path=path, template="{problem}", chat_template=False, max_prompt_len=30)
    # prompt k is 14 + 4k characters + BOS: rows k = 5..9 (35..51 tokens) exceed 30 + BOS by 4..20
    with pytest.raises(ValueError, match=(
        r"5 of 10 prompts are longer than task.options.max_prompt_len=30 tokens \+ BOS and would be cut, "
        r"by 4 to 20 tokens \(longest 51 tokens, the prompt of row 10\)"
    )):  # fmt: skip
        check_prompts(task, tok, add_bos=True)
    task.max_prompt_len = 50
    assert check_prompts(task, tok, add_bos=True) == {"prompts": 10, "longest": 51}
    rows.append({"problem": "What is 2 ^ 3?", "answer": "8"})  # '^' is not in the character alphabet
    task = get_task("math_jsonl", path=write_jsonl(tmp_path / "m.jsonl", rows), template="{problem}",
                    chat_template=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"the prompt of row 11: character '\^' at position 10"):
        check_prompts(task, tok, add_bos=True)
    # the SFT targets (\boxed{answer}) need a backslash the character alphabet lacks: RL alone
    # never encodes them, cold-start SFT would fail at its first step
    task = get_task("math_jsonl", path=write_jsonl(tmp_path / "t.jsonl", rows[:10]), template="{problem}",
                    chat_template=False)  # fmt: skip
    assert check_prompts(task, tok, add_bos=True)["prompts"] == 10
    with pytest.raises(ValueError, match=r"the SFT target of row 1: character '\\\\' at position 0"):
        check_prompts(task, tok, add_bos=True, sft=True)


def test_add_bos_follows_the_tokenizer_unless_set():
    from transformers import PreTrainedTokenizerFast

    char = build_char_tokenizer()
    assert resolve_add_bos(None, char) is True and resolve_add_bos(False, char) is False
    no_bos = PreTrainedTokenizerFast(tokenizer_object=char.backend_tokenizer, eos_token="</s>")
    assert no_bos.bos_token_id is None
    assert resolve_add_bos(None, no_bos) is False
    task = get_task("addition")
    with pytest.raises(ValueError, match="task.add_bos=true, but the tokenizer has no BOS token"):
        check_prompts(task, no_bos, add_bos=True)
