"""A first real run on math data: a byte-level BPE tokenizer with a Qwen-style chat template (no BOS),
GSM8K- and MATH-shaped files, the real trainer through the CLI, samples.jsonl written.

A tiny random policy answers nothing right, so the reward plumbing is proven on its own: known
right (and wrong) completions are tokenized by the run's tokenizer and decoded and scored by the
rollout engine's own path (`RolloutEngine.completion_text` + `Task.reward`) against the real-shaped
references of both files.
"""

import json
import os
import subprocess

import pytest
import torch
from warm_python import python

from megatron_gspo.config import build_task, load_config
from megatron_gspo.model.config import tiny
from megatron_gspo.model.hf.checkpoint import make_tiny_hf_checkpoint
from megatron_gspo.rollout import RolloutSample
from megatron_gspo.training.metrics import read_metrics
from megatron_gspo.training.step.rollouts import RolloutEngine

QWEN_CHAT = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GSM8K = [
    {"question": f"Natalia sold clips to {i} friends in April, and then she sold half as many clips in May. "
     f"How many clips did Natalia sell altogether in April and May?",
     "answer": f"Natalia sold {2 * i}/2 = <<{2 * i}/2={i}>>{i} clips in May.\n"
     f"Natalia sold {2 * i}+{i} = <<{2 * i}+{i}={3 * i}>>{3 * i} clips altogether.\n#### {3 * i:,}"}
    for i in range(2, 60, 2)
]  # fmt: skip
MATH = [
    {"problem": f"If $x + {i} = {2 * i}$, what is $\\frac{{x}}{{{2 * i}}}$?",
     "solution": f"We have $x = {i}$, so $\\frac{{x}}{{{2 * i}}} = \\boxed{{\\frac{{1}}{{2}}}}$.",
     "level": "Level 2", "type": "Algebra"}
    for i in range(1, 40)
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def qwen_style_tokenizer():
    """Byte-level BPE trained here on the two files' text, Qwen's special tokens, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [r["question"] + r["answer"] for r in GSM8K] + [r["problem"] + r["solution"] for r in MATH]
    backend.train_from_iterator(corpus * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = QWEN_CHAT
    return tok


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("math_run")
    files = {}
    for name, rows in {"gsm8k_train": GSM8K[4:], "gsm8k_test": GSM8K[:4], "math_train": MATH}.items():
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = qwen_style_tokenizer()
    files["model"] = make_tiny_hf_checkpoint(root / "qwen_style", tiny(vocab_size=448), tok)
    return root, files


def task_overrides(files, kind):
    if kind == "gsm8k":
        options = (
            f"{{path: {files['gsm8k_train']}, prompt_key: question, answer_key: answer, max_prompt_len: 160}}"
        )
        return ["task.name=math_jsonl", f"task.options={options}", f"eval.path={files['gsm8k_test']}"]
    options = f"{{path: {files['math_train']}, answer_key: solution, max_prompt_len: 160}}"
    return ["task.name=math_jsonl", f"task.options={options}"]


def scored(engine, tokenizer, problem, completion):
    """The rollout engine's reward of `completion` given as the token ids the server would return."""
    ids = tokenizer(completion + "<|im_end|>", add_special_tokens=False)["input_ids"]
    prompt = engine.prompt_ids(problem)
    sample = RolloutSample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(ids),
        rollout_logprobs=torch.zeros(len(ids)),
        finish_reason="stop",
        weight_version="0",
    )
    return engine.task.reward(problem, engine.completion_text(sample))


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
def test_right_answers_earn_reward_through_the_rollout_path(data, kind):
    from transformers import AutoTokenizer

    _, files = data
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    assert tokenizer.bos_token_id is None and tokenizer.chat_template
    cfg = load_config(None, [f"model.hf_path={files['model']}", *task_overrides(files, kind)])
    task = build_task(cfg)
    engine = RolloutEngine(None, task, tokenizer, cfg.rollout, vocab_size=448, add_bos=False)
    problems = task.problems[:6] + task.heldout(2)
    prompt = tokenizer.decode(engine.prompt_ids(problems[0]))
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    for problem in problems:
        reference = problem.answer  # "#### 1,234"'s number or the solution's boxed fraction
        right = f"Let me think.\n#### {reference}" if kind == "gsm8k" else "So x/2x is $\\boxed{0.5}$."
        wrong = "The answer is \\boxed{7}." if reference != "7" else "\\boxed{8}"
        assert scored(engine, tokenizer, problem, right) == 1.0, (problem.answer, right)
        assert scored(engine, tokenizer, problem, f"\\boxed{{{reference}}}") == 1.0
        assert scored(engine, tokenizer, problem, wrong) == 0.0
        assert not task.has_answer("I do not know.") and task.has_answer(right)


