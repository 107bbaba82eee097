"""MXFP4 weights (OCP Microscaling Formats spec v1.0: FP4 e2m1 elements, one shared E8M0 scale per 32
contiguous values, no global scale).

The numerics follow compressed-tensors 0.20 (``quantization/utils/mxfp_utils.py`` ``generate_mx_scales`` /
``round_to_power_2``, ``quantization/utils/helpers.py`` ``calculate_qparams``, ``compressors/mx_utils.py``
``compress_mx_scale``), which llm-compressor's ``MXFP4A16`` preset runs and whose ``mxfp4-pack-quantized``
compressor writes (``docs/formats.md``); vLLM's ``tests/quantization/reference_mxfp4.py`` computes the same:

* elements: the e2m1 grid of :mod:`compressor.quant.fp4` (``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, 4-bit codes
  ``sign << 3 | magnitude index``, round to nearest with ties to the even code, saturation at ±6, the
  sign bit set for a negative value even when it rounds to 0, not for an exact ``-0.0``), packed two a
  byte with the even column in the low nibble.
* shared scale ``X = 2^(e - 127)``, ``e`` the biased E8M0 exponent stored as one uint8 per output row and
  32 consecutive input columns: ``e = clamp(127 + E - 2, 0, 254)``, ``2 = floor(log2 6)`` the largest
  e2m1 exponent, ``E = floor(log2 a)`` of the group's absmax ``a`` **after rounding ``a`` to one
  mantissa bit, ties to even** (the element grid's own precision): ``E`` is ``floor(log2 a)`` plus 1
  when ``a``'s mantissa ``a / 2^floor(log2 a)`` is 1.75 or more.
  The OCP spec (section 6.3) takes ``floor(log2 a)`` without the rounding, so a group whose largest
  value lies in ``[7, 8) * 2^(E-2)`` saturates it to ``6 * 2^(E-2)`` (an error of 1 to 2 scale steps);
  compressed-tensors (and vLLM's reference) round the absmax as the element grid would round it (3.5 ->
  4), so that value becomes ``4 * 2^(E-1)``: an error of at most ``2^(E-2)`` for it, a coarser step for
  the rest of the group. kvq writes compressed-tensors' choice, the one an llm-compressor artifact of
  the same weights carries, so that both read back to the same bytes.
* an all-zero group (``log2 0 = -inf``) and any absmax under ``2^-125`` clamp to ``e = 0`` (``X =
  2^-127``, E8M0's smallest); a non-finite absmax gets ``e = 255``, E8M0's NaN, and dequantizes to NaN
  (a finite float32 absmax never reaches 255: its largest ``e`` is 253; for an absmax of ``1.75 * 2^127`` or
  more, only near float32's largest value, compressed-tensors' power-of-two rounding overflows to infinity
  and it writes 255).
* code ``q = e2m1(clamp(w / X, -6, 6))``; ``w_hat = q * X``, exact in float32 (and in bfloat16).

Algorithms: round-to-nearest (kvq's ``rtn``), GPTQ/GPTAQ on the same steps (:func:`group_steps`), and AWQ,
whose searches round each candidate with :func:`steps_of` and :func:`compressor.quant.fp4.round_to_steps`.
``in_features`` must be a multiple of 32 (the group
layout and vLLM's ``CompressedTensorsW4A16Mxfp4`` need it); shapes: weights ``[N, K]``. Every function is
side-effect free.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .fp4 import e2m1_codes, e2m1_values

GROUP = 32
#: E8M0's exponent bias; the largest e2m1 exponent (``floor(log2 6)``)
E8M0_BIAS = 127
EMAX_ELEM = 2
#: E8M0's NaN code; its largest finite code
E8M0_NAN = 255
E8M0_MAX = 254


def check_shape(w: torch.Tensor) -> None:
    """Raises InputError unless ``w`` is 2-D with a width that is a multiple of 32."""
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise InputError(f"MXFP4 weights are 2-D with in_features a multiple of {GROUP}, got shape {tuple(w.shape)}")


@torch.no_grad()
def shared_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (uint8, ``absmax``'s shape) of groups whose absolute maxima are ``absmax``
    (float, any shape, non-negative): ``clamp(127 + E - 2, 0, 254)`` with ``E`` the binade of the absmax
    rounded to one mantissa bit (module docstring); 0 for a zero absmax, 255 for a non-finite one."""
    a = absmax.float()
    mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1): floor(log2 a) = exp - 1
    e = exp.to(torch.int32) - 1 + (mant >= 0.875).to(torch.int32)  # mantissa 2 * mant >= 1.75 rounds up
    e = (e + (E8M0_BIAS - EMAX_ELEM)).clamp(0, E8M0_MAX)
    e = torch.where(a > 0, e, torch.zeros_like(e))
    return torch.where(torch.isfinite(a), e, torch.full_like(e, E8M0_NAN)).to(torch.uint8)


def scale_values(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(e - 127)`` of uint8 E8M0 codes ``e`` (any shape), exact: code 0 is ``2^-127`` (a float32
    subnormal), 255 is NaN."""
    bits = e.to(torch.int32) << 23  # the float32 whose exponent field is e: 2^(e - 127) for e >= 1
    x = bits.view(torch.float32)
    x = torch.where(e == 0, torch.full_like(x, 2.0 ** -127), x)
    return torch.where(e == E8M0_NAN, torch.full_like(x, float("nan")), x)


@torch.no_grad()
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes and shared exponents of ``w [N, K]`` (module docstring).

    Returns:
        ``(q uint8 [N, K] e2m1 codes, e uint8 [N, K/32] biased E8M0 exponents)``.

    Raises:
        InputError: ``w`` is not 2-D or its width is not a multiple of 32.
    """
    step, e = group_steps(w)
    n, k = w.shape
    q = e2m1_codes(w.float().reshape(n, k // GROUP, GROUP) / step.unsqueeze(-1)).reshape(n, k)
    return q, e


@torch.no_grad()
def group_steps(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 grid of ``w [N, K]``: ``(step float32 [N, K/32], e uint8 [N, K/32])``, a code ``q`` of group ``j``
    standing for ``q * step[:, j]`` (``step = 2^(e - 127)``). GPTQ rounds onto these steps column by column.

    Raises:
        InputError: ``w`` is not 2-D or its width is not a multiple of 32.
    """
    check_shape(w)
    wf = w.float()
    n, k = wf.shape
    return steps_of(wf.reshape(n, k // GROUP, GROUP).abs().amax(dim=-1))


def steps_of(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 steps of groups whose absolute maxima are ``amax`` (float, any shape): ``(step float32, e uint8)``
    of ``amax``'s shape, ``e`` the biased E8M0 exponents (:func:`shared_exponents`) and ``step = 2^(e - 127)``."""
    e = shared_exponents(amax)
    return scale_values(e), e


@torch.no_grad()
def dequantize_weight(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * 2^(e - 127)`` per 32-column group: float ``[N, K]`` in ``dtype`` (exact in float32; compressed-tensors'
    decompressor gives the same values in bfloat16).

    Raises:
        InputError: ``e`` is not ``[N, K/32]`` for ``q [N, K]``.
    """
    n, k = q.shape
    if tuple(e.shape) != (n, k // GROUP) or k % GROUP:
        raise InputError(f"MXFP4 exponents {tuple(e.shape)} do not match codes {(n, k)} in groups of {GROUP}")
    step = scale_values(e).unsqueeze(-1)
    return (e2m1_values(q).reshape(n, k // GROUP, GROUP) * step).reshape(n, k).to(dtype)
