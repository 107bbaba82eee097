"""Matmul precision of the calibration pass (``kvq quantize --matmul-precision``).

Calibration spends most of its time in the layers' forwards and in the Hessians ``XᵀX``:
float32 matmuls. On a CPU with bfloat16 matrix units (Intel AMX-BF16, Xeon 4th
generation and later; AVX512-BF16 dot products on others) oneDNN can run a float32
matmul with its inputs rounded to bfloat16 and the products accumulated in float32
(torch's ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``). On this project's
Xeon a SmolLM2 decoder layer's forward over 8 x 512 tokens takes 74 ms that way against
121 ms in float32, and a ``[8192, 1536]`` ``XᵀX`` 34 ms against 98 ms (BENCHMARKS.md).

Only the calibration pass runs so (:func:`calibration_matmuls`: layer forwards, Hessians,
AWQ's scale search, KV observers, the recompute of the next layer's inputs). GPTQ's solve
(its error feedback and range search) runs in float32 inside it (:func:`float32_matmuls`),
and ``kvq verify`` / ``kvq serve-smoke`` never change the setting. The two precisions give
different integer codes (GPTQ's integers follow every rounding upstream: 15-24 % of them
moved in SmolLM2 runs) of the same quality within the noise, so the manifest's provenance
and the resume key record which one ran.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Iterator

import torch

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
    ``/proc/cpuinfo``), torch has oneDNN, and oneDNN honours the setting (:func:`bf16_setting_takes_effect`);
    ``False`` where that cannot be read (not Linux)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        flagged = flags_have_bf16(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return False
    return flagged and bf16_setting_takes_effect()


def bf16_setting_takes_effect() -> bool:
    """Whether a float32 matmul under the bfloat16 setting is the product of bfloat16-rounded
    inputs here (a ``[64, 256] x [256, 96]`` probe, well under a millisecond). On an AMD EPYC
    with AVX512-BF16 and no AMX, torch 2.13's oneDNN keeps float32 matmuls IEEE whatever the
    setting (every shape tried, up to ``[2048, 576] x [576, 1536]``): ``auto`` must then mean
    float32, or the manifest would record a precision that did not run."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(256, 96, generator=g)
    with _mkldnn_fp32_precision("ieee"):
        exact = (x @ w).double()
    with _mkldnn_fp32_precision("bf16"):
        fast = (x @ w).double()
    rounded = x.bfloat16().double() @ w.bfloat16().double()
    return bool((fast - rounded).abs().max() < (fast - exact).abs().max())


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


def calibration_matmuls(precision: str):
    """Context in which float32 CPU matmuls run at ``precision`` (``float32``: IEEE, as by
    default; ``bfloat16``: inputs rounded to bfloat16, float32 accumulation). Restores the
    previous setting on exit."""
    return _mkldnn_fp32_precision("bf16" if precision == "bfloat16" else "ieee")


def float32_matmuls():
    """Context in which float32 CPU matmuls are IEEE float32 whatever the caller set (GPTQ's
    solve: its error feedback must not be rounded to bfloat16)."""
    return _mkldnn_fp32_precision("ieee")
