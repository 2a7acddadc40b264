"""Global <-> shard helpers: stride-aware split/merge, expert renaming, TE spec names."""

import pytest
import torch

from megatron_gspo.model.sharding import (
    ShardingError,
    _merge,
    _split,
    canonical_name,
    gather_global_state_dict,
    load_global_state_dict,
    to_global_name,
)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_split_then_merge_is_identity(stride, dim):
    full = torch.arange(8 * 12).view(8, 12)
    shards = [_split(full, dim, stride, rank, 2) for rank in range(2)]
    assert torch.equal(_merge(shards, dim, stride), full)


def test_swiglu_fc1_shards_hold_gate_and_up_slices():
    gate, up = torch.arange(4)[:, None] * 1.0, 10 + torch.arange(4)[:, None] * 1.0
    fc1 = torch.cat([gate, up])  # [2I, 1] with I = 4
    assert _split(fc1, 0, 2, 0, 2).flatten().tolist() == [0, 1, 10, 11]
    assert _split(fc1, 0, 2, 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_expert_names_become_global():
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert to_global_name(name, ep_rank=2, num_local_experts=4).endswith("local_experts.11.linear_fc2.weight")
    assert to_global_name("decoder.final_layernorm.weight", 2, 4) == "decoder.final_layernorm.weight"


def test_transformer_engine_names_map_to_local_spec_names():
    assert canonical_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.0.input_layernorm.weight"
    )
    assert canonical_name("decoder.layers.5.mlp.experts.linear_fc1.weight12") == (
        "decoder.layers.5.mlp.experts.local_experts.12.linear_fc1.weight"
    )
    assert canonical_name("decoder.layers.0.self_attention.linear_qkv.weight") == (
        "decoder.layers.0.self_attention.linear_qkv.weight"
    )


def test_global_state_round_trip_and_named_errors(world_one_model):
    state = {k: v.clone() for k, v in gather_global_state_dict(world_one_model).items()}
    with torch.no_grad():  # what is loaded must come from `state`, not be left from before
        for param in world_one_model.parameters():
            param.zero_()
    load_global_state_dict(world_one_model, state)
    assert all(torch.equal(v, gather_global_state_dict(world_one_model)[k]) for k, v in state.items())
    assert all(v.abs().max() > 0 for k, v in state.items() if "layernorm" not in k)
    missing = dict(state)
    missing.pop("output_layer.weight")
    with pytest.raises(ShardingError, match="no tensor 'output_layer.weight'"):
        load_global_state_dict(world_one_model, missing)
    with pytest.raises(ShardingError, match="tensors the model lacks"):
        load_global_state_dict(world_one_model, {**state, "decoder.extra.weight": torch.zeros(1)})
    bad = {**state, "decoder.final_layernorm.weight": torch.zeros(3)}
    with pytest.raises(ShardingError, match="decoder.final_layernorm.weight: global shard shape"):
        load_global_state_dict(world_one_model, bad)
