"""The bases of the runtime's quantized Linear layers (:mod:`compressor.runtime.linear` picks one per module):
:class:`Linear` (input quantization, act-order permutation, 2-D matmul, bias), :class:`QuantLinear` (a kernel over a
:class:`~compressor.formats.base.QuantWeight`) and :class:`DequantLinear` (the ``dequant`` reference kernel, which
the emulated kernels extend). Kept apart so that the kernels of other modules (:mod:`.fp4_linear`) subclass them
without importing the kernel choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.base import QuantWeight
from ..quant.fp8_inputs import quantize_input


class Linear(torch.nn.Module):
    """Base: optional input quantization (FP8 W8A8, W4A8, NVFP4 W4A4: ``act``, as the serving kernel quantizes each
    token's input, :func:`~compressor.quant.fp8_inputs.quantize_input`), optional input
    permutation (GPTQ act-order), 2-D matmul, bias."""

    kernel = "base"
    #: ``(act, group size)`` of the input's quantization (NVFP4 W4A4: ``("nvfp4", 16, input_global_scale)``);
    #: ``("", 0)``: none
    act: tuple = ("", 0)
    #: the dtype a quantized input is dequantized to (None: the input's; float32 keeps it exact)
    quantized_input_dtype: torch.dtype | None = None

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, in_perm: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.in_perm = in_perm
        self.fallback_reason: str | None = None

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.act[0]:
            x = quantize_input(x, self.act, dtype=self.quantized_input_dtype)
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        y = self._mm(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.kernel}, in={self.in_features}, out={self.out_features}"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the layer's stored weight tensors (codes, scales, zeros, bias)."""
        return sum(t.numel() * t.element_size() for t in self._stored() if t is not None)

    def _stored(self):
        return [self.bias]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float ``[N, K]`` weight this layer multiplies by, in the caller's input column
        order (an act-order permutation undone), built from the stored codes on each call (for
        MLA's absorbed ``kv_b_proj``; no copy is kept)."""
        w = self._dense(dtype)
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized(dtype)


class QuantLinear(Linear):
    """Base of the kernels over a :class:`QuantWeight`; ``unsupported`` says why one cannot serve."""

    @classmethod
    def unsupported(cls, w: QuantWeight, device: torch.device) -> str | None:
        raise NotImplementedError


class DequantLinear(QuantLinear):
    """Dequantize the int8 codes on every call, then ``F.linear`` (works for every scheme).

    Memory: one byte per weight plus scales; the float weight exists only transiently,
    one layer at a time. Numerics: exactly :func:`compressor.artifact.load_artifact`'s
    weight, rounded to the activation dtype.
    """

    kernel = "dequant"

    def __init__(self, w: QuantWeight, bias, device, in_perm=None):
        super().__init__(w.in_features, w.out_features, bias, in_perm)
        self.q = w.q.to(device)
        self.scale = w.scale.to(device)
        self.zero_point = None if w.zero_point is None else w.zero_point.to(device)
        self.g_idx = None if w.g_idx is None else w.g_idx.to(device)
        self.group_size = w.group_size

    @classmethod
    def unsupported(cls, w, device):
        return None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to :func:`~compressor.quant.primitives.dequantize`
        (computed in one buffer: fresh multi-MB temporaries cost page faults on every call)."""
        if self.g_idx is not None:
            from ..quant.primitives import dequantize

            return dequantize(self.q, self.scale, self.zero_point, self.group_size, dtype=dtype, g_idx=self.g_idx)
        n, k, gs = self.out_features, self.in_features, self.group_size
        w = self.q.reshape(n, k // gs, gs).float()
        if self.zero_point is not None:
            w.sub_(self.zero_point.float().unsqueeze(-1))
        return w.mul_(self.scale.float().unsqueeze(-1)).reshape(n, k).to(dtype)

    def _mm(self, x2):
        return F.linear(x2, self.dequantized(x2.dtype))

    def _stored(self):
        return [self.q, self.scale, self.zero_point, self.g_idx, self.bias]
