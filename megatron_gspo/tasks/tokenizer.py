"""Character-level tokenizer for the CPU demo tasks, built with `tokenizers`.

Saved and loaded like any HF tokenizer (`PreTrainedTokenizerFast`), so the embedded
rollout server, the trainer and HF `AutoTokenizer` all read the same files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
# Every character the demo tasks print: digits, arithmetic, list syntax, letters, space.
ALPHABET = "0123456789+-*=()[],.:?# abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` after the special tokens <pad>=0, <s>=1, </s>=2."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def encode_strict(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of `text`, one per character, failing loudly instead of dropping or merging anything.

    The WordLevel model without an unknown token raises only "Missing [UNK] token" on a foreign
    character, and the fast tokenizer matches special-token strings such as "<s>" inside plain
    text; both would corrupt a prompt silently or opaquely, so both are rejected here by name.

    Args:
        tokenizer: a tokenizer from `build_char_tokenizer`.
        text: task text (prompt or answer), without special tokens.

    Returns:
        [len(text)] token ids.

    Raises:
        ValueError: a character outside the vocabulary, or text that does not map one id per
            character (e.g. it contains a special-token string).
    """
    vocab = tokenizer.get_vocab()
    for position, char in enumerate(text):
        if char not in vocab:
            raise ValueError(
                f"character {char!r} at position {position} of {text!r} is not in the tokenizer's alphabet"
            )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.convert_ids_to_tokens(ids) != list(text):
        raise ValueError(f"{text!r} does not encode to one token per character (special-token text?): {ids}")
    return ids


def is_char_tokenizer(tokenizer) -> bool:
    """Whether `tokenizer` is (a saved copy of) the one `build_char_tokenizer` makes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "WordLevel":
        return False
    vocab = tokenizer.get_vocab()  # a new dict per call: read it once, not once per special token
    return all(token in vocab for token in SPECIAL_TOKENS)


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of task text: per character for the demo tokenizer, the tokenizer's own BPE otherwise.

    Special tokens are never added here; with a BPE tokenizer (real checkpoints) an unknown
    token in the result is an error rather than a silent `<unk>`.
    """
    if is_char_tokenizer(tokenizer):
        return encode_strict(tokenizer, text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        raise ValueError(f"{text[:80]!r} encodes to the unknown token {unk} at position {ids.index(unk)}")
    if not ids:
        raise ValueError("empty text encodes to no tokens")
    return ids


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` carries a chat template (HF `tokenizer.chat_template`)."""
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_add_bos(add_bos: bool | None, tokenizer) -> bool:
    """`task.add_bos`, or when unset whether the tokenizer has a BOS token (Qwen's have none)."""
    return getattr(tokenizer, "bos_token_id", None) is not None if add_bos is None else add_bos


def problem_prompt_ids(tokenizer, problem, *, add_bos: bool, chat_template: bool | None = None) -> list[int]:
    """`encode_prompt` of a `Problem`: its chat messages when the data set gave some, else its text."""
    prompt = problem.metadata.get("messages") or problem.prompt
    return encode_prompt(tokenizer, prompt, add_bos=add_bos, chat_template=chat_template)


def encode_prompt(
    tokenizer, prompt: str | Sequence[Mapping[str, str]], *, add_bos: bool, chat_template: bool | None = None
) -> list[int]:
    """Token ids of a prompt as the policy sees it: raw text, or one user turn of the chat template.

    With the chat template, the rendered text (ending in the assistant header, as for
    generation) already holds the model's special tokens; `add_bos` then adds BOS only when the
    template did not put it first, so it is never doubled.

    Args:
        tokenizer: the run's tokenizer.
        prompt: the task's prompt text, or a whole conversation ([{"role", "content"}], e.g. a
            system turn first, as DAPO/verl data sets give it), which needs the chat template.
        add_bos: start with the tokenizer's BOS token (`task.add_bos`).
        chat_template: apply the chat template; None: when the tokenizer has one.

    Returns:
        [P] token ids.

    Raises:
        ValueError: `chat_template=True` for a tokenizer without one, `add_bos` for a tokenizer
            without a BOS token, or text the tokenizer cannot encode.
    """
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    if use_template and not has_chat_template(tokenizer):
        raise ValueError("task.options.chat_template=true, but the tokenizer has no chat template")
    messages = None if isinstance(prompt, str) else list(prompt)
    if messages is not None and not use_template:
        raise ValueError(
            "the data set's prompts are chat messages, which need the tokenizer's chat template "
            "(the tokenizer has none, or task.options.chat_template=false)"
        )
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is None:
        raise ValueError(
            "task.add_bos=true, but the tokenizer has no BOS token; set task.add_bos=false or leave it unset"
        )
    if use_template:
        turns = messages if messages is not None else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = encode_text(tokenizer, text)
        return [bos] + ids if add_bos and ids[0] != bos else ids
    return ([bos] if add_bos else []) + encode_text(tokenizer, prompt)
