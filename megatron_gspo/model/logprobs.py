"""Per-token log-probs and entropy of given token sequences, from vocab-parallel logits.

Glossary (shapes): a micro-batch of B variable-length samples (prompt + response token ids)
is *packed* (`model/packing.py`) into R rows of L positions; per-token values come back as
[B, T] (T = longest sample), aligned with the tokens:
`logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`, and `logprobs[b, 0] = 0` (nothing
predicts the first token).

Packing puts several samples in one forward so padding does not dominate compute: the
local spec gets rows and a block-diagonal causal mask built here, per forward, on the
compute device; TransformerEngine gets one THD row and `PackedSeqParams`. Either way
attention never crosses samples and RoPE sees positions relative to each sample, so the
result does not depend on the packing. Log-probs come from megatron's GPTModel `labels`
path, its loss swapped for `chunked_vocab_parallel_cross_entropy` (megatron's vocab-parallel
cross-entropy steps on token chunks, bit-identical): each TP rank keeps only its vocabulary
slice and, whatever the logits' dtype, no full-size fp32 copy of them exists, in the forward
or the backward. The temperature divides each chunk in fp32, as SGLang's sampler divides the
logits. Entropy (a metric, no gradient) is computed from the same logits in token chunks
inside a forward hook on the output layer.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_gspo.model.chunked_cross_entropy import (
    chunked_vocab_parallel_cross_entropy,
    chunked_vocab_parallel_entropy,
)
from megatron_gspo.model.context_parallel import context_parallel_state, gather_positions, partition_index
from megatron_gspo.model.distributed import compute_device, unwrap_model
from megatron_gspo.model.packing import (
    PackedBatch,
    PackingError,
    block_causal_mask,
    pack_sequences,
    packing_layout,
    pad_to_shape,
    padding_mask,
    thd_params,
    uniform_shape,
    unpack,
)


@contextlib.contextmanager
def _logprob_loss(model: torch.nn.Module, temperature: float, want_entropy: bool, found: dict):
    """GPTModel's `labels` loss becomes the chunked -log softmax(logits / T); the entropy is measured.

    The loss is swapped on the instance for the duration of one forward (megatron calls
    `self.compute_language_model_loss(labels, logits)` with labels [b, s], logits [s, b, V/tp]).
    """
    from megatron_gspo.model.builder import unpadded_vocab_size

    module = unwrap_model(model)
    vocab = unpadded_vocab_size(module)  # megatron's TP padding never enters a softmax

    def loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        target = labels.transpose(0, 1)
        per_token = chunked_vocab_parallel_cross_entropy(
            logits, target, temperature=temperature, vocab_size=vocab
        )
        return per_token.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as megatron's

    def hook(module, inputs, output):
        if want_entropy:
            found["entropy"] = chunked_vocab_parallel_entropy(
                output[0], temperature=temperature, vocab_size=vocab
            )  # [S, R]

    handle = module.output_layer.register_forward_hook(hook)
    module.compute_language_model_loss = loss
    try:
        yield
    finally:
        del module.compute_language_model_loss
        handle.remove()


def attention_inputs(model: torch.nn.Module, packed: PackedBatch, device: torch.device) -> dict:
    """The keyword arguments that keep `packed`'s samples apart in `model`'s attention.

    Raises:
        PackingError: a "mask" batch for a model whose attention ignores the mask (TE).
    """
    if packing_layout(model) == "mask":
        return {"attention_mask": block_causal_mask(packed, device)}
    if packed.layout == "mask":
        raise PackingError(
            "a 'mask' packed batch for a model whose attention ignores attention_mask "
            "(TransformerEngine): samples would attend to each other; pack with layout='thd'"
        )
    return {"attention_mask": None, "packed_seq_params": thd_params(packed, device)}


def is_last_stage(model: torch.nn.Module) -> bool:
    """Whether `model` is the pipeline stage that holds the output layer (always, without PP).

    Under a virtual pipeline the output layer is in the stage's last chunk.
    """
    from megatron_gspo.model.chunks import model_chunks

    return bool(model_chunks(unwrap_model(model))[-1].post_process)


def stage_forward(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run this pipeline stage on a packed batch; returns (its output, entropy or None).

    On the last stage (the only one without pipeline parallelism) the output is the [R, L]
    negative log-prob of `packed.labels` (keeps the autograd graph) and the entropy is [R, L]
    when asked for; earlier stages return their hidden states ([L, R, H], the input of the
    next stage, which megatron's schedule hands over with `set_input_tensor`) and no entropy.
    A "mask" batch gets its block-diagonal mask built here. A "thd" batch gets
    `PackedSeqParams` when the model's attention takes them (TE); megatron's local attention
    refuses them, and there (CPU) the THD row runs with the equivalent block-diagonal mask of
    its sequences instead: the same input row, padding and token order, only the attention
    kernel differs. Every stage gets megatron's `padding_mask` (`packing.padding_mask`), so
    padded positions never enter the routers' statistics (aux loss, expert-bias counts).

    Args:
        model: a megatron GPTModel stage (optionally wrapped by megatron DDP).
        packed: from `pack_sequences` (its layout must suit the model, see `packing_layout`).
        temperature: logits are divided by it first (match the rollout engine's sampling
            temperature, as SGLang's returned log-probs are log_softmax(logits / T)).
        with_entropy: also compute the entropy of every position's distribution (last stage).

    Under context parallelism (THD only, no pipeline stages) the model sees this CP rank's
    positions (`context_parallel.partition_index`; `PackedSeqParams` keep the whole row's
    offsets, as TransformerEngine's CP attention expects) and the [R, L / CP] outputs are
    gathered back into the row (differentiable), so callers see [R, L] as without CP.

    Raises:
        PackingError: a "mask" batch for a model whose attention ignores the mask (TE), or a
            "mask" batch under context parallelism.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    device = compute_device()
    kwargs = attention_inputs(model, packed, device)
    last = is_last_stage(model)
    found: dict = {}
    hook = _logprob_loss(model, temperature, with_entropy, found) if last else contextlib.nullcontext()
    inputs = (packed.tokens, packed.position_ids, packed.labels, padding_mask(packed))
    cp_size, cp_rank, cp_group = context_parallel_state()
    if cp_size > 1:
        if packed.layout != "thd":
            raise PackingError("context parallelism needs THD packing (the TransformerEngine spec)")
        cu_padded = packed.cu_seqlens_padded()
        index = partition_index(cu_padded, cp_size, cp_rank)
        inputs = tuple(t.index_select(1, index.to(t.device)) for t in inputs)
    tokens, position_ids, labels, padding = (t.to(device) for t in inputs)
    kwargs["padding_mask"] = _stage_padding(model, padding)
    with hook:
        output = model(tokens, position_ids, labels=labels, **kwargs)
    entropy = found["entropy"].transpose(0, 1) if last and with_entropy else None
    if cp_size > 1:
        output = gather_positions(output, cu_padded, index, cp_group)
        entropy = None if entropy is None else gather_positions(entropy, cu_padded, index, cp_group)
    return output, entropy


def _stage_padding(model: torch.nn.Module, padding: torch.Tensor) -> torch.Tensor:
    """The `padding_mask` this stage's GPTModel takes: [R, L] on the first, SP-sliced after it.

    Megatron keeps padding out of the routers' statistics (aux loss, expert bias) with it, but
    only the stage with the embedding splits it for sequence parallelism; a later stage's
    hidden states hold this TP rank's L / TP positions, so it gets that slice (as the
    embedding's scatter takes it).
    """
    module = unwrap_model(model)
    if module.pre_process or not module.config.sequence_parallel:
        return padding
    from megatron.core import parallel_state as ps

    per_rank = padding.shape[1] // ps.get_tensor_model_parallel_world_size()
    first = ps.get_tensor_model_parallel_rank() * per_rank
    return padding[:, first : first + per_rank]


def packed_forward(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the whole policy on a packed batch; returns per-position (log-prob of the next token, entropy).

    Both are [R, L] on the compute device; the log-prob at (r, t) is that of
    `packed.labels[r, t]` (keeps the autograd graph), meaningful only where that label exists.
    Arguments as `stage_forward`; the model must hold every layer (no pipeline parallelism:
    `model/pipeline.py` runs the stages of a pipeline).
    """
    from megatron_gspo.model.chunks import model_chunks

    if not (model_chunks(unwrap_model(model))[0].pre_process and is_last_stage(model)):
        raise ValueError(
            "packed_forward needs the whole model on this rank; under pipeline parallelism run the "
            "stages through model.pipeline.run_micro_batches"
        )
    neg_logprobs, entropy = stage_forward(model, packed, temperature=temperature, with_entropy=with_entropy)
    return -neg_logprobs, entropy


def sequence_logprobs(
    model: torch.nn.Module,
    sequences: list[torch.Tensor] | list[list[int]],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    row_len: int | None = None,
    pad_multiple: int = 1,
    layout: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of B samples, [B, T], aligned with their tokens.

    `logprobs[b, t]` is the log-prob of token t given tokens < t; column 0 and padding are 0.
    Collective over the ranks exchanging MoE tokens (`uniform_shape`).

    Args:
        model: a megatron GPTModel (optionally DDP-wrapped).
        sequences: B samples of token ids.
        temperature: sampling temperature the logits are divided by.
        with_entropy: also return the per-token entropy.
        row_len: mask layout only: row capacity.
        pad_multiple: row length (mask) or per-sequence (thd) multiple; TP size under SP.
        layout: "mask" or "thd"; default `packing_layout(model)`.
    """
    layout = layout or packing_layout(model)
    packed = pack_sequences(sequences, layout=layout, row_len=row_len, pad_multiple=pad_multiple)
    packed = pad_to_shape(packed, *uniform_shape(packed))
    logprobs, entropy = packed_forward(model, packed, temperature=temperature, with_entropy=with_entropy)
    return unpack(logprobs, packed), None if entropy is None else unpack(entropy, packed)
