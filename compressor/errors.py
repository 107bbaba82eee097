"""The small, documented exception set of kvq.

Every error a user can cause maps to one of these; the CLI prints ``str(err)`` on one
line and exits with ``err.exit_code``:

* :class:`InputError` (exit 2) -- bad usage or bad input (missing model, bad header,
  group size that does not fit, output folder that exists, ...).
* :class:`CheckFailed` (exit 1) -- a verification check failed (hash mismatch, gate).
* :class:`QuantizationError` (exit 1) -- a numerical fault during quantization
  (non-finite scales, a module that produced NaN); nothing is written.
"""

from __future__ import annotations


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
