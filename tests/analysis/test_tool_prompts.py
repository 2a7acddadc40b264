"""Prompts of the `drift` / `mismatch` tools: task options, a run's config, JSON-lines files, the
chat template and BOS, each encoding checked against ids looked up by hand in the vocabulary."""

import argparse
import json
import subprocess

import pytest
from warm_python import python

from megatron_gspo.analysis.drift_cli import add_drift_args
from megatron_gspo.analysis.tool_prompts import prompt_source
from megatron_gspo.config import ConfigError
from megatron_gspo.tasks.tokenizer import build_char_tokenizer

TEMPLATE = (
    "{% for m in messages %}U:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
)


def tokenizer(chat: bool):
    tok = build_char_tokenizer()
    if chat:
        tok.chat_template = TEMPLATE
    return tok


def by_hand(tok, text: str, bos: bool = True) -> list[int]:
    vocab = tok.get_vocab()
    return ([vocab["<s>"]] if bos else []) + [vocab[c] for c in text]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_drift_args(parser)
    return parser.parse_args(["--a", "A", "--out", "O", *argv])


@pytest.fixture
def gsm8k(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"What is {a}+{a + 1}?", "answer": f"{a} and {a + 1} #### {2 * a + 1}"}
        for a in range(60)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, {r["question"] for r in rows}


def test_task_options_go_through_the_chat_template(gsm8k):
    path, questions = gsm8k
    args = parse(
        "--task",
        "math_jsonl",
        "--task-option",
        f"path={path}",
        "--task-option",
        "prompt_key=question",
        "--task-option",
        "template=Q {problem}",
        "--num-prompts",
        "3",
    )
    tok = tokenizer(chat=True)
    encoded = prompt_source(args).encode(tok)
    assert len(encoded) == 3
    for ids in encoded:
        text = tok.decode(ids[1:])
        assert text.startswith("U:Q ") and text.endswith(" A:") and text[4:-3] in questions
        assert ids == by_hand(tok, text)  # BOS once, then the rendered template


def test_a_runs_config_gives_the_task_and_add_bos(gsm8k, tmp_path):
    path, questions = gsm8k
    config = tmp_path / "config.yaml"
    config.write_text(
        f"task:\n  name: math_jsonl\n  add_bos: false\n  options: {{path: {path}, prompt_key: question, "
        "template: '{problem}', chat_template: false}\n"
    )
    tok = tokenizer(chat=True)
    encoded = prompt_source(parse("--config", str(config), "--num-prompts", "2")).encode(tok)
    assert len(encoded) == 2 and all(tok.decode(ids) in questions for ids in encoded)  # no BOS, no template
    assert encoded[0] == by_hand(tok, tok.decode(encoded[0]), bos=False)


def test_a_run_with_an_eval_file_gives_its_prompts_not_its_training_rows(gsm8k, tmp_path, capsys):
    """With eval.path the run trained on every training row: a hash split of them is not held out."""
    path, questions = gsm8k
    held = tmp_path / "test.jsonl"
    held.write_text(
        "".join(json.dumps({"question": f"held out {i}?", "answer": "1"}) + "\n" for i in range(3))
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        f"task:\n  name: math_jsonl\n  add_bos: false\n  options: {{path: {path}, prompt_key: question, "
        f"template: '{{problem}}', chat_template: false}}\neval:\n  path: {held}\n"
    )
    tok = tokenizer(chat=True)
    encoded = prompt_source(parse("--config", str(config), "--num-prompts", "2")).encode(tok)
    assert [tok.decode(ids) for ids in encoded] == ["held out 0?", "held out 1?"]
    assert f"prompts: 2 from eval.path {held}" in capsys.readouterr().err


def test_prompt_file_rows(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        "1+2=",
        [{"role": "user", "content": "3+4="}],
        [1, 7, 8],
        {"input_ids": [1, 9]},
        {"question": "5+6="},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tokenizer(chat=True)
    encoded = prompt_source(parse("--prompts", str(path), "--prompt-key", "question")).encode(tok)
    assert encoded == [
        by_hand(tok, "U:1+2= A:"),
        by_hand(tok, "U:3+4= A:"),
        [1, 7, 8],
        [1, 9],
        by_hand(tok, "U:5+6= A:"),
    ]
    text = tmp_path / "prompts.txt"  # any other suffix: plain text lines, no chat template here
    text.write_text("1+2=\n\n7+8=\n")
    assert prompt_source(parse("--prompts", str(text))).encode(tokenizer(chat=False)) == [
        by_hand(tok, "1+2="),
        by_hand(tok, "7+8="),
    ]


def test_bad_prompt_options_are_named(tmp_path):
    cases = [
        (("--task", "math_jsonl"), "--task math_jsonl: .*'path'.*pass them as --task-option KEY=VALUE"),
        (("--task-option", "novalue"), "--task-option 'novalue': expected KEY=VALUE"),
        (("--task", "nope"), "--task: unknown task 'nope'; available: "),
        (("--num-prompts", "0"), "--num-prompts must be >= 1"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1+1="}\n')
    cases.append(
        (("--prompts", str(bad)), r"bad.jsonl line 1 has neither input_ids nor 'prompt'.*\['text'\]")
    )
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            prompt_source(parse(*argv))


@pytest.mark.slow  # two exports and two models: ~20 s alone, ~75 s on a shared 2-core box
def test_drift_cli_on_a_run_dir_with_task_options(short_run, gsm8k, tmp_path):
    path, _ = gsm8k
    out = tmp_path / "drift"
    cmd = [*python(), "-m", "megatron_gspo.cli", "drift", "--a", str(short_run)]
    cmd += ["--b", str(short_run / "checkpoints" / "step_00000002"), "--task", "math_jsonl"]
    cmd += ["--task-option", f"path={path}", "--task-option", "prompt_key=question"]
    cmd += [
        "--task-option",
        "template={problem}",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "using its newest intact checkpoint" not in done.stderr  # the documented choice: INFO
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["drift_per_layer"]) == 2 and 0 <= summary["drift_mean"] <= 1
