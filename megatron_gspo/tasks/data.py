"""Deterministic, checkpointable prompt batches for RL, and SFT batches for the cold start."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from megatron_gspo.tasks.base import Problem, Task


class PromptStream:
    """Training prompts in batches; batch `i` depends only on (`seed`, `i`), so resuming is exact.

    Each batch gets its own generator seeded from (`seed`, batch index) instead of one long-lived
    generator, so the checkpoint is three integers rather than a generator's internal state, and
    a resumed run draws exactly the prompts an uninterrupted run would have drawn.

    Args:
        task: the task whose training split is sampled.
        batch_size: prompts per batch (distinct prompts; group repetition is the caller's).
        seed: stream seed.
    """

    def __init__(self, task: Task, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.batches_drawn = 0

    def next_batch(self) -> list[Problem]:
        """The next `batch_size` training problems."""
        rng = np.random.default_rng([self.seed, self.batches_drawn])
        self.batches_drawn += 1
        return self.task.sample_prompts(self.batch_size, rng)

    def __iter__(self) -> Iterator[list[Problem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream plus what identifies it (checked on load)."""
        return {
            "task": self.task.name,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the task name and batch size must match this stream's."""
        expected = {"task": self.task.name, "batch_size": self.batch_size}
        for key, mine in expected.items():
            if state[key] != mine:
                raise ValueError(f"prompt stream state is for {key}={state[key]!r}, this stream has {mine!r}")
        self.seed, self.batches_drawn = int(state["seed"]), int(state["batches_drawn"])


def sft_batches(stream: PromptStream) -> Iterator[list[tuple[str, str]]]:
    """Endless cold-start SFT batches of (prompt, target) from `stream`'s training prompts.

    Targets come from `Task.sft_example` and carry no EOS; the caller appends it when tokenizing.
    Checkpoint `stream` to resume the SFT data exactly.
    """
    for problems in stream:
        yield [stream.task.sft_example(problem) for problem in problems]
