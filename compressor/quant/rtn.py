"""Round-to-nearest (RTN) weight quantization: min-max qparams, no calibration."""

from __future__ import annotations

import torch

from ..errors import QuantizationError
from .inplace_linalg import all_finite
from .primitives import _grouped, check_scale_range, compute_qparams, qrange, quantize

#: rows of a weight :func:`rtn_linear_inplace` quantizes at a time: their float32 temporaries
#: (about 1 MB at a width of 7,168) stay in the core's cache between the elementwise passes
CHUNK_ELEMS = 1 << 18


@torch.no_grad()
def rtn_quantize(
    w: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    clip_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w [out, in]``; returns ``(q int8 [out,in], scale [out,G] f32, zero_point int8 [out,G])``.

    With ``clip_max [out, G]`` (from :func:`compressor.quant.awq.search_clip`) the weight is
    clamped to ``[-clip_max, clip_max]`` first, as AWQ's clipping step does.
    """
    if clip_max is not None:
        cm = clip_max.repeat_interleave(w.shape[1] // clip_max.shape[1], dim=1)
        w = torch.maximum(torch.minimum(w.float(), cm), -cm)
    scale, zero_point = compute_qparams(w, num_bits, group_size, symmetric)
    return quantize(w, scale, zero_point, num_bits, group_size), scale, zero_point


@torch.no_grad()
def rtn_linear_inplace(w: torch.Tensor, num_bits: int, group_size: int, symmetric: bool, dtype: torch.dtype,
                       name: str, scratch: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """RTN of a float32 weight ``w [out, in]`` (contiguous) with its dequantized value written back
    into ``w``: what :func:`rtn_quantize` followed by :func:`compressor.quant.layer.stored_dequantize`,
    the relative error ``||deq - w|| / ||w||`` and ``w.copy_(deq)`` give, value for value, in fewer
    passes over memory: the qparams from the whole weight (:func:`compute_qparams`), then
    :data:`CHUNK_ELEMS` values at a time the codes, the dequantized weight (from the scales rounded
    to ``dtype``) and its difference to ``w``, each chunk's temporaries reused while they are in
    cache. The error is the norm of the whole difference, as the unfused path takes it.
    ``scratch``: a float32 tensor of at least ``w.numel()`` values on ``w``'s device that holds the
    difference (a buffer reused from linear to linear is not faulted in again each time), or
    ``None`` (a new one).

    Returns:
        ``(q int8 [out, in], scale [out, G] in dtype, zero_point int8 [out, G], relative error)``.

    Raises:
        InputError: a scale ``dtype`` cannot hold (float16 above 65,504; names the module), a group
            size that does not divide ``in``.
        QuantizationError: a non-finite scale or dequantized weight (names the module; rows of ``w``
            before the one that failed already hold their dequantized values).
    """
    qmin, qmax = qrange(num_bits)
    wg = _grouped(w, group_size)  # [out, G, gs], a view of w
    scale, zero_point = compute_qparams(w, num_bits, group_size, symmetric)
    check_scale_range(scale, dtype, name)
    stored = scale.to(dtype)
    if not torch.isfinite(stored).all():
        raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
    ref_norm = w.norm()
    out_f, n_groups, gs = wg.shape
    q = torch.empty(out_f, n_groups, gs, dtype=torch.int8, device=w.device)
    fits = scratch is not None and scratch.numel() >= w.numel() and scratch.device == w.device
    diff = scratch.view(-1)[: w.numel()].view(wg.shape) if fits else torch.empty_like(wg)
    zf, sf = zero_point.float().unsqueeze(-1), stored.float().unsqueeze(-1)
    step = max(1, CHUNK_ELEMS // max(1, n_groups * gs)) if w.device.type == "cpu" else out_f  # a GPU: one chunk
    buf = torch.empty(min(step, out_f), n_groups, gs, device=w.device)
    for r0 in range(0, out_f, step):
        r1 = min(out_f, r0 + step)
        t, src = buf[: r1 - r0], wg[r0:r1]
        torch.div(src, scale[r0:r1].unsqueeze(-1), out=t)
        t.round_().add_(zf[r0:r1]).clamp_(qmin, qmax)  # quantize(): round(w / s) + zp, clamped
        q[r0:r1].copy_(t)
        if not symmetric:
            t.sub_(zf[r0:r1])
        t.mul_(sf[r0:r1])  # dequantize(): (q - zp) * stored scale
        if not all_finite(t):
            raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
        torch.sub(t, src, out=diff[r0:r1])
        src.copy_(t)
    rel = float(diff.view(w.shape).norm() / ref_norm.clamp(min=1e-12))
    return q.view(w.shape), stored.contiguous(), zero_point, rel
