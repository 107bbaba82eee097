"""Quantized Linear layers, one class per kernel, and the rule that picks one.

Every class computes ``y [..., N] = x [..., K] @ W.T (+ bias)`` for ``W ≈ (q - zero_point)
* scale`` (:class:`~compressor.formats.base.QuantWeight`), keeping the integer (or FP8) codes
and never a float copy of the weight. A weight whose artifact quantizes its input (FP8 W8A8:
dynamic fp8 per token or per group; W4A8: per token; ``QuantWeight.act``) has ``x`` quantized
first, by the base class, whatever the kernel:

====================  ==================================================  =======================
kernel                what runs                                           serves
====================  ==================================================  =======================
``float``             ``F.linear`` (unquantized module)                   any float weight
``dequant``           dequantize the layer's int8 codes on each call,     any bits, group,
                      then ``F.linear``: the reference numerics           ``g_idx``, device
``aten-int4``         ``torch.ops.aten._weight_int4pack_mm_for_cpu``      CPU, 4 bit, groups of a
                                                                          multiple of 32 (per
                                                                          channel too),
                                                                          ``N % 16 == 0``
``aten-int8``         ``torch.ops.aten._weight_int8pack_mm`` (+ a         CPU, 8 bit per channel,
                      zero-point correction when asymmetric)              ``K % 8 == 0``
``triton-w4a16``      fused W4A16 Triton kernel                           CUDA, 4 bit,
                      (:mod:`~compressor.runtime.triton_kernels`)         ``K % 8 == 0``
``fp8-emulated``      dequantize the e4m3 codes on each call, float32     every FP8 weight, any
                      ``F.linear`` (:class:`Fp8Linear`)                   backend and device
``int-fp8-emulated``  dequantize the integer codes on each call, float32  integer weights with fp8
                      ``F.linear`` (:class:`IntFp8Linear`)                inputs (W4A8), any
                                                                          backend and device
``nvfp4-emulated``    dequantize the e2m1 codes on each call, then        every NVFP4 weight, any
                      ``F.linear`` (:mod:`.fp4_linear`)                   backend and device
``mxfp4-emulated``    the same, E8M0 scales per 32 inputs                 every MXFP4 weight, any
                      (:mod:`.fp4_linear`)                                backend and device
====================  ==================================================  =======================

An NVFP4 weight whose input is quantized too (W4A4) gets ``nvfp4-a4-emulated`` (:mod:`.fp4_linear`): the input
quantized per 16 over its static global scale, then the float32 ``F.linear`` of ``fp8-emulated``.

The aten ops: ``_convert_weight_to_int4pack_for_cpu(u int32 [N, K], innerKTiles)`` takes
unsigned codes ``u = q + 8`` (its output layout is opaque); ``_weight_int4pack_mm_for_cpu(x
[M, K] contiguous, packed, group_size, qScaleAndZeros [K / group_size, N, 2])`` computes
``w = (u - 8) * scale + zero`` with ``group_size`` in 32/64/128/256 (measured on torch
2.13), so kvq's integer zero point maps exactly to the float offset ``zero = -zero_point *
scale``, and a larger group (per channel) is served by repeating its scale over sub-groups.
``_weight_int8pack_mm(x, q int8 [N, K], scale [N])`` computes ``x @ (q * scale).T``; an
asymmetric zero point adds ``- sum(x) * zero_point * scale``.

Both ops run their vectorized paths for **bfloat16** activations only: with float32
activations they are 5-15x slower than ``F.linear`` on an AVX2 CPU, so these layers cast
activations (and scales) to bfloat16 by default (``act_dtype``) and the result back. That
is the only numerical difference from the ``dequant`` reference (bfloat16 rounding of
activations, scales and outputs), and only for decode-sized calls. The ops win for a few
rows, where weight streaming dominates (one core, batch 1, 576x1536 and 1536x576 layers,
weights streamed from memory: int4 op 0.14-0.15 ms, int8 op 0.20-0.22 ms, float32
``F.linear`` 0.27-0.32 ms) and lose from about 32 rows on, where the work is compute-bound
(64 rows: op 2.8-3.3 ms, dequantize + ``F.linear`` 2.5-3.1 ms); from ``DEQUANT_MIN_M`` rows
on these layers dequantize their codes and call ``F.linear``, with the ``dequant`` numerics
(bfloat16 inputs multiplied in float32 and rounded back: CPU bfloat16 GEMMs are slow).

Kernel choice (:func:`make_linear`) walks the candidates of the requested backend in
order and takes the first that serves the layer; each skipped kernel's reason is kept
(``Linear.fallback_reason``) so callers can report why a layer fell back. The bases (:class:`Linear`,
:class:`QuantLinear`, :class:`DequantLinear`) live in :mod:`.linear_base`, the e2m1 kernels in :mod:`.fp4_linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..formats.base import QuantWeight
from ..quant.fp8 import dequantize_weight as dequantize_fp8_weight
from .fp4_linear import fp4_linear
from .linear_base import DequantLinear, Linear, QuantLinear

BACKENDS = ("auto", "aten", "dequant", "triton")
AT_INT4_GROUPS = (32, 64, 128, 256)
#: from this many rows on (prefill) the aten layers dequantize and run float F.linear
#: instead of the weight-only op (measured crossover on one AVX2 core, see the docstring)
DEQUANT_MIN_M = 32


class FloatLinear(Linear):
    """Unquantized module: ``F.linear`` in the compute dtype (bit-identical to transformers)."""

    kernel = "float"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], None, None)
        self.weight, self.bias_f = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias_f)

    def _dense(self, dtype):
        return self.weight.to(dtype)

    def _stored(self):
        return [self.weight, self.bias_f]


class Fp8Linear(QuantLinear):
    """FP8 W8A8 emulated: the e4m3 codes and their float32 scales kept (one byte per weight), the
    weight dequantized on each call and multiplied in float32 with the input quantized by the base
    class (``act``): the numerics of vLLM's FP8 GEMMs (products of e4m3 values scaled per token or
    group and per channel or block, accumulated in float32) up to the order of the sums. Serves every
    FP8 weight, on any device (no FP8 tensor cores are used)."""

    kernel = "fp8-emulated"
    quantized_input_dtype = torch.float32

    def __init__(self, w: QuantWeight, bias, device, in_perm=None):
        super().__init__(w.in_features, w.out_features, bias, in_perm)
        self.q, self.scale = w.q.to(device), w.scale.float().to(device)
        self.group_size, self.rows = w.group_size, w.rows

    @classmethod
    def unsupported(cls, w, device):
        return None if w.is_float else f"{w.num_bits}-bit integer weights (this kernel serves FP8 e4m3)"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to :func:`~compressor.quant.fp8.dequantize_weight`."""
        return dequantize_fp8_weight(self.q, self.scale, self.group_size, self.rows, dtype)

    def _mm(self, x2):  # float32 out; the base casts to the input's dtype
        return F.linear(x2.float(), self.dequantized(torch.float32))

    def _stored(self):
        return [self.q, self.scale, self.bias]


