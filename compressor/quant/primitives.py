"""Pure integer-quantization primitives shared by every algorithm.

Convention (matches compressed-tensors ``quantization/utils/helpers.py``
``calculate_range`` / ``calculate_qparams``, version 0.20):

* Integers are **signed**, ``q in [-2^(b-1), 2^(b-1) - 1]`` (int4: -8..7).
* Symmetric: ``scale = absmax / ((qmax - qmin) / 2)`` (int4: absmax / 7.5), ``zero_point = 0``.
* Asymmetric: ``min``/``max`` are first widened to include 0,
  ``scale = (max - min) / (qmax - qmin)``, ``zero_point = clamp(round(qmin - min / scale))``.
* ``q = clamp(round(w / scale) + zero_point, qmin, qmax)``; ``w_hat = (q - zero_point) * scale``.

Shapes (``G = in_features // group_size``, ``group_size = -1`` means one group per row):

=============  =======================  =========
tensor         shape                    dtype
=============  =======================  =========
weight ``w``   ``[out, in]``            float
``scale``      ``[out, G]``             float32
``zero_point`` ``[out, G]``             int8
``q``          ``[out, in]``            int8
=============  =======================  =========

All functions are ``@torch.no_grad()`` and side-effect free.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..errors import InputError


class Scheme(NamedTuple):
    """One module's weight scheme as the pipeline and the formats pass it around.

    ``(num_bits, group_size, symmetric)`` is an integer scheme (``group_size -1``: per channel);
    ``type "float"`` is FP8 e4m3 (``num_bits 8``, :mod:`compressor.quant.fp8`) with scales per ``rows x
    group_size`` block (``rows 1``: per row, ``group_size -1``: per channel), NVFP4 (``num_bits 4``,
    ``group_size 16``, :mod:`compressor.quant.fp4`) or MXFP4 (``num_bits 4``, ``group_size 32``,
    :mod:`compressor.quant.mxfp4`); ``act`` the dynamic
    activation quantization of the module's input (``""``: none, 16-bit activations;
    ``fp8-token`` / ``fp8-group``, :data:`compressor.quant.fp8.ACT_SCHEMES`). Stored as a list
    in resume checkpoints (an older three-entry list reads as an integer scheme).
    """

    num_bits: int
    group_size: int
    symmetric: bool
    type: str = "int"
    rows: int = 1
    act: str = ""

    @property
    def is_float(self) -> bool:
        return self.type == "float"

    @property
    def is_fp4(self) -> bool:
        """NVFP4 (``type "float"``, 4 bits in groups of 16: :mod:`compressor.quant.fp4`); ``is_float`` is true for
        it too."""
        return self.type == "float" and self.num_bits == 4 and self.group_size != 32

    @property
    def is_mxfp4(self) -> bool:
        """MXFP4 (``type "float"``, 4 bits in groups of 32: :mod:`compressor.quant.mxfp4`); ``is_float`` is true
        for it too, ``is_fp4`` is not."""
        return self.type == "float" and self.num_bits == 4 and self.group_size == 32


def qrange(num_bits: int) -> tuple[int, int]:
    """Return ``(qmin, qmax)`` of the signed ``num_bits`` integer grid.

    Raises:
        InputError: ``num_bits`` outside 2..8.
    """
    if not 2 <= int(num_bits) <= 8:
        raise InputError(f"num_bits must be between 2 and 8, got {num_bits}")
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def resolve_group_size(group_size: int, in_features: int) -> int:
    """Map ``-1`` (per-channel) to ``in_features``; return the effective group size."""
    return in_features if group_size in (-1, 0, None) else int(group_size)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out_f, in_f = w.shape
    gs = resolve_group_size(group_size, in_f)
    if in_f % gs:
        raise InputError(f"group_size {gs} does not divide in_features {in_f}")
    return w.reshape(out_f, in_f // gs, gs)


@torch.no_grad()
def compute_qparams(
    w: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    clip_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max quantization parameters of a weight, per output row and input group.

    Args:
        w: ``[out, in]`` float weight.
        num_bits: 2..8.
        group_size: divides ``in``; ``-1`` for per-channel.
        symmetric: symmetric (zero_point 0) or asymmetric grid.
        clip_max: optional ``[out, G]`` positive clipping threshold (AWQ weight clipping):
            the weight is clamped to ``[-clip_max, clip_max]`` before min/max are taken.

    Returns:
        ``(scale [out, G] float32, zero_point [out, G] int8)``. Scales are never zero or
        non-finite: an all-zero group gets scale 1.
    """
    qmin, qmax = qrange(num_bits)
    wg = _grouped(w.float(), group_size)
    if clip_max is not None:
        cm = clip_max.float().unsqueeze(-1)
        wg = torch.maximum(torch.minimum(wg, cm), -cm)
    if symmetric:
        absmax = wg.abs().amax(dim=-1)
        scale = absmax / ((qmax - qmin) / 2)
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        wmin = wg.amin(dim=-1).clamp(max=0)
        wmax = wg.amax(dim=-1).clamp(min=0)
        scale = (wmax - wmin) / (qmax - qmin)
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    if not symmetric:
        zero_point = torch.round(qmin - wmin / scale).clamp(qmin, qmax).to(torch.int8)
    return scale, zero_point


