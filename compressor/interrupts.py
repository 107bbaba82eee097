"""SIGINT/SIGTERM handling for the ``kvq`` command.

The first signal raises ``KeyboardInterrupt`` so the running command unwinds (temporary
folders are removed, a resumable checkpoint is kept); later signals are ignored while it
unwinds, so clean-up is not cut short. Inside :func:`deferred` (the renames that put a
finished artifact in place) a signal is held and raised when the block ends, so the output
path is never left half-replaced.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

_state: dict = {"defer": 0, "pending": None}
committed: list[str] = []  # outputs put in place by this process (for the interruption message)


def _handler(signum, frame):
    if _state["pending"] is not None:  # already unwinding
        return
    _state["pending"] = signum
    if not _state["defer"]:
        raise KeyboardInterrupt


def install() -> tuple:
    """Route SIGTERM, and SIGINT unless the parent ignored it (``&`` in a script), to the
    handler; returns the previous handlers for :func:`restore`."""
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    _state["pending"] = None
    committed.clear()
    signal.signal(signal.SIGTERM, _handler)
    if previous[1] is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)
    return previous


def restore(previous: tuple) -> None:
    """Put the handlers :func:`install` replaced back and forget any signal received."""
    signal.signal(signal.SIGTERM, previous[0])
    signal.signal(signal.SIGINT, previous[1])
    _state["pending"] = None


def received() -> int | None:
    """The first signal received, or None."""
    return _state["pending"]


@contextmanager
def deferred():
    """Hold SIGINT/SIGTERM for the duration of the block; raise ``KeyboardInterrupt`` after
    it (only if the block completed) when one arrived meanwhile."""
    _state["defer"] += 1
    try:
        yield
    finally:
        _state["defer"] -= 1
    if not _state["defer"] and _state["pending"] is not None:
        raise KeyboardInterrupt
