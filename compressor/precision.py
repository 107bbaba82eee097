"""Matmul precision of the calibration pass (``kvq quantize --matmul-precision``).

Calibration spends most of its time in the layers' forwards and in the Hessians ``XᵀX``:
float32 matmuls. A CPU with bfloat16 dot products (Intel AMX-BF16, Xeon 4th generation and
later; AVX512-BF16, e.g. AMD EPYC Zen 4) multiplies bfloat16 operands 2-3x faster than float32
ones. Under ``bfloat16`` (:func:`calibration_matmuls`):

* every ``nn.Linear`` forward on float32 CPU inputs of at least :data:`MIN_ROWS` rows casts its
  input and weight to bfloat16 and runs one bfloat16 matmul (float32 accumulation inside
  oneDNN), its output rounded to bfloat16 and returned in float32 with the bias added: what a
  bfloat16 model computes, the usual precision of GPTQ/AWQ calibration on a GPU;
* the remaining float32 matmuls of the pass (attention, AWQ's loss terms, the Hessians) run
  at oneDNN's bfloat16 setting (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``:
  inputs rounded to bfloat16, float32 accumulation and output) where oneDNN honours it (with
  AMX; torch 2.13's oneDNN keeps them IEEE on an AMD EPYC with AVX512-BF16 and no AMX).

The Hessians stay out of the explicit casts: ``XᵀX`` with its result rounded to bfloat16 (per
chunk of 1024 rows, summed in float64) made SmolLM2's Hessians indefinite in 4 of 30 layers
(GPTQ raised their damping), where rounding only the inputs keeps the product positive
semi-definite.

Explicit casts rather than the oneDNN setting alone, because the setting does nothing on
CPUs without AMX (BENCHMARKS.md, 2026-12-04: on this project's EPYC a ``[4096, 576] x
[576, 1536]`` linear takes 44.6 ms in float32 and 17.7 ms in bfloat16). GPTQ's solve (its
error feedback and range search) runs in float32 inside the pass (:func:`float32_matmuls`),
and ``kvq verify`` / ``kvq serve-smoke`` never change the setting. The two precisions give
different integer codes (GPTQ's integers follow every rounding upstream) of the same quality
within the noise (BENCHMARKS.md), so the manifest's provenance and the resume key record
which one ran.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from .errors import InputError

#: the choices of ``--matmul-precision``
CHOICES = ("auto", "float32", "bfloat16")
#: CPU flags (``/proc/cpuinfo``) that give bfloat16 matmuls in hardware
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def flags_have_bf16(cpuinfo: str) -> bool:
    """Whether the first ``flags`` line of ``cpuinfo`` (``/proc/cpuinfo``'s text) names one of
    :data:`BF16_CPU_FLAGS`."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return any(f in BF16_CPU_FLAGS for f in line.partition(":")[2].split())
    return False


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX-BF16 or AVX512-BF16, read from
    ``/proc/cpuinfo``) and torch has oneDNN; ``False`` where that cannot be read (not Linux)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return flags_have_bf16(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return False


def resolve_matmul_precision(choice: str, device: str) -> str:
    """``float32`` or ``bfloat16`` for ``choice`` (one of :data:`CHOICES`) on ``device``.

    ``auto`` is ``bfloat16`` on a CPU with hardware bfloat16 matmuls
    (:func:`cpu_has_bf16_matmul`), ``float32`` otherwise and on CUDA.

    Raises:
        InputError: an unknown choice, or ``bfloat16`` with ``device == "cuda"`` (the
            setting is oneDNN's, for the CPU; on CUDA the calibration runs in float32).
    """
    if choice not in CHOICES:
        raise InputError(f"unknown matmul precision {choice!r} (choose from {', '.join(CHOICES)})")
    if device.startswith("cuda"):
        if choice == "bfloat16":
            raise InputError("--matmul-precision bfloat16 is a CPU setting (oneDNN); with --device cuda "
                             "the calibration runs in float32: use --matmul-precision float32 or auto")
        return "float32"
    if choice == "auto":
        return "bfloat16" if cpu_has_bf16_matmul() else "float32"
    return choice


@contextlib.contextmanager
def _mkldnn_fp32_precision(value: str) -> Iterator[None]:
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    setting.fp32_precision = value
    try:
        yield
    finally:
        setting.fp32_precision = before


#: a linear's input needs at least this many rows for its bfloat16 cast (the weight's cast
#: is paid per call: a routed expert that got a handful of tokens stays float32)
MIN_ROWS = 64

_state = threading.local()
_patch_lock = threading.Lock()
_patch_depth = 0
_LINEAR_FORWARD = torch.nn.Linear.forward


def bf16_active() -> bool:
    """Whether this thread is inside ``calibration_matmuls("bfloat16")`` and outside
    :func:`float32_matmuls`."""
    return getattr(_state, "bf16", False)


def _linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` while a bfloat16 calibration pass is open in any thread: the
    bfloat16 product (module docstring) where this thread's pass is bfloat16 and the input
    qualifies, ``nn.Linear``'s own forward otherwise."""
    w = self.weight
    if (bf16_active() and input.dtype == torch.float32 and w.dtype == torch.float32 and input.device.type == "cpu"
            and input.numel() >= MIN_ROWS * max(input.shape[-1], 1)):
        out = F.linear(input.bfloat16(), w.bfloat16()).float()
        return out if self.bias is None else out.add_(self.bias)
    return _LINEAR_FORWARD(self, input)


@contextlib.contextmanager
def _bf16_flag(on: bool) -> Iterator[None]:
    global _patch_depth
    before = bf16_active()
    with _patch_lock:
        if on and _patch_depth == 0:
            torch.nn.Linear.forward = _linear_forward
        _patch_depth += on
    _state.bf16 = on
    try:
        yield
    finally:
        _state.bf16 = before
        with _patch_lock:
            _patch_depth -= on
            if on and _patch_depth == 0:
                torch.nn.Linear.forward = _LINEAR_FORWARD


@contextlib.contextmanager
def calibration_matmuls(precision: str) -> Iterator[None]:
    """Context in which the calibration pass's CPU matmuls run at ``precision`` (``float32``:
    IEEE, as by default; ``bfloat16``: the module docstring's two rules). Restores the
    previous state on exit, also on error. ``nn.Linear.forward`` is replaced while any thread
    is inside a bfloat16 pass; other threads' linears take no explicit cast, but oneDNN's
    setting is process-wide: where oneDNN honours it (AMX), their float32 matmuls run at it
    too while the pass is open (kvq's own other threads, hashing and file I/O, run none)."""
    bf16 = precision == "bfloat16"
    with _mkldnn_fp32_precision("bf16" if bf16 else "ieee"), _bf16_flag(bf16):
        yield


@contextlib.contextmanager
def float32_matmuls() -> Iterator[None]:
    """Context in which float32 CPU matmuls and linears are IEEE float32 whatever the caller
    set (GPTQ's solve: its error feedback must not be rounded to bfloat16)."""
    with _mkldnn_fp32_precision("ieee"), _bf16_flag(False):
        yield