class IntFp8Linear(DequantLinear):
    """Integer weights with fp8 inputs (W4A8) emulated: the integer codes kept as :class:`DequantLinear`
    keeps them, dequantized on each call and multiplied in float32 with the input quantized by the base
    class (``act``: dynamic fp8 per token), as :class:`Fp8Linear` multiplies: the numerics of vLLM's W4A8
    GEMM (fp8 inputs scaled per token, weights per group, float32 accumulation) up to the order of the sums
    and its own rounding of the group scales (docs/formats.md). Serves every integer weight whose input
    is quantized, on any backend and device (the aten and Triton kernels take 16-bit inputs)."""

    kernel = "int-fp8-emulated"
    quantized_input_dtype = torch.float32

    @classmethod
    def unsupported(cls, w, device):
        return None if w.act and not w.is_float else "integer weights with a quantized input (W4A8) only"

    def _mm(self, x2):  # float32 out; the base casts to the input's dtype
        return F.linear(x2.float(), self.dequantized(torch.float32))


def _op_group(group_size: int) -> int | None:
    """The largest group size the aten int4 op serves that divides ``group_size`` (None: none does)."""
    return next((g for g in sorted(AT_INT4_GROUPS, reverse=True) if group_size % g == 0), None)


def _wide_linear(x2: torch.Tensor, dequantized) -> torch.Tensor:
    """Prefill-sized ``x2 [M, K] @ W.T`` on CPU by dequantize + ``F.linear``; bfloat16 inputs
    are multiplied in float32 and the result rounded back (CPUs without native bfloat16
    matmuls run the float32 GEMM several times faster; the product is at least as exact)."""
    if x2.dtype == torch.bfloat16:
        return F.linear(x2.float(), dequantized(torch.float32)).to(torch.bfloat16)
    return F.linear(x2, dequantized(x2.dtype))


