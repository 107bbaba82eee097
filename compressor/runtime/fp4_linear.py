"""The FP4 e2m1 weight-only (W4A16) linears of the runtime: NVFP4 (``nvfp4-emulated``) and MXFP4
(``mxfp4-emulated``), chosen by :func:`compressor.runtime.linear.make_linear` for every backend and device.

Both keep the unpacked e2m1 codes (uint8 ``[N, K]``, one byte each) and their scales, dequantize the weight on
each call to the input's dtype and multiply with ``F.linear``, as the ``dequant`` kernel does for integers: the
weight is exactly the one :meth:`~compressor.formats.base.QuantWeight.dequantize` builds, rounded to the
activation dtype (e2m1 values times a power of two are exact in bfloat16, so an MXFP4 weight is not rounded
at all). No FP4 tensor cores are used; vLLM serves both formats with its FP4 Marlin kernel.
"""

from __future__ import annotations

import torch

from ..formats.base import QuantWeight
from ..quant.fp4 import dequantize_weight as dequantize_fp4_weight
from ..quant.mxfp4 import dequantize_weight as dequantize_mxfp4_weight
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


class Mxfp4Linear(DequantLinear):
    """MXFP4 weight-only (W4A16) emulated: the e2m1 codes and their uint8 E8M0 exponents (one per 32 inputs)
    kept, the weight dequantized on each call (:func:`~compressor.quant.mxfp4.dequantize_weight`)."""

    kernel = "mxfp4-emulated"

    @classmethod
    def unsupported(cls, w, device):
        return None if w.is_mxfp4 else "MXFP4 weights only"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mxfp4_weight(self.q, self.scale, dtype)

    def _stored(self):
        return [self.q, self.scale, self.bias]


def fp4_linear(w: QuantWeight, bias, device, in_perm=None) -> DequantLinear | None:
    """The e2m1 layer serving ``w`` (:class:`Fp4Linear` for NVFP4, :class:`Mxfp4Linear` for MXFP4), ``None`` for
    any other weight."""
    for cls in (Fp4Linear, Mxfp4Linear):
        if cls.unsupported(w, device) is None:
            return cls(w, bias, device, in_perm)
    return None
