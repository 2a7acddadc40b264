"""Context-parallel slicing against a plain reading of megatron's load-balanced split."""

import pytest
import torch
from forked_torchrun import torchrun

from megatron_gspo.model.context_parallel import ContextParallelError, partition_index, restore_order
from megatron_gspo.model.packing import pack_sequences


def reference_positions(lengths: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Sequence after sequence: cut into 2·CP equal chunks, take chunk r then chunk 2·CP-1-r."""
    out, start = [], 0
    for n in lengths:
        chunk = n // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            for i in range(chunk):
                out.append(start + c * chunk + i)
        start += n
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_partition_index_matches_the_published_chunk_assignment(cp_size):
    lengths = [8 * cp_size, 2 * cp_size, 6 * cp_size, 2 * cp_size]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for rank in range(cp_size):
        assert partition_index(cu, cp_size, rank).tolist() == reference_positions(lengths, cp_size, rank)


def test_cp2_of_one_sequence_by_hand():
    """8 positions, CP=2: chunks of 2; rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2."""
    cu = torch.tensor([0, 8])
    assert partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7]
    assert partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp_size,tp", [(2, 1), (2, 2), (4, 1)])
def test_every_per_token_tensor_round_trips(cp_size, tp):
    """THD rows padded to 2 x CP x TP: slices of tokens, labels and routes restore the row."""
    torch.manual_seed(0)
    seqs = [torch.randint(1, 50, (n,)) for n in (5, 13, 1, 9)]
    packed = pack_sequences(seqs, layout="thd", pad_multiple=2 * cp_size * tp)
    cu = packed.cu_seqlens_padded()
    routes = torch.randint(0, 8, (packed.tokens.shape[1], 3, 2))  # [L, layers, k], router order
    logprobs = torch.randn(1, packed.tokens.shape[1])
    indices = [partition_index(cu, cp_size, r) for r in range(cp_size)]
    assert sorted(torch.cat(indices).tolist()) == list(range(packed.tokens.shape[1]))  # a partition
    assert {len(i) for i in indices} == {packed.tokens.shape[1] // cp_size}  # balanced
    for full, dim in ((packed.tokens, 1), (packed.labels, 1), (logprobs, 1), (routes, 0)):
        parts = [full.index_select(dim, i) for i in indices]
        assert torch.equal(restore_order(parts, cu, dim=dim), full)


def test_a_sequence_not_padded_to_2cp_is_refused_by_name():
    cu = torch.tensor([0, 6, 12])
    with pytest.raises(ContextParallelError, match="does not split into 2 x context_parallel = 4 chunks"):
        partition_index(cu, 2, 0)


def test_the_local_spec_refuses_context_parallelism_by_name():
    """CPU builds the local spec, whose attention cannot see other CP ranks' keys and values."""
    from megatron_gspo.model.builder import build_model
    from megatron_gspo.model.config import tiny
    from megatron_gspo.model.distributed import ParallelConfig

    with pytest.raises(ValueError, match="parallel.context_parallel=2 needs the TransformerEngine spec"):
        build_model(tiny(), ParallelConfig(context_parallel=2))


@pytest.mark.parametrize("cp_size,tp", [(2, 1), (2, 2), (3, 1)])
def test_r3_routes_follow_the_model_inputs_cut(cp_size, tp):
    """Each CP (and SP) rank's replay targets are the rollout routes at its own positions, in its order."""
    from megatron_gspo.model.routing import routing_from_rollout, routing_token_mask

    torch.manual_seed(1)
    experts, layers, k = 8, 3, 2
    seqs = [torch.randint(1, 50, (n,)) for n in (7, 12, 3)]
    routes = [torch.randint(0, experts, (len(s) - 1, layers, k), dtype=torch.uint8) for s in seqs]
    packed = pack_sequences(seqs, layout="thd", pad_multiple=2 * cp_size * tp)
    whole = routing_from_rollout(packed, routes, num_experts=experts)  # one rank: the row in order
    whole_mask = routing_token_mask(packed)
    padded = packed.cu_seqlens_padded().diff().tolist()
    sp = {"tp_size": tp, "sequence_parallel": tp > 1}
    for cp_rank in range(cp_size):
        mine = reference_positions(padded, cp_size, cp_rank)
        per = len(mine) // tp
        for tp_rank in range(tp):
            positions = mine[tp_rank * per : (tp_rank + 1) * per]
            cut = {"cp_size": cp_size, "cp_rank": cp_rank, "tp_rank": tp_rank, **sp}
            local = routing_from_rollout(packed, routes, num_experts=experts, **cut)
            assert all(torch.equal(a, b[positions]) for a, b in zip(local.layers, whole.layers, strict=True))
            assert torch.equal(routing_token_mask(packed, **cut), whole_mask[positions])


@pytest.mark.multiprocess
def test_gathered_log_probs_restore_the_row_and_send_back_each_ranks_own_gradient(tmp_path):
    import json
    import os
    import subprocess
    from pathlib import Path

    worker = Path(__file__).with_name("cp_gather_worker.py")
    cmd = [*torchrun(2, worker), f"--result={tmp_path}"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["cp"] for r in results] == [[2, 0], [2, 1]]
    for r in results:
        assert r["row_restored"] and r["own_gradient"]
        assert r["local_positions"] * 2 == r["row_positions"] == 8 + 12 + 4
