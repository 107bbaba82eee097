"""The small, documented exception set of kvq.

Every error a user can cause maps to one of these; the CLI prints ``str(err)`` on one
line and exits with ``err.exit_code``:

* :class:`InputError` (exit 2) -- bad usage or bad input (missing model, bad header,
  group size that does not fit, output folder that exists, ...).
* :class:`CheckFailed` (exit 1) -- a verification check failed (hash mismatch, gate).
* :class:`QuantizationError` (exit 1) -- a numerical fault during quantization
  (non-finite scales, a module that produced NaN); nothing is written.

A resource that runs out while kvq works (disk full, a disk quota, the file-size limit, memory
or address space) is told by :func:`resource_problem` from whatever the failing library raised
(an ``OSError``, safetensors' Rust ``os error N``, torch's allocator); the CLI then prints one
line naming it and exits 2, as it does for a request the plan refuses before any work.
"""

from __future__ import annotations

import errno
import re


class KvqError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class InputError(KvqError):
    """Usage or input error (exit code 2)."""

    exit_code = 2


class CheckFailed(KvqError):
    """A verification check failed (exit code 1)."""

    exit_code = 1


class QuantizationError(KvqError):
    """A numerical fault while quantizing (exit code 1); names the module at fault."""

    exit_code = 1


#: errno -> what ran out, as :func:`resource_problem` says it
_RAN_OUT = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
            errno.EFBIG: "a file would exceed the file-size limit (ulimit -f) or the file system's largest file",
            errno.ENOMEM: "out of memory"}
#: how the libraries kvq calls say it without an OSError (safetensors' Rust errors, torch's allocator)
_SAID = (("No space left on device", errno.ENOSPC), ("Disk quota exceeded", errno.EDQUOT),
         ("File too large", errno.EFBIG), ("Cannot allocate memory", errno.ENOMEM),
         ("can't allocate memory", errno.ENOMEM), ("not enough memory", errno.ENOMEM),
         ("out of memory", errno.ENOMEM))


def resource_problem(e: BaseException) -> str | None:
    """What ran out, when ``e`` says a resource did (``no space left on the device (writing
    /x/model.safetensors)``), else ``None``: a ``MemoryError``, an ``OSError`` with ``ENOSPC``,
    ``EDQUOT``, ``EFBIG`` or ``ENOMEM``, or another library's error carrying one of them
    (safetensors' ``os error 28``, torch's ``can't allocate memory``, ``unable to mmap``)."""
    if isinstance(e, MemoryError):
        return "out of memory"
    if isinstance(e, OSError) and e.errno in _RAN_OUT:
        return _RAN_OUT[e.errno] + (f" (at {e.filename})" if e.filename else "")
    text = str(e)
    m = re.search(r"os error (\d+)", text)
    if m and int(m.group(1)) in _RAN_OUT:
        return _RAN_OUT[int(m.group(1))]
    return next((_RAN_OUT[code] for said, code in _SAID if said in text), None)


def first_line(e: Exception) -> str:
    """The first line of ``e``'s message (its type's name when it has none); a first line that
    ends in a colon (``Validation error for field 'x':``) is joined with the line that follows."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
