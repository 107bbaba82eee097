"""The FP4 e2m1 weight-only (W4A16) linears of the runtime: NVFP4 (``nvfp4-emulated``), chosen by
:func:`compressor.runtime.linear.make_linear` for every backend and device.

It keeps the unpacked e2m1 codes (uint8 ``[N, K]``, one byte each) and their scales, dequantizes the weight on
each call to the input's dtype and multiplies with ``F.linear``, as the ``dequant`` kernel does for integers: the
weight is exactly the one :meth:`~compressor.formats.base.QuantWeight.dequantize` builds, rounded to the
activation dtype. No FP4 tensor cores are used; vLLM serves the format with its FP4 Marlin kernel.
"""

from __future__ import annotations

import torch

from ..formats.base import QuantWeight
from ..quant.fp4 import dequantize_weight as dequantize_fp4_weight
from .linear_base import DequantLinear


class Fp4Linear(DequantLinear):
    """NVFP4 weight-only (W4A16) emulated: the e2m1 codes, e4m3 group scales and the global scale kept, the
    weight dequantized on each call (:func:`~compressor.quant.fp4.dequantize_weight`)."""

    kernel = "nvfp4-emulated"

    def __init__(self, w: QuantWeight, bias, device, in_perm=None):
        super().__init__(w, bias, device, in_perm)
        self.global_scale = w.global_scale.to(device)

    @classmethod
    def unsupported(cls, w, device):
        return None if w.is_fp4 else "NVFP4 weights only"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp4_weight(self.q, self.scale, self.global_scale, dtype)

    def _stored(self):
        return [self.q, self.scale, self.global_scale, self.bias]


def fp4_linear(w: QuantWeight, bias, device, in_perm=None) -> DequantLinear | None:
    """The e2m1 layer serving ``w`` (:class:`Fp4Linear` for NVFP4), ``None`` for any other weight."""
    for cls in (Fp4Linear,):
        if cls.unsupported(w, device) is None:
            return cls(w, bias, device, in_perm)
    return None
