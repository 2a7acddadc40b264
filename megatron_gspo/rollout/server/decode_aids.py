"""The embedded server's test aids: decode pacing that lets a test land a weight sync mid-generation.

Not SGLang's, and off unless set (`serve --decode-delay-ms`, `--hold-decode-after-responses`;
docs/sglang-conformance.md): the engine has none then, and its serving path counts nothing for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class DecodeAids:
    """What the engine does at each decode step boundary (lock held) and at each batch's end."""

    delay_s: float = 0.0
    """`--decode-delay-ms`: each decode step waits this long first, so a generation is still
    running when a test's weight sync lands."""
    hold_after_responses: int = 0
    """`--hold-decode-after-responses N`: once N responses have ended (not aborted) under the weights
    served, a batch decodes one token, then waits (lock held) for a pause or its rows' abort. A sync
    that pauses first lands mid-response; one that does not would wait forever."""
    _ended_under: dict[str, int] = field(default_factory=dict)  # weight version -> responses ended

    @classmethod
    def from_flags(cls, delay_s: float, hold_after_responses: int) -> DecodeAids | None:
        """The aids the flags ask for; None (no aid on the serving path) when neither is set."""
        if delay_s <= 0 and hold_after_responses <= 0:
            return None
        return cls(delay_s, hold_after_responses)

    def batch_holds(self, weight_version: str) -> bool:
        """Whether a batch starting now holds after its first token."""
        return 0 < self.hold_after_responses <= self._ended_under.get(weight_version, 0)

    def at_step(self, hold: bool, released: Callable[[], bool]) -> None:
        """The delay, then, while `hold`, a wait until `released()` (a pause, or every row aborted)."""
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        while hold and not released():
            time.sleep(0.01)

    def batch_ended(self, weight_version: str, responses: int) -> None:
        """Count `responses` that ended (not aborted) under `weight_version`."""
        self._ended_under[weight_version] = self._ended_under.get(weight_version, 0) + responses
