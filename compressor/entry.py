"""The ``kvq`` console entry point: kvq's SIGINT/SIGTERM handler is in place before the CLI is imported.

Importing :mod:`compressor.cli` (click, rich, pydantic) takes about half a second; a Ctrl-C
in that window used to reach Python's default handler and print a traceback. Here the
handler (:mod:`compressor.interrupts`, standard library only) is installed first, so a
signal during the import ends in the same one line and exit code (130 for SIGINT, 143 for
SIGTERM) as one during the command.
"""

from __future__ import annotations

import os
import sys

#: PyTorch's CPU allocator reads this once, at its first allocation: tensors of 2 MiB and more
#: are then 2 MiB-aligned and advised as transparent huge pages (``madvise``, where the kernel
#: offers them). kvq's calibration passes allocate and free tens of MB per forward; with 4 KiB
#: pages each new allocation faulted in page by page (14.4 M minor faults, 23 s of system time
#: in a 76 s AWQ run on SmolLM2); see BENCHMARKS.md. A value the user set is kept.
ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def allocator_defaults(environ=os.environ) -> dict:
    """Set :data:`ALLOCATOR_ENV` in ``environ`` where the user has not; returns what was set.

    Takes effect only before torch's first allocation (the ``kvq`` console script and
    ``python -m compressor`` call it before importing torch)."""
    added = {k: v for k, v in ALLOCATOR_ENV.items() if k not in environ}
    environ.update(added)
    return added


#: Under torchrun (``WORLD_SIZE`` above 1), torch's C++ log from errors up: a store or gloo
#: connection whose peer died logs a warning with a 20-frame C++ stack on stderr before it
#: raises, where kvq says in one line which rank was lost (:mod:`compressor.distributed`). Read
#: when torch loads; a value the user set is kept.
RANKS_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def ranks_defaults(environ=os.environ) -> dict:
    """Set :data:`RANKS_ENV` in ``environ`` where the user has not, under several ranks only;
    returns what was set."""
    if environ.get("WORLD_SIZE", "1") in ("", "0", "1"):
        return {}
    added = {k: v for k, v in RANKS_ENV.items() if k not in environ}
    environ.update(added)
    return added


#: glibc malloc settings (``mallopt`` parameter number, value), applied by :func:`malloc_defaults`.
#: By default glibc serves blocks above a moving threshold (128 KiB at first) with their own
#: ``mmap`` and hands the heap's free top back to the system past 2x that threshold, so the
#: calibration pass's per-forward temporaries (MBs to tens of MBs, freed and allocated again
#: for every layer and batch) were faulted in page by page again and again: GPTQ W4 on
#: SmolLM2, 32 x 512, 1.07 M minor faults and 19.1 s of system time in a 52.3 s run; with these
#: settings 0.72 M, 8.7 s and 41.3 s, the same artifact bytes, peak RSS +46 MiB (BENCHMARKS.md).
#: kvq's own heap trims between layers (:func:`compressor.source.lazy.trim_heap`) still bound
#: the memory of large models.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20),  # M_MMAP_THRESHOLD: glibc's largest (64-bit)
                   "MALLOC_TRIM_THRESHOLD_": (-1, (1 << 31) - 1),  # M_TRIM_THRESHOLD: an int's largest
                   "MALLOC_TOP_PAD_": (-2, 256 << 20)}  # M_TOP_PAD: the heap grows in 256 MiB steps


def malloc_defaults(environ=os.environ) -> dict:
    """Apply :data:`MALLOC_SETTINGS` with glibc's ``mallopt``, each unless the user set its
    ``MALLOC_*_`` environment variable (glibc read that one at start-up); returns the
    settings applied (``{}`` where the C library is not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator as it is
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return {name: value for name, (param, value) in MALLOC_SETTINGS.items()
            if name not in environ and mallopt(param, value) == 1}


def main(argv=None) -> None:
    """Install the signal handlers, import the CLI, run it (:func:`compressor.cli.main`).

    Exits 130 (SIGINT) or 143 (SIGTERM) with one line on stderr when a signal arrives while
    the CLI is being imported; otherwise the CLI's own exit codes."""
    from . import interrupts

    allocator_defaults()
    ranks_defaults()
    malloc_defaults()
    previous = interrupts.install()
    try:
        try:
            from .cli import main as cli_main
        except KeyboardInterrupt:
            interrupts.exit_interrupted(argv if argv is not None else sys.argv[1:])
        cli_main(argv)
    finally:
        interrupts.restore(previous)
