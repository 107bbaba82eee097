"""Round-to-nearest (RTN) weight quantization: min-max qparams, no calibration."""

from __future__ import annotations

import torch

from .primitives import compute_qparams, quantize


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
