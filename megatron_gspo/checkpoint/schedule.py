"""Which steps the trainer checkpoints, and which of those checkpoints are reshardable.

Routine checkpoints (every `trainer.save_every` steps and at the end) keep the distributed
optimizer's state as each rank holds it and resume only at the same layout; reshardable ones
(every `trainer.reshardable_every` steps, and at the end with `trainer.reshardable_at_end`)
resume at any layout but gather the optimizer state into host memory while saving.
"""

from __future__ import annotations


def checkpoint_due(step: int, *, last: bool, trainer) -> tuple[bool, bool]:
    """(save now, reshardable) after `step` completed steps.

    Args:
        step: steps completed.
        last: whether `step` is the run's last.
        trainer: the run's `TrainerConfig`.
    """
    reshardable = (last and trainer.reshardable_at_end) or bool(
        trainer.reshardable_every and step % trainer.reshardable_every == 0
    )
    routine = last or bool(trainer.save_every and step % trainer.save_every == 0)
    return routine or reshardable, reshardable
