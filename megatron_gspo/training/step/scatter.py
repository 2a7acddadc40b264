"""Moving a step's rollout rows from rank 0 to the data-parallel ranks that train on them.

Rank 0 alone holds the `RolloutBatch`. Each data-parallel rank trains on its own rows only
(`split_batch`), so rank 0 sends each one exactly those rows, unpadded, as one flat byte buffer:

    lengths int64 [N, 2] (prompt, response) | advantages f32 [N] | rollout_logprobs f32 [sum R]
    | tokens int32 [sum (P + R)] | routed_experts [sum (P + R - 1), layers, k] (only when asked)

(fields ordered by item size, so every field starts aligned for its dtype). `response_mask`
is not sent: it is 1 exactly on `tokens[b, P_b : P_b + R_b]` and is rebuilt from the lengths.
The rows arrive in training order; the header says how many rows each micro-batch takes.

Transport, in two hops that mirror megatron's own data path:

1. rank 0 scatters the buffers over its data-parallel group (one rank per dp rank: those with
   tensor/pipeline rank 0), each padded to the largest buffer (the scatter needs equal sizes);
2. each of those ranks broadcasts its buffer over its model-parallel group (TP x PP peers,
   which share its dp rank and so its rows).

Both hops run on the compute backend (NCCL on GPUs, buffers on `compute_device()`): the payload
is megabytes to gigabytes and belongs on NVLink / InfiniBand, not on a CPU socket. The
per-rank headers (row and token counts, a few ints each) and any error on rank 0 travel over
the gloo control plane first, so every rank knows the buffer size before the data moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.model.control_plane import broadcast_from_rank0, call_on_rank0
from megatron_gspo.rollout import RolloutBatch
from megatron_gspo.training.step.micro_batches import DataLayout, flatten, split_batch


@dataclass
class RankRows:
    """The rollout rows one data-parallel rank trains on (N rows, S its longest sample).

    Host-side tensors feed packing and routing index maps; per-token training data lives on
    the compute device, where the loss uses it.

    Attributes:
        tokens: [N, S] int64 on the CPU, prompt + response, right-padded with 0.
        prompt_lengths: [N] int64 on the CPU.
        response_lengths: [N] int64 on the CPU.
        response_mask: [N, S] float32 on the compute device, 1.0 on response tokens.
        rollout_logprobs: [N, S] float32 on the compute device, token-aligned, 0.0 off the response.
        advantages: [N] float32 on the compute device.
        routed_experts: per row `[P + R - 1, layers, k]` on the CPU, or None when not needed.
        micro_batch_sizes: per mini-batch, how many rows each of its micro-batches takes (the
            rows are in training order: micro-batch after micro-batch).
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    routed_experts: list[torch.Tensor] | None
    micro_batch_sizes: list[list[int]]

    @property
    def num_rows(self) -> int:
        """N."""
        return int(self.tokens.shape[0])

    @classmethod
    def from_batch(
        cls,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        rows: list[int],
        *,
        routed_experts: bool,
        device: torch.device | str = "cpu",
        micro_batch_sizes: list[list[int]] | None = None,
    ) -> RankRows:
        """Rows `rows` of a batch held locally (a world of one, tests): what a scatter delivers.

        `micro_batch_sizes` defaults to one micro-batch of all the rows.
        """
        sizes = [[len(rows)]] if micro_batch_sizes is None else micro_batch_sizes
        header, buffer = encode_rows(
            batch, advantages, rows, routed_experts=routed_experts, micro_batch_sizes=sizes
        )
        return decode_rows(header, buffer.to(device))


