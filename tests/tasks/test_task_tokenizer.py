import numpy as np
import pytest

from megatron_gspo.tasks import get_task
from megatron_gspo.tasks.tokenizer import ALPHABET, build_char_tokenizer, encode_strict

TOKENIZER = build_char_tokenizer()


def test_special_token_ids_are_fixed():
    assert (TOKENIZER.pad_token_id, TOKENIZER.bos_token_id, TOKENIZER.eos_token_id) == (0, 1, 2)
    assert len(TOKENIZER) == 3 + len(ALPHABET)


def test_every_alphabet_character_round_trips():
    ids = encode_strict(TOKENIZER, ALPHABET)
    assert ids == list(range(3, 3 + len(ALPHABET)))
    assert TOKENIZER.decode(ids) == ALPHABET


@pytest.mark.parametrize(
    "name, options", [("addition", {"max_digits": 9}), ("sort_digits", {"max_length": 12})]
)
def test_every_task_string_round_trips(name, options):
    task = get_task(name, **options)
    problems = task.sample_prompts(500, np.random.default_rng(0)) + task.heldout(50)
    for p in problems:
        for text in (p.prompt, p.answer, p.prompt + p.answer):
            ids = encode_strict(TOKENIZER, text)
            assert len(ids) == len(text) and TOKENIZER.decode(ids) == text


def test_eos_terminated_target_decodes_to_the_answer():
    ids = encode_strict(TOKENIZER, "42") + [TOKENIZER.eos_token_id, TOKENIZER.pad_token_id]
    assert TOKENIZER.decode(ids, skip_special_tokens=True) == "42"


@pytest.mark.parametrize(
    "text, bad", [("12+é=", "'é' at position 3"), ("1\n2", r"'\\n' at position 1"), ("<s>", "'<'")]
)
def test_unknown_character_raises_naming_it(text, bad):
    with pytest.raises(ValueError, match=bad):
        encode_strict(TOKENIZER, text)


def test_plain_encode_does_not_name_the_unknown_character():
    # The reason encode_strict exists: the WordLevel model's own error says nothing useful.
    with pytest.raises(Exception, match="Missing \\[UNK\\]"):
        TOKENIZER.encode("é", add_special_tokens=False)


def test_special_token_text_is_rejected_even_when_its_characters_are_in_the_alphabet():
    tokenizer = build_char_tokenizer(ALPHABET + "<>/")
    assert tokenizer.encode("<s>", add_special_tokens=False) == [tokenizer.bos_token_id]  # merged silently
    assert encode_strict(tokenizer, "<a>") == tokenizer.convert_tokens_to_ids(["<", "a", ">"])
    with pytest.raises(ValueError, match="one token per character"):
        encode_strict(tokenizer, "x</s>")


def test_encode_text_is_strict_for_the_char_tokenizer_and_plain_bpe_otherwise(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_gspo.tasks.tokenizer import encode_text, is_char_tokenizer

    char = build_char_tokenizer()
    char.save_pretrained(tmp_path / "char")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "char")
    assert is_char_tokenizer(char) and is_char_tokenizer(reloaded)
    assert encode_text(reloaded, "12+3=") == encode_strict(char, "12+3=")
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        encode_text(reloaded, "12+3=!")

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<eos>"])
    backend.train_from_iterator(["what is one plus one"] * 10, trainer)
    bpe = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    assert not is_char_tokenizer(bpe)
    ids = encode_text(bpe, "what is one")
    assert bpe.decode(ids).replace(" ", "") == "whatisone" and len(ids) < len("what is one")
    with pytest.raises(ValueError, match="unknown token"):
        encode_text(bpe, "what is zebra")
