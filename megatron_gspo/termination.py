"""SIGTERM as an orderly exit that is never lost and never cuts a weight-update step in half.

`megatron-gspo train` turns SIGTERM into `SystemExit(143)` so the run unwinds like Ctrl-C (the
embedded rollout server is stopped, exported weights removed). Two ways that went wrong:

- Python runs a signal handler in the main thread at whatever bytecode it is at, and an
  exception raised inside an at-fork hook, a `__del__` or a gc callback is printed ("Exception
  ignored in ...") and dropped: a SIGTERM landing in logging's at-fork hook while a checkpoint
  save forked its writers was lost, and the run trained on. The signal is therefore also
  recorded, and `exit_if_terminated()` (every step) raises the exit a dropped one would have.
- Raised between announcing a bucket (or a group join) to the servers and the trainer's matching
  broadcast (or join), the exit left every server inside a receive holding its weight-update
  lock until its timeout (600 s by default), and the unwinding trainer waited on them. Inside
  `protocol_step()` the signal is held and acted on once the step has been issued.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

_received: list[int] = []
_depth = 0


def exit_on_sigterm() -> None:
    """Install the handler (main thread): SIGTERM exits with 128 + 15 once no protocol step is open."""
    signal.signal(signal.SIGTERM, _exit_or_hold)


def _exit_or_hold(signum: int, frame) -> None:
    _received.append(signum)
    if not _depth:
        sys.exit(128 + signum)


def exit_if_terminated() -> None:
    """Raise the exit of a SIGTERM received earlier (its own may have been dropped where it landed)."""
    if _received and not _depth:
        sys.exit(128 + _received[0])


@contextlib.contextmanager
def protocol_step() -> Iterator[None]:
    """A step the servers must see whole (announce + broadcast, request + join): SIGTERM waits.

    Signal handlers run in the main thread only, so elsewhere this is a no-op.
    """
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        exit_if_terminated()
