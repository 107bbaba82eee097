"""Integer weights of one Linear, read from an artifact's packed tensors (no float copy).

:class:`QuantWeight` holds a Linear's codes in kvq's signed convention
(:mod:`compressor.quant.primitives`): ``w ≈ (q - zero_point) * scale`` per input group.

==============  ====================  =========================================
field           shape                 dtype
==============  ====================  =========================================
``q``           ``[N, K]``            int8, ``[-2^(b-1), 2^(b-1) - 1]``
``scale``       ``[N, G]``            as stored (float16 / bfloat16 / float32)
``zero_point``  ``[N, G]`` or None    int8 (None: symmetric, zero point 0)
``g_idx``       ``[K]`` or None       int32 group of each input column (GPTQ
                                      act-order); None: ``k // group_size``
==============  ====================  =========================================

``N = out_features``, ``K = in_features``, ``G = K // group_size`` (``group_size = K``
for per-channel schemes). The readers reuse the format modules
(:mod:`compressor.formats.compressed_tensors`, ``awq``, ``gptq``) and validate shapes;
inconsistent tensors are an :class:`~compressor.errors.InputError` naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ..quant.primitives import dequantize

#: tensor leaves of a packed Linear, per ``quantization_config.quant_method``
PACKED_LEAVES = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}
#: the leaf whose presence marks a module as packed
MARKER = {"compressed-tensors": "weight_packed", "awq": "qweight", "gptq": "qweight"}


@dataclass
class QuantWeight:
    """Codes and quantization parameters of one Linear (see the module table)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    num_bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to what :func:`compressor.artifact.load_artifact` builds."""
        return dequantize(self.q, self.scale, self.zero_point, self.group_size, dtype=dtype, g_idx=self.g_idx)

    def sorted_by_group(self) -> tuple["QuantWeight", torch.Tensor | None]:
        """Remove an act-order ``g_idx`` by permuting input columns.

        Returns ``(weight, perm)``: ``weight`` has contiguous groups (``g_idx`` None) and
        ``y = x[..., perm] @ weight.dequantize().T`` equals ``x @ self.dequantize().T``.
        ``perm`` is None when nothing needed permuting; the original weight and None are
        returned when groups do not have exactly ``group_size`` columns each (the caller
        then keeps ``g_idx`` and dequantizes).
        """
        if self.g_idx is None:
            return self, None
        gi = self.g_idx.long()
        trivial = torch.arange(self.in_features) // self.group_size
        if torch.equal(gi, trivial) and self.in_features % self.group_size == 0:
            return QuantWeight(self.q, self.scale, self.zero_point, self.num_bits, self.group_size), None
        counts = torch.bincount(gi, minlength=self.scale.shape[1])
        if self.in_features % self.group_size or not bool((counts == self.group_size).all()):
            return self, None
        perm = torch.sort(gi, stable=True).indices
        return QuantWeight(self.q[:, perm].contiguous(), self.scale, self.zero_point, self.num_bits, self.group_size), perm


def _symmetric_zero(zp: torch.Tensor | None) -> torch.Tensor | None:
    """An all-zero zero point (GPTQ/AWQ symmetric checkpoints store one) is the symmetric case."""
    return None if zp is None or not bool(zp.any()) else zp


def read_quant_weight(method: str, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    """Read one packed Linear of an artifact.

    Args:
        method: ``quantization_config.quant_method`` (``compressed-tensors``, ``awq``, ``gptq``).
        qc: the ``quantization_config`` dict.
        module: full module name (selects the compressed-tensors config group).
        t: the module's stored tensors, keyed by leaf (``weight_packed``, ``qweight``, ...).

    Raises:
        InputError: tensors missing or inconsistent with the config, unknown method.
    """
    try:
        return _read(method, qc, module, t)
    except InputError as e:
        raise InputError(f"module {module}: {e}") from None
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"module {module}: cannot read its {method} tensors ({type(e).__name__}: {e})") from None


def _read(method: str, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
    if method == "compressed-tensors":
        from ..formats import compressed_tensors as ct

        if not {"weight_packed", "weight_scale", "weight_shape"} <= set(t):
            raise InputError("lacks weight_packed/weight_scale/weight_shape")
        wargs = ct.module_scheme(qc, module)
        bits = int(wargs["num_bits"])
        q, scale, zp = ct.read_module(t, bits)
        k = q.shape[1]
        gs = k if wargs.get("strategy") == "channel" else int(wargs["group_size"])
        if k % gs or tuple(scale.shape) != (q.shape[0], k // gs):
            raise InputError(f"weight_scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}")
        g_idx = t.get("weight_g_idx")
        return QuantWeight(q, scale, _symmetric_zero(zp), bits, gs, None if g_idx is None else g_idx.to(torch.int32))
    if method == "awq":
        from ..formats.awq import read_awq_module

        if not {"qweight", "qzeros", "scales"} <= set(t):
            raise InputError("lacks qweight/qzeros/scales")
        q, scale, zp = read_awq_module(t)
        gs = int(qc.get("group_size", 128))
        gs = q.shape[1] if gs == -1 else gs
        if q.shape[1] % gs or scale.shape[1] != q.shape[1] // gs:
            raise InputError(f"scales shape {tuple(scale.shape)} does not match group_size {gs}")
        return QuantWeight(q, scale, _symmetric_zero(zp), 4, gs)
    if method == "gptq":
        from ..formats.gptq import read_gptq_module, sniff_checkpoint_format

        if not {"qweight", "qzeros", "scales", "g_idx"} <= set(t):
            raise InputError("lacks qweight/qzeros/scales/g_idx")
        bits = int(qc["bits"])
        fmt = qc.get("checkpoint_format", "gptq")
        if qc.get("sym", True):  # vLLM PR #38966: some v2 checkpoints declare v1; trust the stored zeros
            fmt = sniff_checkpoint_format(t["qzeros"], bits) or fmt
        q, scale, zp, g_idx = read_gptq_module(t, bits, fmt)
        k, n_groups = q.shape[1], scale.shape[1]
        gs = int(qc.get("group_size", -1))
        gs = k if gs in (-1, 0) or n_groups == 1 else gs
        if -(-k // gs) != n_groups:
            raise InputError(f"scales has {n_groups} groups, expected {-(-k // gs)} for group_size {gs}")
        return QuantWeight(q, scale, _symmetric_zero(zp), bits, gs, g_idx)
    raise InputError(f"quant_method {method!r} is not one the runtime reads (compressed-tensors, awq, gptq)")
