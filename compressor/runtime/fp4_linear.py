"""The FP4 e2m1 linears of the runtime: NVFP4 weight-only (``nvfp4-emulated``), NVFP4 W4A4
(``nvfp4-a4-emulated``: the input quantized to NVFP4 too, multiplied in float32) and MXFP4 (``mxfp4-emulated``),
chosen by :func:`compressor.runtime.linear.make_linear` for every backend and device.

All keep the unpacked e2m1 codes (uint8 ``[N, K]``, one byte each) and their scales and dequantize the weight on
each call; the weight-only ones to the input's dtype and multiply with ``F.linear``, as the ``dequant`` kernel
does for integers: the weight is exactly the one :meth:`~compressor.formats.base.QuantWeight.dequantize`
builds, rounded to the activation dtype (e2m1 values times a power of two are exact in bfloat16, so an MXFP4
weight is not rounded at all). No FP4 tensor cores are used; vLLM serves the weight-only formats with its FP4
Marlin kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.base import QuantWeight
from ..quant.fp4_inputs import ACT
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


class Fp4A4Linear(Fp4Linear):
    """NVFP4 W4A4 emulated: the weight as :class:`Fp4Linear` keeps it, the input quantized by the base class
    (``act`` ``("nvfp4", 16, input_global_scale)``: e4m3 scales per 16 inputs per call over the static global scale,
    :func:`~compressor.quant.fp4_inputs.fake_quantize_input`) and multiplied in float32: the numerics of vLLM's
    NVFP4 GEMM (products of e2m1 values scaled per 16 on both sides, accumulated in float32, times
    ``1 / (g_input * g_weight)``) up to the order of the sums. No FP4 tensor cores are used."""

    kernel = "nvfp4-a4-emulated"
    quantized_input_dtype = torch.float32

    def __init__(self, w: QuantWeight, bias, device, in_perm=None):
        super().__init__(w, bias, device, in_perm)
        self.input_global_scale = w.input_global_scale.float().to(device)
        self.act = (w.act, w.act_group, self.input_global_scale)

    @classmethod
    def unsupported(cls, w, device):
        return None if w.is_fp4 and w.act == ACT else "NVFP4 weights with NVFP4 activations (W4A4) only"

    def _mm(self, x2):  # float32 out; the base casts to the input's dtype
        return F.linear(x2.float(), self.dequantized(torch.float32))

    def _stored(self):
        return [*super()._stored(), self.input_global_scale]


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
    """The e2m1 layer serving ``w`` (:class:`Fp4A4Linear` for NVFP4 W4A4, :class:`Fp4Linear` for NVFP4,
    :class:`Mxfp4Linear` for MXFP4), ``None`` for any other weight."""
    for cls in (Fp4A4Linear, Fp4Linear, Mxfp4Linear):
        if cls.unsupported(w, device) is None:
            return cls(w, bias, device, in_perm)
    return None
