"""GPTQ checkpoint layout (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``), v1 and v2.

Matched against (read, not copied):

* AutoGPTQ/AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` @179776b
  (``QuantLinear.__init__`` buffer shapes, ``pack()`` with the 2/4/8-bit and the 3-bit
  10-1-10-1-10 cross-word scheme, ``zeros -= 1`` before packing, ``zeros + 1`` on load).
* ModelCloud/GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py`` (``pack_original``,
  same layout) and ``gptqmodel/utils/model.py`` @011c00a
  (``convert_gptq_v1_to_v2_format_module`` / ``convert_gptq_v2_to_v1_format_module``;
  newer versions shift 3-bit zeros per logical field, as done here) and
  ``gptqmodel/quantization/config.py`` (``meta`` field names, ``FORMAT.GPTQ_V2``).
* ``docs/formats.md`` (GPTQ and the side-by-side table).

Per quantized Linear (``G`` groups, ``b`` bits, ``in``/``out`` features):

========== ======================================== ==========================================
tensor     shape / dtype                            content
========== ======================================== ==========================================
qweight    int32 ``[ceil(in*b/32), out]``           unsigned ``u = q + 2^(b-1)`` packed along
                                                    the **input** dim as a dense little-endian
                                                    bit stream per output column
qzeros     int32 ``[G, ceil(out*b/32)]``            unsigned zero ``z = zp + 2^(b-1)``, stored
                                                    as ``z - 1`` (v1, ``"gptq"``) or ``z``
                                                    (v2, ``"gptq_v2"``), packed along the
                                                    **output** dim, same bit stream
scales     ``[G, out]`` (fp16 by default)           per-group scale
g_idx      int32 ``[in]``                           group of each input column
========== ======================================== ==========================================

The dense bit stream (element ``j`` at bits ``j*b .. j*b+b-1`` of the concatenated words)
is the same thing as AutoGPTQ's ``32 // b`` values per word for 2/4/8 bits and as its
10-1-10-1-10 three-word scheme for 3 bits (checked bit-for-bit in ``tests/test_formats.py``
against a per-element reference written from the AutoGPTQ loop and against
``compressed_tensors.pack_int32``). Upstream kernels allocate ``in // 32 * b`` rows and
``out // 32 * b`` zero columns, i.e. they need ``in*b`` and ``out*b`` to be multiples of 32;
this writer pads the last word with zero bits otherwise (see :func:`check_gptq_compatible`).

Note: GPTQModel's loader refuses ``sym: false`` with ``checkpoint_format: "gptq"`` unless
``meta.quantizer`` names gptqmodel >= 0.9.0, so asymmetric artifacts are best written as
``"gptq_v2"``.
"""

from __future__ import annotations

import re

import torch

from ..errors import InputError
from ..quant.primitives import qrange
from .packing import count_outside as _count_outside
from .packing import pack_rows, unpack_rows  # noqa: F401  (re-exported: the GPTQ layout's packer)
from .base import (QuantWeight, WeightFormat, check_float16_weight_format, dynamic_act_order, recipe_schemes,
                   require_leaves, symmetric_zero)

SUPPORTED_BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def _check_bits(num_bits: int) -> None:
    if num_bits not in SUPPORTED_BITS:
        raise InputError(f"GPTQ supports 2, 3, 4 or 8 bits, got {num_bits}")


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise InputError(f"GPTQ checkpoint_format must be 'gptq' (v1) or 'gptq_v2', got {checkpoint_format!r}")


