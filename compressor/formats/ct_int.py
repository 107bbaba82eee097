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
from .base import QuantWeight, require_zero_point, symmetric_zero


def read_int_module(group: dict, t: dict[str, torch.Tensor], act: tuple[str, int]) -> QuantWeight:
    """A module's ``int-quantized`` tensors ``t`` with its config ``group``; ``act``: the group's inputs
    (:func:`compressor.formats.compressed_tensors.activation_scheme`'s ``(act, act_group)``).

    Raises:
        InputError: a weight that is not 2-D int8, values outside the group's ``num_bits`` range,
            a scale or zero point of another shape than the group gives, asymmetric weights without a zero point.
    """
    wargs = group.get("weights") or {}
    q, scale = t["weight"], t["weight_scale"]
    if wargs.get("type") != "int" or q.dtype != torch.int8 or q.ndim != 2:
        raise InputError(f"weight {q.dtype} {tuple(q.shape)} with weights {wargs.get('type')} is not an "
                         "int-quantized weight (2-D int8)")
    require_zero_point(wargs, t)
    bits = int(wargs["num_bits"])
    n, k = q.shape
    gs = k if wargs.get("strategy") == "channel" else int(wargs.get("group_size") or 0)
    if gs < 1 or k % gs or tuple(scale.shape) != (n, k // gs):
        raise InputError(f"weight_scale shape {tuple(scale.shape)} does not match weight {(n, k)} in groups of {gs}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if int(q.min()) < lo or int(q.max()) > hi:
        raise InputError(f"int-quantized values outside {lo}..{hi} for {bits}-bit weights")
    zp = t.get("weight_zero_point")
    if zp is not None and tuple(zp.shape) != tuple(scale.shape):
        raise InputError(f"weight_zero_point shape {tuple(zp.shape)} does not match weight_scale {tuple(scale.shape)}")
    g_idx = t.get("weight_g_idx")
    act, act_group = act
    return QuantWeight(q, scale, symmetric_zero(None if zp is None else zp.to(torch.int8)), bits, gs,
                       None if g_idx is None else g_idx.to(torch.int32), act=act, act_group=act_group)