@dataclass(frozen=True)
class RowsHeader:
    """What a receiver needs to size and cut its buffer (travels on the control plane).

    Attributes:
        rows: N.
        tokens: sum of P + R over the rows.
        response_tokens: sum of R.
        routes: (layers, k, dtype) of the routed experts sent, or None.
        micro_batch_sizes: per mini-batch, how many rows each of its micro-batches takes.
    """

    rows: int
    tokens: int
    response_tokens: int
    routes: tuple[int, int, torch.dtype] | None
    micro_batch_sizes: tuple[tuple[int, ...], ...]

    def fields(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each field, in buffer order."""
        out = [
            ("lengths", torch.int64, (self.rows, 2)),
            ("advantages", torch.float32, (self.rows,)),
            ("rollout_logprobs", torch.float32, (self.response_tokens,)),
            ("tokens", torch.int32, (self.tokens,)),
        ]
        if self.routes is not None:
            layers, k, dtype = self.routes
            out.append(("routed_experts", dtype, (self.tokens - self.rows, layers, k)))
        return sorted(out, key=lambda f: -f[1].itemsize)  # stable: aligned offsets for every field

    @property
    def nbytes(self) -> int:
        """Size of the buffer."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.fields())


def encode_rows(
    batch: RolloutBatch,
    advantages: torch.Tensor,
    rows: list[int],
    *,
    routed_experts: bool,
    micro_batch_sizes: list[list[int]],
) -> tuple[RowsHeader, torch.Tensor]:
    """One rank's rows, in training order, as (header, flat uint8 buffer on the CPU)."""
    idx = torch.tensor(rows, dtype=torch.long)
    prompt, response = batch.prompt_lengths[idx], batch.response_lengths[idx]
    positions = torch.arange(batch.tokens.shape[1])
    in_sample = positions < (prompt + response).unsqueeze(1)  # [N, S]
    values = {
        "lengths": torch.stack([prompt, response], dim=1),
        "advantages": advantages[idx].float(),
        "rollout_logprobs": batch.rollout_logprobs[idx][batch.response_mask[idx].bool()],
        "tokens": batch.tokens[idx][in_sample].to(torch.int32),
    }
    routes = None
    if routed_experts and batch.routed_experts is not None:
        chosen = [batch.routed_experts[i] for i in rows]
        values["routed_experts"] = torch.cat(chosen)
        routes = (int(chosen[0].shape[1]), int(chosen[0].shape[2]), chosen[0].dtype)
    sizes = tuple(tuple(mini) for mini in micro_batch_sizes)
    if sum(map(sum, sizes)) != len(rows):
        raise ValueError(f"rank rows: micro-batches of {sizes} rows do not cover the {len(rows)} rows")
    header = RowsHeader(len(rows), int(in_sample.sum()), int(response.sum()), routes, sizes)
    parts = []
    for name, dtype, shape in header.fields():
        value = values[name]
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise ValueError(
                f"rank rows: {name} is {value.dtype} {tuple(value.shape)}, expected {dtype} {shape}"
            )
        parts.append(value.contiguous().view(-1).view(torch.uint8))
    return header, torch.cat(parts)


def decode_rows(header: RowsHeader, buffer: torch.Tensor) -> RankRows:
    """Rebuild a rank's rows from its buffer ([>= nbytes] uint8 on the compute device)."""
    device = buffer.device
    values, offset = {}, 0
    for name, dtype, shape in header.fields():
        size = math.prod(shape) * dtype.itemsize
        values[name] = buffer[offset : offset + size].view(dtype).view(shape)
        offset += size
    host = {k: values[k].cpu() for k in ("lengths", "tokens")}  # packing is host-side index work
    prompt, response = host["lengths"][:, 0].contiguous(), host["lengths"][:, 1].contiguous()
    ends = prompt + response
    width = int(ends.max()) if header.rows else 0
    positions = torch.arange(width)
    in_sample = positions < ends.unsqueeze(1)
    tokens = torch.zeros(header.rows, width, dtype=torch.int64)
    tokens[in_sample] = host["tokens"].to(torch.int64)
    on_response = (in_sample & (positions >= prompt.unsqueeze(1))).to(device)
    logprobs = torch.zeros(header.rows, width, dtype=torch.float32, device=device)
    logprobs[on_response] = values["rollout_logprobs"]
    routes = None
    if header.routes is not None:
        routes = list(values["routed_experts"].cpu().split((ends - 1).tolist()))
    return RankRows(
        tokens=tokens,
        prompt_lengths=prompt,
        response_lengths=response,
        response_mask=on_response.float(),
        rollout_logprobs=logprobs,
        advantages=values["advantages"].clone(),
        routed_experts=routes,
        micro_batch_sizes=[list(mini) for mini in header.micro_batch_sizes],
    )


def scatter_rank_rows(
    batch: RolloutBatch | None,
    advantages: torch.Tensor | None,
    *,
    num_mini_batches: int,
    layout: DataLayout,
    routed_experts: bool,
    device: torch.device,
) -> RankRows:
    """This rank's rows of rank 0's batch (collective over all ranks; see the module docstring).

    Args:
        batch: the step's batch on global rank 0 (ignored elsewhere).
        advantages: [B] on global rank 0, computed over the whole batch (ignored elsewhere).
        num_mini_batches: optimizer steps of the step.
        layout: this rank's place and the micro-batch rule (with the mini-batches, decides
            which rows each rank takes and how it cuts them: `split_batch`).
        routed_experts: send the rollout engine's routing when the rollouts carry it (R3
            targets, inference->training drift); otherwise it stays on rank 0.
        device: the compute device; the buffers cross the wire there.

    Raises:
        Whatever rank 0 raised while cutting the rows, on every rank.
    """
    from megatron.core import parallel_state as ps

    def encode_all() -> list[tuple[RowsHeader, torch.Tensor]]:
        lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
        out = []
        for split in split_batch(lengths, num_mini_batches, layout):
            rows, sizes = flatten(split)
            out.append(
                encode_rows(batch, advantages, rows, routed_experts=routed_experts, micro_batch_sizes=sizes)
            )
        return out

    encoded = call_on_rank0(encode_all)
    headers = broadcast_from_rank0(
        encoded if isinstance(encoded, BaseException | None) else [h for h, _ in encoded]
    )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decode_rows(headers[0], encoded[0][1].to(device))
    size = max(h.nbytes for h in headers)
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    model_parallel = ps.get_model_parallel_group()
    if ps.get_context_parallel_world_size() > 1:  # CP peers train on the same rows (no PP with CP)
        model_parallel = ps.get_tensor_and_context_parallel_group()
    if dist.get_rank(model_parallel) == 0:  # tensor/pipeline (/context) rank 0: in rank 0's dp group
        chunks = None
        if dist.get_rank() == 0:
            chunks = [torch.nn.functional.pad(b, (0, size - b.numel())).to(device) for _, b in encoded]
        dist.scatter(buffer, chunks, src=0, group=ps.get_data_parallel_group())
    if dist.get_world_size(model_parallel) > 1:
        dist.broadcast(buffer, src=dist.get_global_rank(model_parallel, 0), group=model_parallel)
    return decode_rows(headers[layout.dp_rank], buffer)