def default_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    """The trivial (no act-order) ``g_idx``: int32 ``[in]`` = ``arange(in) // group_size``
    (all zeros for ``group_size = -1``)."""
    gs = in_features if group_size in (-1, 0, None) else int(group_size)
    return (torch.arange(in_features, dtype=torch.int64) // gs).to(torch.int32)


@torch.no_grad()
def gptq_module_tensors(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    num_bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float16,
    checkpoint_format: str = "gptq",
) -> dict[str, torch.Tensor]:
    """The stored GPTQ tensors of one quantized Linear (names without the module prefix).

    Args:
        q: int8 ``[out, in]``, signed values in ``[-2^(b-1), 2^(b-1)-1]``.
        scale: float ``[out, G]`` with ``G = ceil(in / group_size)`` (1 for ``group_size=-1``).
        zero_point: int8 ``[out, G]`` signed, or ``None`` (symmetric: unsigned zero ``2^(b-1)``).
        g_idx: int32/int64 ``[in]`` act-order group of each input column (values in
            ``[0, G)``), or ``None`` for ``arange(in) // group_size``.
        num_bits: 2, 3, 4 or 8.
        group_size: positive, or ``-1`` for one group per row.
        dtype: storage dtype of ``scales``.
        checkpoint_format: ``"gptq"`` (v1, stores ``z - 1``) or ``"gptq_v2"`` (stores ``z``).

    Returns:
        ``{"qweight": int32 [ceil(in*b/32), out], "qzeros": int32 [G, ceil(out*b/32)],
        "scales": dtype [G, out], "g_idx": int32 [in]}``.

    Raises:
        InputError: unsupported bits/format, inconsistent shapes, values outside the
            ``num_bits`` range, a ``g_idx`` entry outside ``[0, G)``, or (v1 only) any
            zero point equal to ``-2^(b-1)`` (unsigned 0), which v1 cannot represent;
            the message gives the count.

    Source: AutoGPTQ ``qlinear_cuda_old.py`` ``pack()``; GPTQModel ``pack_original`` and
    ``convert_gptq_v2_to_v1_format_module`` (see the module docstring).
    """
    _check_bits(num_bits)
    _check_format(checkpoint_format)
    qmin, qmax = qrange(num_bits)
    if q.ndim != 2:
        raise InputError(f"q must be 2-D [out, in], got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise InputError(f"q must be an integer tensor, got {q.dtype}")
    out_f, in_f = q.shape
    if group_size == -1:
        gs = in_f
    elif group_size is None or int(group_size) <= 0:
        raise InputError(f"group_size must be positive or -1, got {group_size}")
    else:
        gs = int(group_size)
    n_groups = -(-in_f // gs)
    if tuple(scale.shape) != (out_f, n_groups):
        raise InputError(
            f"scale has shape {tuple(scale.shape)}, expected {(out_f, n_groups)} for q {tuple(q.shape)} "
            f"and group_size {group_size}"
        )
    bad = _count_outside(q, qmin, qmax)
    if bad:
        raise InputError(f"{bad} quantized values lie outside the int{num_bits} range [{qmin}, {qmax}]")

    if zero_point is None:
        zp = torch.zeros(out_f, n_groups, dtype=torch.int64)
    else:
        if tuple(zero_point.shape) != (out_f, n_groups):
            raise InputError(f"zero_point has shape {tuple(zero_point.shape)}, expected {(out_f, n_groups)}")
        zp = zero_point.to(torch.int64)
        bad = _count_outside(zp, qmin, qmax)
        if bad:
            raise InputError(f"{bad} zero points lie outside the int{num_bits} range [{qmin}, {qmax}]")

    if g_idx is None:
        gi = default_g_idx(in_f, gs)
    else:
        if tuple(g_idx.shape) != (in_f,):
            raise InputError(f"g_idx has shape {tuple(g_idx.shape)}, expected {(in_f,)}")
        bad = _count_outside(g_idx.to(torch.int64), 0, n_groups - 1)
        if bad:
            raise InputError(f"{bad} g_idx entries lie outside the group range [0, {n_groups - 1}]")
        gi = g_idx.to(torch.int32, copy=True).contiguous()

    offset = 1 << (num_bits - 1)
    stored_z = zp + offset  # unsigned zero point, 0 .. 2^b-1
    if checkpoint_format == "gptq":
        n_zero = int((stored_z == 0).sum())
        if n_zero:
            raise InputError(
                f"GPTQ v1 ('gptq') stores zero-1 and cannot represent unsigned zero point 0: "
                f"{n_zero} of {stored_z.numel()} zero points are 0; write checkpoint_format='gptq_v2' "
                f"or quantize symmetrically"
            )
        stored_z = stored_z - 1

    qweight = pack_rows(q, num_bits, offset).t().contiguous()
    qzeros = pack_rows(stored_z.t().contiguous(), num_bits)
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scale.t().to(dtype).contiguous(),
        "g_idx": gi,
    }


@torch.no_grad()
def read_gptq_module(
    tensors: dict[str, torch.Tensor],
    num_bits: int,
    checkpoint_format: str = "gptq",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`gptq_module_tensors`.

    Args:
        tensors: ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` of one module (shapes as
            in :func:`gptq_module_tensors`); ``in_features = g_idx.shape[0]``.
        num_bits: 2, 3, 4 or 8.
        checkpoint_format: ``"gptq"`` (stored zeros + 1) or ``"gptq_v2"``.

    Returns:
        ``(q int8 [out, in], scale [out, G] in the stored dtype, zero_point int8 [out, G],
        g_idx int32 [in])`` in the internal signed convention (a symmetric checkpoint gives
        an all-zero ``zero_point``).

    Raises:
        InputError: a missing tensor, inconsistent shapes, or (v1) a stored zero field of
            ``2^b - 1``, which decodes to ``2^b`` -- AutoGPTQ's wrapped ``-1`` for a true
            zero point of 0 (the data is not representable; the count is given).

    Source: AutoGPTQ ``qlinear_cuda_old.py`` ``forward`` torch fallback (unpack, ``zeros + 1``,
    ``scales * (weight - zeros)``); GPTQModel ``convert_gptq_v1_to_v2_format_module``.
    """
    _check_bits(num_bits)
    _check_format(checkpoint_format)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        if name not in tensors:
            raise InputError(f"GPTQ module is missing tensor {name!r}")
    qweight, qzeros, scales, g_idx = (tensors[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    if qweight.ndim != 2 or qzeros.ndim != 2 or scales.ndim != 2 or g_idx.ndim != 1:
        raise InputError("GPTQ qweight/qzeros/scales must be 2-D and g_idx 1-D")
    in_f = int(g_idx.shape[0])
    out_f = int(qweight.shape[1])
    n_groups = int(scales.shape[0])
    if int(scales.shape[1]) != out_f:
        raise InputError(f"scales has shape {tuple(scales.shape)}, expected [G, {out_f}]")
    if int(qzeros.shape[0]) != n_groups:
        raise InputError(f"qzeros has {qzeros.shape[0]} rows, expected {n_groups} (one per group)")
    offset = 1 << (num_bits - 1)
    u = unpack_rows(qweight.t().contiguous(), num_bits, in_f)  # [out, in]
    z = unpack_rows(qzeros, num_bits, out_f)  # [G, out]
    if checkpoint_format == "gptq":
        z = z + 1
        n_wrapped = int((z > (1 << num_bits) - 1).sum())
        if n_wrapped:
            raise InputError(
                f"GPTQ v1 qzeros hold {n_wrapped} fields of {(1 << num_bits) - 1} (zero point {1 << num_bits}): "
                f"a wrapped -1 for a true zero point of 0, not representable in {num_bits} bits"
            )
    gi = g_idx.to(torch.int32)
    bad = _count_outside(gi.to(torch.int64), 0, n_groups - 1)
    if bad:
        raise InputError(f"{bad} g_idx entries lie outside the group range [0, {n_groups - 1}]")
    q = (u - offset).to(torch.int8)
    zp = (z - offset).t().contiguous().to(torch.int8)
    return q, scales.t().contiguous(), zp, gi


@torch.no_grad()
def sniff_checkpoint_format(qzeros: torch.Tensor, num_bits: int, out_features: int | None = None) -> str | None:
    """Guess v1/v2 from the stored zeros of a **symmetric** GPTQ artifact.

    All stored zero fields equal ``2^(b-1) - 1`` (7 for 4-bit) => ``"gptq"`` (v1);
    all equal ``2^(b-1)`` (8) => ``"gptq_v2"``; anything else (asymmetric, mixed,
    empty) => ``None``. This is the check proposed in vLLM PR #38966 for GPTQModel v5
    checkpoints that store v2 zeros while declaring ``checkpoint_format: "gptq"``.

    Args:
        qzeros: int32 ``[G, ceil(out*b/32)]``.
        num_bits: 2, 3, 4 or 8.
        out_features: number of zero fields per row; default ``words*32 // b`` (exact
            whenever ``out*b`` is a multiple of 32, as upstream requires).

    Returns:
        ``"gptq"``, ``"gptq_v2"`` or ``None``. Raises InputError for unsupported bits.

    Source: vLLM PR #38966 (``docs/formats.md``, GPTQ); zero convention from AutoGPTQ ``pack()``.
    """
    _check_bits(num_bits)
    if qzeros.ndim != 2 or qzeros.numel() == 0:
        return None
    n = int(out_features) if out_features is not None else int(qzeros.shape[1]) * 32 // num_bits
    z = unpack_rows(qzeros, num_bits, n)
    if z.numel() == 0:
        return None
    half = 1 << (num_bits - 1)
    if bool((z == half - 1).all()):
        return "gptq"
    if bool((z == half).all()):
        return "gptq_v2"
    return None


def gptq_quantization_config(
    num_bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    static_groups: bool,
    true_sequential: bool,
    damp_percent: float,
    checkpoint_format: str,
    tool_version: str,
) -> dict:
    """``config.json["quantization_config"]`` (also ``quantize_config.json``) for a GPTQ artifact.

    Keys as read by transformers/optimum (top level) and as written by GPTQModel >= 4
    (``meta`` block: ``quantizer``, ``damp_percent``, ``static_groups``,
    ``true_sequential``), see ``docs/formats.md``. ``meta.quantizer`` is ``["kvq:<tool_version>"]``.

    Raises:
        InputError: unsupported bits or checkpoint format.

    Source: GPTQModel ``gptqmodel/quantization/config.py`` (``META_FIELD_*`` names,
    ``FORMAT_FIELD_CHECKPOINT = "checkpoint_format"``, ``PACK_DTYPE_FIELD``).
    """
    _check_bits(num_bits)
    _check_format(checkpoint_format)
    return {
        "bits": num_bits,
        "group_size": group_size,
        "desc_act": bool(desc_act),
        "sym": bool(sym),
        "true_sequential": bool(true_sequential),
        "damp_percent": float(damp_percent),
        "static_groups": bool(static_groups),
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {
            "quantizer": [f"kvq:{tool_version}"],
            "damp_percent": float(damp_percent),
            "static_groups": bool(static_groups),
            "true_sequential": bool(true_sequential),
        },
    }


def check_gptq_compatible(
    num_bits: int,
    mixed: bool,
    shapes: list[tuple[int, int]] | None = None,
) -> None:
    """Refuse recipes a GPTQ checkpoint cannot hold.

    Args:
        num_bits: must be 2, 3, 4 or 8.
        mixed: True if modules use different bit widths / group sizes (one GPTQ config
            cannot describe that).
        shapes: optional ``[(out, in), ...]`` of the quantized Linears; upstream kernels
            allocate ``in // 32 * b`` qweight rows and ``out // 32 * b`` qzeros columns, so
            ``in*b`` and ``out*b`` must be multiples of 32.

    Raises:
        InputError: one line naming the reason.

    Source: AutoGPTQ ``QuantLinear.__init__`` (bits in {2, 3, 4, 8}; buffer shapes).
    """
    if num_bits not in SUPPORTED_BITS:
        raise InputError(f"GPTQ format supports 2, 3, 4 or 8 bits only, got {num_bits}")
    if mixed:
        raise InputError("GPTQ format cannot represent mixed precision (one bits/group_size for all modules)")
    for out_f, in_f in shapes or ():
        if (in_f * num_bits) % 32 or (out_f * num_bits) % 32:
            raise InputError(
                f"GPTQ {num_bits}-bit needs in_features*{num_bits} and out_features*{num_bits} to be multiples "
                f"of 32; a Linear of shape [{out_f}, {in_f}] is not"
            )


def gptq_checkpoint_format(symmetric: bool) -> str:
    """``gptq`` (v1) for symmetric schemes, ``gptq_v2`` for asymmetric ones: v1 stores ``z - 1``
    and cannot represent an unsigned zero point of 0 (see the module docstring)."""
    return "gptq" if symmetric else "gptq_v2"


class GptqFormat(WeightFormat):
    """``--format gptq``: AutoGPTQ / GPTQModel ``qweight``/``qzeros``/``scales``/``g_idx``.

    Symmetric schemes are written as ``checkpoint_format: gptq`` (v1, what every GPTQ
    loader reads), asymmetric ones as ``gptq_v2``. Scales are stored in float16.
    """

    name = "gptq"
    quant_method = "gptq"
    scale_dtype = "float16"
    leaves = ("qweight", "qzeros", "scales", "g_idx")
    marker = "qweight"

    def check(self, recipe, dtype_name: str) -> None:
        """Refuse KV-only and static-KV recipes, a dtype other than float16, bits outside
        2/3/4/8 and mixed precision (InputError, see :func:`check_gptq_compatible`)."""
        check_float16_weight_format(self, recipe, dtype_name)
        for s in recipe_schemes(recipe):
            check_gptq_compatible(s.num_bits, recipe.is_mixed)

    def summary_fields(self, recipe) -> dict:
        """``gptq_checkpoint_format``: ``gptq`` (v1) for a symmetric recipe, else ``gptq_v2``."""
        return {"gptq_checkpoint_format": gptq_checkpoint_format(recipe.weights.symmetric)}

    def pack(self, rec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """:func:`gptq_module_tensors` of the record, scales in float16 whatever ``dtype``."""
        return gptq_module_tensors(rec.q, rec.scale, rec.zero_point, rec.g_idx, rec.num_bits, rec.group_size,
                                   torch.float16, gptq_checkpoint_format(rec.symmetric))

    def read(self, qc: dict, module: str, t: dict[str, torch.Tensor]) -> QuantWeight:
        """Read ``qweight``/``qzeros``/``scales``/``g_idx`` with the config's ``bits``/``group_size``.

        A symmetric checkpoint's stored zeros decide v1 or v2 when they are unambiguous
        (vLLM PR #38966: some v2 checkpoints declare v1), see :func:`sniff_checkpoint_format`.

        Raises:
            InputError: a tensor missing, shapes inconsistent with the config, a v1 wrapped zero.
        """
        require_leaves(t, self.leaves)
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
        return QuantWeight(q, scale, symmetric_zero(zp), bits, gs, g_idx)

    def declared(self, qc: dict) -> list[dict]:
        """``bits``, ``group_size`` (``-1``/``0``: per channel), ``sym``."""
        gs = qc.get("group_size", -1)
        return [{"num_bits": qc.get("bits"), "group_size": -1 if gs in (-1, 0, None) else gs, "symmetric": qc.get("sym", True)}]

    def config(self, recipe, schemes: dict[str, tuple[int, int, bool]], ignored: list[str], versions: dict,
               embeddings: dict[str, tuple[int, int, bool]] | None = None) -> dict:
        """:func:`gptq_quantization_config` of the (single) scheme; ``ignored`` modules become
        GPTQModel ``dynamic`` negative overrides (``"-:^<name>$": {}``)."""
        bits, gs, sym = next(iter(schemes.values()))[:3]
        g = recipe.gptq
        cfg = gptq_quantization_config(
            bits, gs, dynamic_act_order(recipe), sym, g.static_groups, g.true_sequential, g.damp,
            gptq_checkpoint_format(sym), versions["kvq"],
        )
        if ignored:  # GPTQModel's per-module negative overrides: these modules stay in float
            cfg["dynamic"] = {f"-:^{re.escape(n)}$": {} for n in ignored}
        return cfg