def _aten_op(name: str):
    return getattr(torch.ops.aten, name, None)


def _int4_mm(x2: torch.Tensor, packed: torch.Tensor, op_group: int, scale_zeros: torch.Tensor,
             act_dtype: torch.dtype) -> torch.Tensor:
    """``x2 [M, K]`` times an aten int4 pack (activations cast to ``act_dtype`` inside the op),
    returned in ``x2``'s dtype."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(act_dtype).contiguous(), packed, op_group, scale_zeros)
    return y.to(x2.dtype)


class AtenInt4Linear(QuantLinear):
    """CPU int4 via ``_weight_int4pack_mm_for_cpu`` (see the module docstring for the layout).

    The op is the decode kernel: from ``DEQUANT_MIN_M`` rows on (prefill), dequantizing
    the layer once and running float ``F.linear`` is faster, so the layer also keeps its
    codes as unsigned nibble pairs ``[N, K/2]`` (byte ``j`` holds column ``2j`` in the low
    and ``2j+1`` in the high nibble; the aten layout is opaque) for that path, whose
    numerics are the ``dequant`` kernel's.
    """

    kernel = "aten-int4"

    def __init__(self, w: QuantWeight, bias, device, in_perm=None, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__(w.in_features, w.out_features, bias, in_perm)
        u = (w.q.to(torch.int32) + 8).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        s = w.scale.float()
        zero = torch.zeros_like(s) if w.zero_point is None else -w.zero_point.float() * s
        self.op_group = _op_group(w.group_size)  # a larger group (per channel) is split into equal sub-groups
        rep = w.group_size // self.op_group
        sz = torch.stack([s.t(), zero.t()], dim=-1).repeat_interleave(rep, dim=0)
        self.scale_zeros = sz.to(act_dtype).contiguous()  # [K / op_group, N, 2]
        self.group_size, self.act_dtype = w.group_size, act_dtype
        u8 = u.to(torch.uint8)
        self.nibbles = (u8[:, 0::2] | (u8[:, 1::2] << 4)).contiguous()  # [N, K/2]
        self.scale = w.scale
        zp = torch.zeros_like(s, dtype=torch.int8) if w.zero_point is None else w.zero_point
        self.zero_u = (zp.to(torch.int16) + 8).to(torch.uint8)  # [N, G] unsigned zero point

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to :func:`~compressor.quant.primitives.dequantize`."""
        n, k, gs = self.out_features, self.in_features, self.group_size
        u = torch.stack((self.nibbles & 15, self.nibbles >> 4), dim=-1).reshape(n, k // gs, gs)
        w = u.float().sub_(self.zero_u.float().unsqueeze(-1)).mul_(self.scale.float().unsqueeze(-1))  # one buffer
        return w.reshape(n, k).to(dtype)

    @classmethod
    def unsupported(cls, w, device):
        if device.type != "cpu":
            return "aten int4 op is the CPU kernel"
        if _aten_op("_weight_int4pack_mm_for_cpu") is None:
            return "this torch has no _weight_int4pack_mm_for_cpu"
        if w.num_bits != 4:
            return f"{w.num_bits}-bit weights (aten int4 serves 4 bits)"
        if w.g_idx is not None:
            return "act-order g_idx with unequal groups"
        if _op_group(w.group_size) is None:
            return f"group size {w.group_size} (aten int4 serves {'/'.join(map(str, AT_INT4_GROUPS))} or multiples of 32)"
        if w.out_features % 16 or w.in_features % w.group_size:
            return f"shape [{w.out_features}, {w.in_features}] (needs out_features % 16 == 0)"
        return None

    #: set by :class:`FusedDecode`: (the fused set, this layer's first output column); the
    #: set then holds this layer's decode pack and its bytes are counted in ``fused_bytes``
    fused: tuple | None = None
    fused_bytes = 0

    def codes(self) -> torch.Tensor:
        """Unsigned codes ``u = q + 8``, int32 ``[N, K]`` (what the aten packer takes)."""
        n, k = self.out_features, self.in_features
        return torch.stack((self.nibbles & 15, self.nibbles >> 4), dim=-1).reshape(n, k).to(torch.int32)

    def _mm(self, x2):
        if x2.shape[0] >= DEQUANT_MIN_M:
            return _wide_linear(x2, self.dequantized)
        if self.fused is not None:  # decode pack held by the fused set: run it, keep this layer's columns
            owner, col = self.fused
            return owner.matmul(x2)[:, col:col + self.out_features]
        return _int4_mm(x2, self.packed, self.op_group, self.scale_zeros, self.act_dtype)

    @property
    def weight_bytes(self) -> int:
        return super().weight_bytes + self.fused_bytes

    def _stored(self):
        return [self.packed, self.scale_zeros, self.nibbles, self.scale, self.zero_u, self.bias]


class FusedDecode:
    """Several :class:`AtenInt4Linear` layers that read the same input (``q/k/v_proj``,
    ``gate/up_proj``), served at decode by **one** ``_weight_int4pack_mm_for_cpu`` call.

    The parts' packed weights and scales are concatenated along the output dim (``N`` =
    the sum of the parts'), so the product is, column for column, what each part's own
    call returns (the op's inner loop is per output column); each part then holds no decode
    pack of its own (no bytes are duplicated) and a direct call of a part runs the fused op
    and keeps its columns. Prefill-sized calls (``DEQUANT_MIN_M`` rows on) go to each
    part's dequantize + ``F.linear`` path as before. Saves per decode step and layer two
    op launches for attention and one for the MLP (measured on a 2-core Xeon, one token:
    q+k+v 34 us as three calls, 22 us as one; gate+up 58 us against 44 us).
    """

    def __init__(self, parts: list[AtenInt4Linear]):
        self.parts = parts
        self.in_features, self.act_dtype, self.op_group = parts[0].in_features, parts[0].act_dtype, parts[0].op_group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([p.codes() for p in parts]), 1)
        self.scale_zeros = torch.cat([p.scale_zeros for p in parts], dim=1).contiguous()  # [K / op_group, N, 2]
        col = 0
        for p in parts:
            p.fused_bytes = sum(t.numel() * t.element_size() for t in (p.packed, p.scale_zeros))
            p.packed = p.scale_zeros = None
            p.fused, col = (self, col), col + p.out_features

    @classmethod
    def of(cls, parts: list) -> "FusedDecode | None":
        """The fused set of ``parts``, or None when they cannot share one call (not all aten
        int4, an act-order input permutation, or another input width, group or act dtype)."""
        if len(parts) < 2 or not all(type(p) is AtenInt4Linear and p.in_perm is None and p.fused is None
                                     and not p.act[0] for p in parts):
            return None
        first = parts[0]
        if any((p.in_features, p.op_group, p.act_dtype) != (first.in_features, first.op_group, first.act_dtype)
               for p in parts):
            return None
        return cls(parts)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K]`` -> ``[M, sum N]`` (decode rows), in ``x2``'s dtype, biases not added."""
        return _int4_mm(x2, self.packed, self.op_group, self.scale_zeros, self.act_dtype)

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's output for ``x [..., K]`` (``[..., N_i]``; views of one buffer at decode)."""
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= DEQUANT_MIN_M:
            return [p(x) for p in self.parts]
        ys = self.matmul(x2).split([p.out_features for p in self.parts], dim=-1)
        lead = x.shape[:-1]
        return [y.reshape(*lead, p.out_features) if p.bias is None else y.reshape(*lead, p.out_features) + p.bias
                for y, p in zip(ys, self.parts)]


