"""compressed-tensors ``int-quantized``: integer weights stored one value per int8, unpacked.

llm-compressor saves a scheme with integer weights and quantized inputs (its ``W4AFP8`` and
``W8A8`` presets) in this layout (compressed-tensors' ``IntQuantizationCompressor``): per
Linear ``weight`` int8 ``[out, in]`` (the signed values, ``-2^(b-1) .. 2^(b-1) - 1``),
``weight_scale`` ``[out, in / group_size]`` (``strategy: group``) or ``[out, 1]`` (``channel``),
``weight_zero_point`` int8 of the scale's shape when asymmetric, ``weight_g_idx`` int32 ``[in]``
with ``actorder: group``. The value is ``(q - zero_point) * scale``, as in ``pack-quantized``
(which packs the same values eight to an int32). kvq reads it to score such artifacts (the
peers' in ``bench/quality_peers.py``); it writes ``pack-quantized``.
"""

from __future__ import annotations

import torch

from ..errors import InputError


def int_values(wargs: dict, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q int8 [out, in], weight_scale, weight_zero_point int8 | None)`` of a module's ``int-quantized`` tensors
    ``t`` under its config group's ``weights`` args ``wargs``, as
    :func:`compressor.formats.compressed_tensors.read_module` gives them for ``pack-quantized`` (the reader checks
    the scale's shape and the zero point's presence for both).

    Raises:
        InputError: a weight that is not 2-D int8 under integer weights, values outside the group's ``num_bits``
            range, a zero point of another shape than the scale.
    """
    q, scale = t["weight"], t["weight_scale"]
    if wargs.get("type") != "int" or q.dtype != torch.int8 or q.ndim != 2:
        raise InputError(f"weight {q.dtype} {tuple(q.shape)} with weights {wargs.get('type')} is not an "
                         "int-quantized weight (2-D int8)")
    bits = int(wargs["num_bits"])
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if int(q.min()) < lo or int(q.max()) > hi:
        raise InputError(f"int-quantized values outside {lo}..{hi} for {bits}-bit weights")
    zp = t.get("weight_zero_point")
    if zp is not None and tuple(zp.shape) != tuple(scale.shape):
        raise InputError(f"weight_zero_point shape {tuple(zp.shape)} does not match weight_scale {tuple(scale.shape)}")
    return q, scale, None if zp is None else zp.to(torch.int8)
