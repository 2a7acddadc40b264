"""Greedy decoding with the trainer's own Megatron policy (no rollout server, no KV cache).

Used where the rollout engine is not up yet (the cold start's accuracy checks). Each new
token costs one forward over the packed prompts + tokens so far: fine for the short answers
of the demo tasks, quadratic in the response length otherwise.

Collective: every rank calls it with its own prompts (data-parallel ranks hold different
ones, tensor-parallel peers the same ones). Shapes are padded to the largest over the ranks
that exchange MoE tokens (`uniform_shape`), and all ranks run the same number of forwards:
decoding stops when no rank has an unfinished prompt left (one all-reduce per token).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.model.distributed import all_reduce, compute_device
from megatron_gspo.model.logprobs import attention_inputs
from megatron_gspo.model.packing import pack_sequences, packing_layout, pad_to_shape, uniform_shape


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """[..., V/tp] vocab-parallel logits -> [..., V] (concatenated over the TP group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def _any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank of the default group (collective)."""
    value = torch.tensor([int(flag)], device=compute_device())
    all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_multiple: int = 1,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (collective, see the module docstring).

    Args:
        model: a megatron GPTModel (optionally DDP-wrapped), in eval or train mode.
        prompts: B prompts of token ids (B may be 0 on some ranks).
        max_new_tokens: most generated tokens per prompt.
        eos_token_id: ends a continuation (kept in it, as SGLang returns it).
        pad_multiple: row / sequence length multiple (the TP size under sequence parallelism).

    Returns:
        [B] generated token ids per prompt, at most `max_new_tokens` each.
    """
    from megatron_gspo.model.builder import unpadded_vocab_size

    device = compute_device()
    layout = packing_layout(model)
    vocab = unpadded_vocab_size(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    open_rows = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not _any_rank(bool(open_rows)):
            break
        # A rank with nothing left still joins the forward (MoE token exchange), on a dummy row.
        rows = open_rows or [None]
        sequences = [torch.tensor(prompts[i] + outputs[i] if i is not None else [eos_token_id]) for i in rows]
        packed = pack_sequences(sequences, layout=layout, pad_multiple=pad_multiple)
        packed = pad_to_shape(packed, *uniform_shape(packed))
        logits = model(
            packed.tokens.to(device),
            packed.position_ids.to(device),
            **attention_inputs(model, packed, device),
        )  # [R, L, V/tp]: with no labels GPTModel returns batch-first logits
        last = torch.tensor(
            [row * packed.tokens.shape[1] + start + n - 1 for row, start, n in packed.segments]
        )
        full = _full_vocab(logits.reshape(-1, logits.shape[-1])[last.to(device)])
        picked = full[:, :vocab].argmax(-1).tolist()  # megatron's TP padding is never picked
        if not open_rows:
            continue
        for i, token in zip(open_rows, picked):
            outputs[i].append(token)
        open_rows = [i for i in open_rows if outputs[i][-1] != eos_token_id]
    return outputs