def run_cli(files, run_dir, kind, *extra):
    cmd = [*python(), "-m", "megatron_gspo.cli", "train", f"model.hf_path={files['model']}",
           *task_overrides(files, kind), f"trainer.run_dir={run_dir}", "trainer.steps=2", "sft.steps=0",
           "rollout.rollout_batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
           "algorithm.num_mini_batches=1", "eval.num_problems=2", "eval.at_start=false",
           "logging.progress_bar=false", "logging.samples_per_step=3", "logging.zero_reward_warn_steps=2",
           *extra]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=500)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gsm8k", "math"])
def test_cli_run_on_math_data_writes_samples(data, tmp_path, kind):
    _, files = data
    run_dir = tmp_path / "run"
    done = run_cli(files, run_dir, kind)
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["rollout/no_answer_frac"] <= 1.0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert all(set(s) == {"step", "prompt", "answer", "completion", "reward"} for s in samples)
    assert all(s["reward"] in (0.0, 1.0) for s in samples)
    # The random policy answers nothing: zero reward, and the warning fires at step 2 (K = 2).
    assert all(r["rollout/reward_mean"] == 0.0 for r in records)
    assert "the rollout reward has been exactly 0 for 2 steps in a row" in done.stderr
    (tmp_path / "stderr.txt").write_text(done.stderr)
    assert "eval/accuracy" in records[-1]


@pytest.mark.slow
def test_prompt_longer_than_max_prompt_len_is_one_named_line(data, tmp_path):
    _, files = data
    done = run_cli(files, tmp_path / "run", "gsm8k", "task.options.max_prompt_len=40")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "prompts are longer than task.options.max_prompt_len=40 tokens and would be cut" in done.stderr
    done = run_cli(files, tmp_path / "run", "gsm8k", "task.add_bos=true")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "task.add_bos=true, but the tokenizer has no BOS token" in done.stderr


def test_chat_message_prompts_render_the_same_for_rollouts_and_sft(data, tmp_path):
    from transformers import AutoTokenizer

    from megatron_gspo.tasks import get_task
    from megatron_gspo.training.sft import sft_example_ids

    _, files = data
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    rows = [{"prompt": [{"role": "system", "content": "Put the answer in a box."},
                        {"role": "user", "content": r["question"]}],
             "reward_model": {"ground_truth": r["answer"]}} for r in GSM8K]  # fmt: skip
    path = tmp_path / "verl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("math_jsonl", path=str(path), prompt_key="prompt", answer_key="reward_model.ground_truth")
    cfg = load_config(None, [])
    engine = RolloutEngine(None, task, tokenizer, cfg.rollout, vocab_size=448, add_bos=False)
    problem = task.problems[0]
    prompt_ids = engine.prompt_ids(problem)
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nPut the answer in a box.<|im_end|>\n")
    tokens, mask = sft_example_ids(tokenizer, *task.sft_example(problem), add_bos=False)
    assert tokens[: len(prompt_ids)].tolist() == prompt_ids and not mask[: len(prompt_ids)].any()
    assert tokenizer.decode(tokens[mask]) == f"\\boxed{{{problem.answer}}}<|im_end|>"