@torch.no_grad()
def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, num_bits: int, group_size: int
) -> torch.Tensor:
    """Quantize ``w [out, in]`` with ``scale``/``zero_point [out, G]`` to int8 ``[out, in]``."""
    qmin, qmax = qrange(num_bits)
    wg = _grouped(w.float(), group_size)
    q = torch.round(wg / scale.unsqueeze(-1)) + zero_point.unsqueeze(-1).float()
    return q.clamp_(qmin, qmax).to(torch.int8).reshape(w.shape)


@torch.no_grad()
def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize int ``q [out, in]`` to ``dtype``: ``(q - zero_point) * scale`` per group.

    With ``g_idx`` (int ``[in]``, GPTQ act-order) column ``c`` uses group ``g_idx[c]``
    instead of ``c // group_size``.
    """
    if g_idx is not None:
        idx = g_idx.long()
        s = scale.float()[:, idx]
        qf = q.float()
        if zero_point is not None:
            qf = qf - zero_point.float()[:, idx]
        return (qf * s).to(dtype)
    qg = _grouped(q, group_size).float()
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


@torch.no_grad()
def fake_quantize(
    w: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    clip_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize then dequantize ``w [out, in]``; returns a tensor of ``w``'s dtype.

    Numerically identical to ``dequantize(quantize(w, *compute_qparams(w, ...)))`` (tested),
    computed in fewer passes because the AWQ grid search calls it many times.
    """
    wg = _grouped(w.float(), group_size)
    if clip_max is not None:
        cm = clip_max.float().unsqueeze(-1)
        wg = torch.maximum(torch.minimum(wg, cm), -cm)
    return fake_quantize_grouped(wg, num_bits, symmetric).reshape(w.shape).to(w.dtype)


