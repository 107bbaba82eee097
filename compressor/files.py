"""Reading the small files a user names (a recipe, ``config.json``, PEM keys and certificates,
a prompts file), bounded: what is not a file kvq can read to its end is refused in one line
before it is read, so no input can hang a command or grow its memory without bound.

A FIFO is opened without waiting for a writer; where pipes are read at all, the first bytes
must arrive within :data:`PIPE_WAIT_S` (a FIFO nobody writes to is refused, not waited on for
ever). At most ``limit + 1`` bytes are ever read, whatever ``stat`` said (``/dev/zero``, a file
that grows, a ``/proc`` file whose size reads 0).
"""

from __future__ import annotations

import os
import select
import stat
from pathlib import Path

from .errors import InputError

#: how long a pipe may stay silent before its first bytes (a writer that never comes)
PIPE_WAIT_S = 30


def file_kind(mode: int) -> str:
    """What a path whose ``st_mode`` is ``mode`` is, for messages: ``a folder``, ``a FIFO (named pipe)``, ``a device``..."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_limited(path: str | Path, what: str, limit: int, pipes: bool = False) -> bytes:
    """The bytes of the file ``path`` (``what`` names it in messages: ``recipe``), at most ``limit``.

    Args:
        path: the file (a symlink is followed: it is the user's own argument).
        what: what the file is, for the message (``recipe``, ``prompts file``).
        limit: the most bytes such a file may hold.
        pipes: also read a FIFO or a character device (``<(...)``, ``/dev/stdin``): up to
            ``limit`` bytes, to the writer's end; the first must come within :data:`PIPE_WAIT_S`.

    Returns:
        the file's bytes.

    Raises:
        InputError: missing, unreadable, a folder, a socket, a FIFO or device (unless
            ``pipes``; with it, one silent for :data:`PIPE_WAIT_S`), or more than ``limit``
            bytes (said before reading a regular file).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer opens at once
    except FileNotFoundError:
        raise InputError(f"{what} {path} not found") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a folder, not a file") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        regular = stat.S_ISREG(mode)
        if not regular and not (pipes and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode))):
            raise InputError(f"{what} {path} is {file_kind(mode)}, not a file kvq can read to its end")
        if regular and os.fstat(fd).st_size > limit:
            raise InputError(f"{what} {path} is {os.fstat(fd).st_size:,} bytes, above the {limit:,} a {what} may take")
        if not regular:  # a writer that has not come yet may still come, but not for ever
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(PIPE_WAIT_S * 1000):
                raise InputError(f"{what} {path} is {file_kind(mode)} that nothing was written to in {PIPE_WAIT_S} s")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise InputError(f"{what} {path} holds more than the {limit:,} bytes a {what} may take; not read further")
        return b"".join(chunks)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    finally:
        os.close(fd)
