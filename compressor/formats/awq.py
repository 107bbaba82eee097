"""AutoAWQ "GEMM" checkpoint layout (``quant_method: "awq"``, ``version: "gemm"``).

Matched against (read, not copied):

* casper-hansen/AutoAWQ ``awq/modules/linear/gemm.py`` @030fe2a (``WQLinear_GEMM``: buffer
  shapes, ``from_linear`` packing loop ``qweight[:, col] |= intweight[:, col*8 + order_map[i]]
  << (i*4)`` with ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``, the same loop for ``qzeros``).
* casper-hansen/AutoAWQ ``awq/utils/packing_utils.py`` @7ee2873 (``unpack_awq``,
  ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``, ``dequantize_gemm``: ``(q - z) * s``,
  no zero-point off-by-one).
* vllm-project/compressed-tensors 0.20.1
  ``entrypoints/convert/converters/autoawq.py`` (``AutoAWQConverter``: ``q_ct = q_awq - 8``,
  ``zp_ct = z_awq - 8``) -- cross-checked in ``tests/test_formats.py``.
* casper-hansen/AutoAWQ ``awq/models/_config.py`` @024d960 (``AwqConfig.to_transformers_dict``).
* ``docs/formats.md`` (AutoAWQ GEMM and the side-by-side table).

Per quantized Linear (4-bit only, ``G = in // group_size``):

========== ============================= =================================================
tensor     shape / dtype                 content
========== ============================= =================================================
qweight    int32 ``[in, out // 8]``      unsigned ``u = q + 8``, transposed to ``[in, out]``
                                         and packed along the **output** dim; nibble slot
                                         ``i`` (bits ``4i..4i+3``) of word ``c`` holds output
                                         column ``8c + AWQ_ORDER[i]``
qzeros     int32 ``[G, out // 8]``       unsigned zero ``z = zp + 8`` (8 when symmetric),
                                         same packing
scales     ``[G, out]`` (fp16 default)   per-group scale
========== ============================= =================================================
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .base import (QuantWeight, WeightFormat, check_float16_weight_format, dynamic_act_order, recipe_schemes,
                   require_leaves, symmetric_zero)
from .packing import count_outside as _count_outside
from .packing import pack_rows
from .packing import row_blocks as _row_blocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)
_OFFSET = 8


@torch.no_grad()
def _pack_awq_cols(values: torch.Tensor, offset: int) -> torch.Tensor:
    """Nibbles ``values + offset`` (``[rows, cols]``, cols % 8 == 0, each in 0..15)
    -> int32 ``[rows, cols // 8]`` in AWQ order (slot ``i`` holds column ``8c + AWQ_ORDER[i]``).

    The columns are permuted into AWQ order, then packed sequentially by the shared
    dense packer (:func:`~compressor.formats.packing.pack_rows`, 4 bits).
    """
    rows, cols = values.shape
    perm = torch.arange(cols).reshape(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)
    return pack_rows(values[:, perm], 4, offset)


@torch.no_grad()
def _unpack_awq_cols(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_awq_cols`: int32 ``[rows, n]`` -> int64 ``[rows, 8n]`` in ``[0, 15]``."""
    rows, n = words.shape
    out = torch.empty(rows, n * 8, dtype=torch.int64)
    rev = list(AWQ_REVERSE_ORDER)
    for r0, r1 in _row_blocks(rows, n * 8):
        slots = ((words[r0:r1].to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> _SHIFTS) & 0xF
        out[r0:r1] = slots[:, :, rev].reshape(r1 - r0, n * 8)
    return out


@torch.no_grad()
def awq_module_tensors(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float16,
) -> dict[str, torch.Tensor]:
    """The stored AutoAWQ GEMM tensors of one quantized Linear (names without the module prefix).

    Args:
        q: int8 ``[out, in]``, signed 4-bit values in ``[-8, 7]``.
        scale: float ``[out, G]``, ``G = in // group_size``.
        zero_point: int8 ``[out, G]`` in ``[-8, 7]``, or ``None`` (symmetric, stored as z = 8).
        group_size: positive divisor of ``in`` (``-1`` is refused, see
            :func:`check_awq_compatible`).
        dtype: storage dtype of ``scales`` (AutoAWQ uses fp16).

    Returns:
        ``{"qweight": int32 [in, out // 8], "qzeros": int32 [G, out // 8],
        "scales": dtype [G, out]}``.

    Raises:
        InputError: ``group_size`` not positive or not dividing ``in``, ``out % 8 != 0``,
            shape mismatches, or values outside ``[-8, 7]`` (checked before packing, so no
            nibble can bleed into its neighbour).

    Source: AutoAWQ ``WQLinear_GEMM.from_linear`` (see the module docstring).
    """
    if q.ndim != 2:
        raise InputError(f"q must be 2-D [out, in], got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise InputError(f"q must be an integer tensor, got {q.dtype}")
    out_f, in_f = q.shape
    if group_size is None or int(group_size) <= 0:
        raise InputError(
            f"AWQ GEMM format cannot represent group_size {group_size} (per-channel); use a positive group size"
        )
    gs = int(group_size)
    if in_f % gs:
        raise InputError(f"AWQ GEMM needs group_size {gs} to divide in_features {in_f}")
    if out_f % 8:
        raise InputError(f"AWQ GEMM needs out_features % 8 == 0, got {out_f}")
    n_groups = in_f // gs
    if tuple(scale.shape) != (out_f, n_groups):
        raise InputError(f"scale has shape {tuple(scale.shape)}, expected {(out_f, n_groups)}")
    bad = _count_outside(q, -8, 7)
    if bad:
        raise InputError(f"{bad} quantized values lie outside the int4 range [-8, 7]")
    if zero_point is None:
        zp = torch.zeros(out_f, n_groups, dtype=torch.int64)
    else:
        if tuple(zero_point.shape) != (out_f, n_groups):
            raise InputError(f"zero_point has shape {tuple(zero_point.shape)}, expected {(out_f, n_groups)}")
        bad = _count_outside(zero_point, -8, 7)
        if bad:
            raise InputError(f"{bad} zero points lie outside the int4 range [-8, 7]")
        zp = zero_point
    return {
        "qweight": _pack_awq_cols(q.t(), _OFFSET),
        "qzeros": _pack_awq_cols(zp.t(), _OFFSET),
        "scales": scale.t().to(dtype).contiguous(),
    }


@torch.no_grad()
def read_awq_module(
    tensors: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`awq_module_tensors`.

    Args:
        tensors: ``qweight`` int32 ``[in, out // 8]``, ``scales`` ``[G, out]`` and (unless the
            checkpoint has ``zero_point: false``) ``qzeros`` int32 ``[G, out // 8]``.

    Returns:
        ``(q int8 [out, in], scale [out, G] in the stored dtype, zero_point int8 [out, G])``;
        ``zero_point`` is ``None`` only when ``qzeros`` is absent (AutoAWQ's
        ``zero_point=False`` path: values are offset by 8 with an implicit zero).

    Raises:
        InputError: a missing tensor or inconsistent shapes.

    Source: AutoAWQ ``packing_utils.py`` ``unpack_awq`` / ``reverse_awq_order`` /
    ``dequantize_gemm`` (and the same steps in compressed-tensors' ``AutoAWQConverter``).
    """
    for name in ("qweight", "scales"):
        if name not in tensors:
            raise InputError(f"AWQ module is missing tensor {name!r}")
    qweight, scales = tensors["qweight"], tensors["scales"]
    if qweight.ndim != 2 or scales.ndim != 2:
        raise InputError("AWQ qweight and scales must be 2-D")
    in_f, out_f = int(qweight.shape[0]), int(qweight.shape[1]) * 8
    n_groups = int(scales.shape[0])
    if int(scales.shape[1]) != out_f or n_groups == 0 or in_f % n_groups:
        raise InputError(
            f"AWQ scales shape {tuple(scales.shape)} does not fit qweight {tuple(qweight.shape)} "
            f"(expected [G, {out_f}] with G dividing {in_f})"
        )
    q = (_unpack_awq_cols(qweight) - _OFFSET).t().contiguous().to(torch.int8)
    zp = None
    if "qzeros" in tensors:
        qzeros = tensors["qzeros"]
        if tuple(qzeros.shape) != (n_groups, out_f // 8):
            raise InputError(f"AWQ qzeros has shape {tuple(qzeros.shape)}, expected {(n_groups, out_f // 8)}")
        zp = (_unpack_awq_cols(qzeros) - _OFFSET).t().contiguous().to(torch.int8)
    return q, scales.t().contiguous(), zp


def awq_quantization_config(group_size: int, modules_to_not_convert: list[str] | None) -> dict:
    """``config.json["quantization_config"]`` of an AutoAWQ GEMM artifact.

    Same keys as AutoAWQ's ``AwqConfig.to_transformers_dict`` (``awq/models/_config.py``):
    ``{"quant_method": "awq", "zero_point": true, "group_size": g, "bits": 4,
    "version": "gemm", "modules_to_not_convert": [...] | null}``.
    """
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": int(group_size),
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None if modules_to_not_convert is None else list(modules_to_not_convert),
    }


def check_awq_compatible(
    num_bits: int,
    group_size: int,
    out_features_list: list[int],
    act_order_g_idx: bool,
    mixed: bool,
) -> None:
    """Refuse recipes an AutoAWQ GEMM checkpoint cannot hold.

    Raises:
        InputError: one line naming the first reason: not 4-bit; ``group_size == -1``
            (per-channel is not representable -- AutoAWQ GEMM stores groups only) or not
            positive; an ``out_features`` not divisible by 8; an act-order ``g_idx``
            (dynamic act-order cannot be stored: the format has no ``g_idx``); mixed
            precision (one ``bits``/``group_size`` for the whole model).

    Source: AutoAWQ ``WQLinear_GEMM.__init__`` (4-bit only, ``out_features % 8`` assert;
    no ``g_idx`` buffer) and ``AwqConfig`` (a single ``w_bit``/``q_group_size``).
    """
    if num_bits != 4:
        raise InputError(f"AWQ GEMM format supports 4-bit weights only, got {num_bits}-bit")
    if group_size == -1:
        raise InputError(
            "AWQ GEMM format cannot represent group_size -1 (per-channel); use a positive group size such as 128"
        )
    if group_size is None or int(group_size) <= 0:
        raise InputError(f"AWQ GEMM format needs a positive group_size, got {group_size}")
    bad = sorted({int(o) for o in out_features_list if int(o) % 8})
    if bad:
        raise InputError(f"AWQ GEMM format needs out_features divisible by 8; got {bad}")
    if act_order_g_idx:
        raise InputError("AWQ GEMM format cannot store an act-order g_idx (dynamic act-order); disable act-order")
    if mixed:
        raise InputError("AWQ GEMM format cannot represent mixed precision (one bits/group_size for all modules)")


class AwqFormat(WeightFormat):
    """``--format awq``: AutoAWQ GEMM ``qweight``/``qzeros``/``scales``, 4-bit, float16 scales."""

    name = "awq"
    quant_method = "awq"
    scale_dtype = "float16"
    leaves = ("qweight", "qzeros", "scales")
    marker = "qweight"

    def check(self, recipe, dtype_name: str) -> None:
        """Refuse KV-only and static-KV recipes, a dtype other than float16, and what
        :func:`check_awq_compatible` refuses (bits other than 4, per-channel groups, a
        ``g_idx``, mixed precision). Raises InputError."""
        check_float16_weight_format(self, recipe, dtype_name)
        for s in recipe_schemes(recipe):
            check_awq_compatible(s.num_bits, s.group_size if s.group_size != "auto" else 128, [8],
                                 dynamic_act_order(recipe), recipe.is_mixed)

    def check_shapes(self, out_features: dict[str, int]) -> None:
        """AWQ packs 8 output channels per word.

        Raises:
            InputError: names the first module whose ``out_features`` is not a multiple of 8.
        """
        bad = [n for n, o in out_features.items() if o % 8]
        if bad:
            raise InputError(f"--format awq needs out_features divisible by 8; {bad[0]} has {out_features[bad[0]]}")

    def pack(self, rec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """:func:`awq_module_tensors` of the record, scales in float16 whatever ``dtype``."""
        return awq_module_tensors(rec.q, rec.scale, rec.zero_point, rec.group_size, torch.float16)

    def read(self, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
        """Read ``qweight``/``qzeros``/``scales`` (4-bit) with the config's ``group_size`` (default 128).

        Raises:
            InputError: a tensor missing or shapes inconsistent with ``group_size``.
        """
        require_leaves(t, self.leaves)
        q, scale, zp = read_awq_module(t)
        gs = int(qc.get("group_size", 128))
        gs = q.shape[1] if gs == -1 else gs
        if q.shape[1] % gs or scale.shape[1] != q.shape[1] // gs:
            raise InputError(f"scales shape {tuple(scale.shape)} does not match group_size {gs}")
        return QuantWeight(q, scale, symmetric_zero(zp), 4, gs)

    def declared(self, qc: dict) -> list[dict]:
        """``bits`` (AutoAWQ's older ``w_bit``), ``group_size`` (``q_group_size``), ``zero_point``."""
        return [{"num_bits": qc.get("bits", qc.get("w_bit", 4)), "group_size": qc.get("group_size", qc.get("q_group_size", 128)),
                 "symmetric": not qc.get("zero_point", True)}]

    def config(self, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict,
               embeddings: dict[str, tuple[int, int, bool]] | None = None) -> dict:
        """:func:`awq_quantization_config` of the (single) scheme's group size; ``ignored``
        becomes ``modules_to_not_convert`` (``null`` when empty)."""
        bits, gs, sym = next(iter(schemes.values()))[:3]
        return awq_quantization_config(gs, ignored or None)
