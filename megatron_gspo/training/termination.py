"""SIGTERM as an orderly exit that never cuts a weight-update protocol step in half.

`megatron-gspo train` turns SIGTERM into `SystemExit(143)` so the run unwinds like Ctrl-C (the
embedded rollout server is stopped, exported weights removed). Raised between announcing a
bucket (or a group join) to the servers and the trainer's matching broadcast (or join), that exit
would leave every server inside a receive holding its weight-update lock until its timeout
(600 s by default), and the unwinding trainer would wait on them: on the abort of the session,
and on the announce request still in flight when the client closes. Inside
`protocol_step()` the signal is held and acted on when the step has been issued.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

_held: list[int] = []
_depth = 0


def exit_on_sigterm() -> None:
    """Install the handler (main thread): SIGTERM exits with 128 + 15 once no protocol step is open."""
    signal.signal(signal.SIGTERM, _exit_or_hold)


def _exit_or_hold(signum: int, frame) -> None:
    if _depth:
        _held.append(signum)
        return
    sys.exit(128 + signum)


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
        if not _depth and _held:
            signum = _held.pop()
            _held.clear()
            sys.exit(128 + signum)
