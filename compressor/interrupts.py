"""SIGINT/SIGTERM handling for the ``kvq`` command.

The first signal raises :class:`Interrupted` (a ``KeyboardInterrupt``) so the running
command unwinds (temporary folders are removed, a resumable checkpoint is kept); later
signals are ignored while it unwinds, so clean-up is not cut short. Inside :func:`deferred`
(the renames that put a finished artifact in place, and the import of torch) a signal is
held and raised when the block ends, so the output path is never left half-replaced and no
exception is thrown into torch's C++ initialisation.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

_state: dict = {"defer": 0, "pending": None}
committed: list[str] = []  # outputs put in place by this process (for the interruption message)
kept: list[str] = []  # "after N of M layers; the finished layers are kept in PATH" (an interrupted run's staging)


class Interrupted(KeyboardInterrupt):
    """What a SIGINT or SIGTERM raises: caught by every ``except KeyboardInterrupt`` (click
    turns it into ``Abort``), but not *exactly* a ``KeyboardInterrupt``. CPython records an
    exact ``KeyboardInterrupt`` that leaves code run through ``PyRun_*`` (pybind11's
    ``py::exec``, which torch's import uses) as unhandled for good, and a ``python -m``
    process then kills itself with SIGINT at exit (status -2) whatever exit code kvq chose,
    although kvq had caught it; a subclass is not recorded."""


def _handler(signum, frame):
    if _state["pending"] is not None:  # already unwinding
        return
    _state["pending"] = signum
    if not _state["defer"]:
        raise Interrupted


def install() -> tuple:
    """Route SIGTERM, and SIGINT unless the parent ignored it (``&`` in a script), to the
    handler; returns the previous handlers for :func:`restore`."""
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    _state["pending"] = None
    committed.clear()
    kept.clear()
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
        raise Interrupted


def check() -> None:
    """Raise :class:`Interrupted` when a signal was received but its exception never reached
    the command. CPython drops an exception raised inside a ``__del__`` method or a weakref
    callback, and the handler can run there (garbage collection runs at any moment, most
    often early, while libraries load); the run would then go on to the end with later
    signals ignored. Called at safe points of ``kvq quantize``: before the first layer, after
    each layer, before the artifact is written. Outside :func:`install` nothing is pending."""
    if _state["pending"] is not None and not _state["defer"]:
        raise Interrupted


#: the commands that write an artifact (the others only read one)
WRITING = ("quantize", "sign")


def message(sig: int | None, argv) -> str:
    """The one line printed when ``kvq`` is stopped by Ctrl-C (``sig`` SIGINT or ``None``)
    or SIGTERM while running the command line ``argv``: whether an artifact was written,
    for the commands that write one; that the server stopped, for ``kvq serve``."""
    import signal

    word = "terminated" if sig == signal.SIGTERM else "interrupted"
    command = next((str(a) for a in argv if not str(a).startswith("-")), "")
    if command not in WRITING:
        return f"kvq: {word}; the server stopped" if command == "serve" else f"kvq: {word}"
    if committed:
        return (f"kvq: {word} after the artifact was written to {committed[-1]} (complete; "
                "the summary was not printed)")
    if kept:
        return f"kvq: {word} {kept[-1]}; no artifact was written: rerun the same command with --resume to continue"
    rank, size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if command == "quantize" and rank != "0" and size.isdigit() and int(size) > 1:  # torchrun: rank 0 keeps the layers
        return (f"kvq: rank {rank} of {size} {word}; no artifact was written: rank 0 keeps the finished layers "
                "(its line says whether --resume continues)")
    if command == "quantize":  # stopped before the first checkpoint: its staging folder is gone
        return (f"kvq: {word}; no artifact was written and no layer was finished "
                "(nothing to resume: rerun without --resume)")
    return f"kvq: {word}; no artifact was written"


def exit_interrupted(argv) -> None:
    """Print :func:`message` for the signal received while running ``argv`` to stderr and exit
    143 (SIGTERM) or 130 (SIGINT, or none recorded)."""
    import signal
    import sys

    sig = received()
    sys.stderr.write(message(sig, argv) + "\n")
    sys.exit(143 if sig == signal.SIGTERM else 130)