def clip_groups(w: torch.Tensor, clip_max: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [out, in]`` clamped to ``±clip_max [out, G]`` in each group of ``group_size`` inputs: float32 ``[out, in]``
    (the weight AWQ's clip search scored, :func:`compressor.quant.awq.search_clip`)."""
    wg = w.float().reshape(w.shape[0], -1, group_size)
    cm = clip_max.float().to(w.device).unsqueeze(-1)
    return torch.maximum(torch.minimum(wg, cm), -cm).reshape(w.shape)


@torch.no_grad()
def fake_quantize_grouped(
    wg: torch.Tensor, num_bits: int, symmetric: bool
) -> torch.Tensor:
    """Fake-quantize an already grouped ``[..., group_size]`` float tensor (batched search helper).

    Same numerics as :func:`fake_quantize`, vectorised over any leading dimensions
    (used by the AWQ clip search, which evaluates many clipping ratios at once).
    """
    qmin, qmax = qrange(num_bits)
    if symmetric:
        scale = wg.abs().amax(dim=-1, keepdim=True) / ((qmax - qmin) / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(wg / scale).clamp_(qmin, qmax) * scale
    wmin = wg.amin(dim=-1, keepdim=True).clamp(max=0)
    wmax = wg.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = (wmax - wmin) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.round(qmin - wmin / scale).clamp_(qmin, qmax)
    return (torch.round(wg / scale).add_(zp).clamp_(qmin, qmax) - zp) * scale


@torch.no_grad()
def search_qparams(
    w: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    h_blocks: torch.Tensor | None = None,
    grid: int = 100,
    max_shrink: float = 0.25,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qparams of each group chosen by a grid search of its range: the one of ``min·p, max·p``
    (symmetric: ``absmax·p``), ``p = 1 - k / grid`` for ``k < max_shrink · grid``, that
    minimises the group's quantization error ``Δ_gᵀ H_gg Δ_g`` (``Δ_g = w_g - ŵ_g``).

    The error is the squared output error the group alone causes on the calibration inputs
    when ``h_blocks`` holds the diagonal blocks of the layer's Hessian ``2 X Xᵀ / n``; without
    it, the plain squared weight error. A shrink ``p < 1`` clips the group's outliers to give
    the bulk of its weights a finer grid: the same idea as AWQ's clipping search (Lin et al.,
    2023) and GPTQModel's ``mse`` range search, scored here by the Hessian instead of sampled
    outputs (exact for the group's own error, and cheap: ``out · in · group_size`` per step).
    ``p = 1`` (min-max, :func:`compute_qparams`) is always a candidate and wins ties, so no
    group gets a larger error than min-max gives. Asymmetric candidates come twice: with the
    zero point taken from the unrounded scale (as min-max) and from the stored one.

    Args:
        w: ``[out, in]`` float weight.
        num_bits, group_size, symmetric: the grid (as :func:`compute_qparams`).
        h_blocks: float ``[G, gs, gs]`` diagonal blocks of the Hessian (groups' columns in
            ``w``'s column order), or ``[G, gs]`` its diagonal alone (each squared weight error
            weighted by its column's ``H_cc``: per-channel groups, where a block is all of ``H``),
            or ``None``.
        grid, max_shrink: candidates ``1 - k/grid`` for ``k = 0 .. ceil(max_shrink·grid) - 1``.
        scale_dtype: each candidate scale is rounded to the storage dtype before it is scored.

    Returns:
        ``(scale [out, G] float32 (values of scale_dtype), zero_point [out, G] int8)``.

    Raises:
        InputError: ``num_bits`` outside 2..8, or ``group_size`` does not divide ``in``.
    """
    qmin, qmax = qrange(num_bits)
    wg = _grouped(w.float(), group_size)  # [out, G, gs]
    if symmetric:
        hi = wg.abs().amax(dim=-1)
        lo = -hi
    else:
        lo = wg.amin(dim=-1).clamp(max=0)
        hi = wg.amax(dim=-1).clamp(min=0)
    hb = None if h_blocks is None else h_blocks.float().to(wg.device)

    def candidates():
        for k in range(max(1, math.ceil(max_shrink * grid))):
            p = 1.0 - k / grid
            raw = hi * p / ((qmax - qmin) / 2) if symmetric else (hi - lo) * p / (qmax - qmin)
            raw = torch.where((raw > 0) & torch.isfinite(raw), raw, torch.ones_like(raw))
            scale = raw.to(scale_dtype).float()
            if symmetric:
                yield scale, torch.zeros_like(scale)
                continue
            if k == 0:  # min-max exactly as compute_qparams (zero point from the unrounded scale)
                yield scale, torch.round(qmin - lo / raw).clamp_(qmin, qmax)
            # the zero point fitted to the stored scale: where the scale's rounding moved the
            # grid, this one puts the group's minimum back on it
            yield scale, torch.round(qmin - lo * p / scale).clamp_(qmin, qmax)

    best_err = best_scale = best_zero = None
    for scale, zero in candidates():
        s3, z3 = scale.unsqueeze(-1), zero.unsqueeze(-1)
        delta = wg - (torch.round(wg / s3).add_(z3).clamp_(qmin, qmax) - z3) * s3  # [out, G, gs]
        if hb is None:
            err = delta.square().sum(-1)
        elif hb.dim() == 2:
            err = (delta.square() * hb).sum(-1)
        else:  # Δ_gᵀ H_gg Δ_g, one batched matmul over the groups
            dg = delta.transpose(0, 1)  # [G, out, gs]
            err = (torch.bmm(dg, hb) * dg).sum(-1).t()  # [out, G]
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero.to(torch.int8)


def check_scale_range(scale: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """Refuse scales (float32, before they are rounded to the storage ``dtype``) that the
    storage dtype cannot hold: float16 tops out at 65,504, so a linear with weights near
    65,504 x 2^(bits-1) would store infinite scales.

    Raises:
        InputError: the largest |scale| exceeds ``dtype``'s range (named, with the dtypes
            that hold it); nothing is written.
    """
    if not dtype.is_floating_point or dtype.itemsize >= 4 or not torch.isfinite(scale).all():
        return
    top = float(scale.abs().max()) if scale.numel() else 0.0
    limit = torch.finfo(dtype).max
    if top > limit:
        raise InputError(f"the weight scales of {name} reach {top:.4g}, beyond what {str(dtype).removeprefix('torch.')} "
                         f"stores ({limit:g}); store the artifact in bfloat16 (--dtype bfloat16) or float32")


def abs_max(x: torch.Tensor) -> float:
    """``max |x|`` of a non-empty float tensor as a Python float, from one ``aminmax`` pass (no
    ``|x|`` temporary: about 10x faster than ``x.abs().amax()`` on a 50 MB activation)."""
    lo, hi = torch.aminmax(x.detach())
    return max(-float(lo), float(hi))
