"""Uneven pipeline stages: `ParallelConfig.stage_layers` against megatron-core's own split.

The reference is megatron's `get_num_layers_to_build` / `get_transformer_layer_offset` on a
`TransformerConfig` of the same layout (both take the pipeline rank as an argument, so no
process group is needed); layouts megatron's config refuses must be refused by ours too, with
the `parallel.*` key named.
"""

import pytest

from megatron_gspo.model.distributed import ParallelConfig


def megatron_split(num_layers: int, parallel: ParallelConfig) -> list[tuple[int, int]]:
    """(offset, layers) of every stage by megatron-core; raises what its config raises."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        account_for_embedding_in_pipeline_split=parallel.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallel.account_for_loss_in_pipeline_split,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        pipeline_dtype=None if parallel.pipeline_parallel == 1 else __import__("torch").float32,
    )
    if parallel.virtual_pipeline:
        return [
            [
                (
                    get_transformer_layer_offset(config, vp_stage=c, pp_rank=r),
                    get_num_layers_to_build(config, vp_stage=c, pp_rank=r),
                )
                for c in range(parallel.virtual_pipeline)
            ]
            for r in range(parallel.pipeline_parallel)
        ]
    return [
        (get_transformer_layer_offset(config, pp_rank=r), get_num_layers_to_build(config, pp_rank=r))
        for r in range(parallel.pipeline_parallel)
    ]


def offsets(layers: list[int]) -> list[tuple[int, int]]:
    return [(sum(layers[:i]), n) for i, n in enumerate(layers)]


@pytest.mark.parametrize(
    "num_layers, keys, expected",
    [
        (6, dict(pipeline_parallel=3, first_stage_layers=1, last_stage_layers=3), [1, 2, 3]),
        (6, dict(pipeline_parallel=3, first_stage_layers=2), [2, 2, 2]),
        (7, dict(pipeline_parallel=3, last_stage_layers=1), [3, 3, 1]),
        (5, dict(pipeline_parallel=2, first_stage_layers=3), [3, 2]),
        (94, dict(pipeline_parallel=4, last_stage_layers=22), [24, 24, 24, 22]),
        (94, dict(pipeline_parallel=16, account_for_embedding_in_pipeline_split=True,
                  account_for_loss_in_pipeline_split=True), [5] + [6] * 14 + [5]),
        (5, dict(pipeline_parallel=2, account_for_loss_in_pipeline_split=True), [3, 2]),
        (4, dict(pipeline_parallel=2), [2, 2]),
    ],
)  # fmt: skip
def test_stage_layers_match_megatron(num_layers, keys, expected):
    parallel = ParallelConfig(**keys)
    assert parallel.stage_layers(num_layers) == expected
    assert megatron_split(num_layers, parallel) == offsets(expected)


@pytest.mark.parametrize(
    "num_layers, keys, named",
    [
        (6, dict(pipeline_parallel=3, first_stage_layers=1), "parallel.first_stage_layers=1 leaves 5"),
        (6, dict(pipeline_parallel=2, first_stage_layers=2, last_stage_layers=2), "leaves 2 of the 6"),
        (4, dict(pipeline_parallel=3, first_stage_layers=2, last_stage_layers=2), "leaves 0 of the 4"),
        (5, dict(pipeline_parallel=2), "does not divide the 5"),
        (94, dict(pipeline_parallel=16, account_for_loss_in_pipeline_split=True), "94 + 1 (loss)"),
        (6, dict(pipeline_parallel=2, first_stage_layers=0), "parallel.first_stage_layers must be >= 1"),
        (6, dict(pipeline_parallel=3, first_stage_layers=2, account_for_loss_in_pipeline_split=True),
         "exclusive"),
    ],
)  # fmt: skip
def test_layouts_megatron_refuses_are_refused_with_the_key_named(num_layers, keys, named):
    parallel = ParallelConfig(**keys)
    with pytest.raises(ValueError, match="parallel\\.") as ours:
        parallel.stage_layers(num_layers)
    assert named in str(ours.value) and "\n" not in str(ours.value)
    with pytest.raises((ValueError, AssertionError)):
        megatron_split(num_layers, parallel)


@pytest.mark.parametrize(
    "num_layers, keys, expected",
    [
        (4, dict(pipeline_parallel=2, virtual_pipeline=2), [[(0, 1), (2, 1)], [(1, 1), (3, 1)]]),
        (8, dict(pipeline_parallel=2, virtual_pipeline=2), [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]),
        (12, dict(pipeline_parallel=3, virtual_pipeline=2, first_stage_layers=2, last_stage_layers=2),
         [[(0, 1), (6, 1)], [(1, 4), (7, 4)], [(5, 1), (11, 1)]]),
        (94, dict(pipeline_parallel=4, virtual_pipeline=2, last_stage_layers=22),
         [[(0, 12), (47, 12)], [(12, 12), (59, 12)], [(24, 12), (71, 12)], [(36, 11), (83, 11)]]),
    ],
)  # fmt: skip
def test_virtual_pipeline_chunks_match_megatron(num_layers, keys, expected):
    parallel = ParallelConfig(**keys)
    assert parallel.chunk_layers(num_layers) == expected
    assert megatron_split(num_layers, parallel) == expected


@pytest.mark.parametrize(
    "num_layers, keys, named",
    [
        (6, dict(pipeline_parallel=2, virtual_pipeline=2), "virtual_pipeline=2 does not divide the 3 layers"),
        (6, dict(pipeline_parallel=3, virtual_pipeline=2, first_stage_layers=1, last_stage_layers=1),
         "does not divide the 1 layers of pipeline stage 0"),
    ],
)  # fmt: skip
def test_chunks_megatron_refuses_are_refused(num_layers, keys, named):
    parallel = ParallelConfig(**keys)
    with pytest.raises(ValueError, match="parallel.virtual_pipeline") as ours:
        parallel.chunk_layers(num_layers)
    assert named in str(ours.value)
    with pytest.raises((ValueError, AssertionError)):
        megatron_split(num_layers, parallel)


def test_virtual_pipeline_needs_a_pipeline():
    with pytest.raises(ValueError, match="parallel.virtual_pipeline=2 needs parallel.pipeline_parallel >= 2"):
        ParallelConfig(virtual_pipeline=2)


def test_uneven_keys_need_a_pipeline():
    with pytest.raises(ValueError, match="parallel.last_stage_layers set with parallel.pipeline_parallel=1"):
        ParallelConfig(last_stage_layers=2).stage_layers(4)