class AtenInt8Linear(QuantLinear):
    """CPU int8 per channel via ``_weight_int8pack_mm``; asymmetric zero points by a rank-1 correction."""

    kernel = "aten-int8"

    def __init__(self, w: QuantWeight, bias, device, in_perm=None, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__(w.in_features, w.out_features, bias, in_perm)
        self.q = w.q.contiguous()
        s = w.scale.float().reshape(-1)
        self.scale = s.to(act_dtype)
        # y = x @ ((q - zp) * s).T = x @ (q * s).T - sum(x) * (zp * s)
        self.offset = None if w.zero_point is None else (w.zero_point.float().reshape(-1) * s)
        self.scale_f, self.zp = s, None if w.zero_point is None else w.zero_point.reshape(-1)
        self.act_dtype = act_dtype

    @classmethod
    def unsupported(cls, w, device):
        if device.type != "cpu":
            return "aten int8 op is the CPU kernel"
        if _aten_op("_weight_int8pack_mm") is None:
            return "this torch has no _weight_int8pack_mm"
        if w.num_bits != 8:
            return f"{w.num_bits}-bit weights (aten int8 serves 8 bits)"
        if not w.per_channel or w.g_idx is not None:
            return f"group size {w.group_size} (aten int8 serves per-channel scales)"
        if w.in_features % 8:  # torch 2.13 crashes or returns garbage otherwise (measured)
            return f"in_features {w.in_features} not a multiple of 8"
        return None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """Float ``[N, K]`` weight, bit-identical to :func:`~compressor.quant.primitives.dequantize`."""
        w = self.q.float() if self.zp is None else self.q.float().sub_(self.zp.float()[:, None])
        return w.mul_(self.scale_f[:, None]).to(dtype)

    def _mm(self, x2):
        if x2.shape[0] >= DEQUANT_MIN_M:
            return _wide_linear(x2, self.dequantized)
        y = torch.ops.aten._weight_int8pack_mm(x2.to(self.act_dtype).contiguous(), self.q, self.scale).to(x2.dtype)
        if self.offset is not None:
            y = y - (x2.float().sum(-1, keepdim=True) * self.offset).to(x2.dtype)
        return y

    def _stored(self):
        return [self.q, self.scale, self.offset, self.zp, self.bias]


class TritonW4Linear(QuantLinear):
    """CUDA W4A16 through :func:`~compressor.runtime.triton_kernels.w4a16_matmul`."""

    kernel = "triton-w4a16"

    def __init__(self, w: QuantWeight, bias, device, in_perm=None, act_dtype: torch.dtype = torch.float16):
        from .triton_kernels import pack_w4

        super().__init__(w.in_features, w.out_features, bias, in_perm)
        qw, s, z = pack_w4(w.q, w.scale, w.zero_point, act_dtype)
        self.qweight, self.scales, self.zeros = qw.to(device), s.to(device), z.to(device)
        self.group_size = w.group_size

    @classmethod
    def unsupported(cls, w, device):
        from .triton_kernels import interpreting, triton_available

        if device.type != "cuda" and not interpreting():
            return "Triton kernels run on CUDA (or under TRITON_INTERPRET=1)"
        if not triton_available():
            return "triton is not installed"
        if w.num_bits != 4:
            return f"{w.num_bits}-bit weights (the Triton kernel serves 4 bits)"
        if w.g_idx is not None:
            return "act-order g_idx with unequal groups"
        if w.in_features % 8 or w.in_features % w.group_size:
            return f"in_features {w.in_features} not a multiple of 8 and of the group size"
        return None

    def _mm(self, x2):
        from .triton_kernels import w4a16_matmul

        return w4a16_matmul(x2.to(self.scales.dtype), self.qweight, self.scales, self.zeros, self.group_size).to(x2.dtype)

    def _dense(self, dtype):
        from .triton_kernels import unpack_w4

        gs = self.group_size
        u = unpack_w4(self.qweight).float()
        return ((u - self.zeros.float().repeat_interleave(gs, dim=1)) * self.scales.float().repeat_interleave(gs, dim=1)).to(dtype)

    def _stored(self):
        return [self.qweight, self.scales, self.zeros, self.bias]


#: backend -> device type -> kernels tried in order (the last one always serves)
CANDIDATES: dict[str, dict[str, tuple[type[QuantLinear], ...]]] = {
    "auto": {"cpu": (AtenInt4Linear, AtenInt8Linear, DequantLinear), "cuda": (TritonW4Linear, DequantLinear)},
    "aten": {"cpu": (AtenInt4Linear, AtenInt8Linear, DequantLinear)},
    "triton": {"cpu": (TritonW4Linear, DequantLinear), "cuda": (TritonW4Linear, DequantLinear)},
    "dequant": {"cpu": (DequantLinear,), "cuda": (DequantLinear,)},
}


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse a backend that cannot run on ``device`` at all.

    Raises:
        InputError: unknown backend; ``aten`` off CPU; ``triton`` without the package,
            or on CPU outside the interpreter (``TRITON_INTERPRET=1``).
    """
    from .triton_kernels import interpreting, triton_available

    if backend not in BACKENDS:
        raise InputError(f"unknown runtime backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"the runtime runs on cpu or cuda, not {device.type}")
    if backend == "aten" and device.type != "cpu":
        raise InputError("backend 'aten' (torch's packed int4/int8 CPU ops) needs --device cpu; use 'triton' or 'auto' on CUDA")
    if backend == "triton":
        if not triton_available():
            raise InputError("backend 'triton' needs the 'triton' package (pip install kvq-compressor[triton])")
        if device.type != "cuda" and not interpreting():
            raise InputError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1: Triton's CPU interpreter, "
                             "for checking the kernels on tiny models; far too slow for a real one)")


def make_linear(w: QuantWeight | torch.Tensor, bias: torch.Tensor | None, backend: str, device: torch.device,
                dtype: torch.dtype, act_dtype: torch.dtype | None = None) -> Linear:
    """The Linear for one module: float weights -> :class:`FloatLinear`; packed ones -> the
    first kernel of ``CANDIDATES[backend][device.type]`` that serves it.

    Args:
        w: a float ``[N, K]`` weight or a :class:`QuantWeight`.
        bias: float ``[N]`` or None.
        backend: one of :data:`BACKENDS` (checked by :func:`check_backend`).
        device, dtype: where and in which compute dtype the layer runs.
        act_dtype: activation dtype inside the aten/Triton kernels (default: bfloat16 for
            aten, ``dtype`` for Triton when it is half precision, else float16).

    The returned layer's ``fallback_reason`` names why earlier candidates were skipped
    (None when the first candidate served).
    """
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if isinstance(w, torch.Tensor):
        return FloatLinear(w.to(device=device, dtype=dtype), bias)
    w, perm = w.sorted_by_group()
    perm = None if perm is None else perm.to(device)
    act = (w.act, w.act_group or w.group_size) if w.act else ("", 0)
    if (layer := fp4_linear(w, bias, device, perm)) is not None:
        return layer
    if w.is_float or w.act:  # every backend: the one FP8 kernel, the one W4A8 kernel
        layer = (Fp8Linear if w.is_float else IntFp8Linear)(w, bias, device, perm)
        layer.act = act
        return layer
    reasons = []
    for cls in CANDIDATES[backend][device.type]:
        why = cls.unsupported(w, device)
        if why is not None:
            reasons.append(f"{cls.kernel}: {why}")
            continue
        kw = {}
        if cls is AtenInt4Linear or cls is AtenInt8Linear:
            kw["act_dtype"] = act_dtype or torch.bfloat16
        elif cls is TritonW4Linear:
            kw["act_dtype"] = act_dtype or (dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16)
        layer = cls(w, bias, device, perm, **kw)
        layer.fallback_reason = "; ".join(reasons) or None
        layer.act = act
        return layer
    raise InputError(f"no kernel serves a {w.num_bits}-bit layer on {device.type}")  # unreachable: dequant serves all
