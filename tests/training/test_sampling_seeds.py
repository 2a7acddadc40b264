"""A step's sampling seeds: reproducible, row r's independent of how many rows the step has."""

from megatron_gspo.training.step.rollouts import sampling_seeds


def test_seeds_depend_only_on_run_seed_step_and_row():
    seeds = sampling_seeds(7, 3, 128)
    assert seeds == sampling_seeds(7, 3, 128)  # an exact resume re-draws the same rollouts
    assert sampling_seeds(7, 3, 5) == seeds[:5]  # a smaller batch keeps its rows' seeds
    assert len(set(seeds)) == 128 and all(0 <= s < 2**62 for s in seeds)
    others = set(sampling_seeds(7, 4, 128)) | set(sampling_seeds(8, 3, 128))
    assert not others & set(seeds)
