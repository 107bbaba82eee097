"""compressed-tensors ``pack-quantized`` layout (what vLLM and transformers load).

Matches vllm-project/compressed-tensors 0.20 (``compressors/pack_quantized/base.py`` and
``helpers.py`` after PR #715, dense packing):

* ``<module>.weight_packed`` int32 ``[out, ceil(in * b / 32)]``: the signed values
  ``q in [-2^(b-1), 2^(b-1)-1]`` are offset by ``2^(b-1)`` to unsigned and written as a
  dense little-endian bit stream per row (element ``i`` occupies bits ``i*b .. i*b+b-1``,
  crossing int32 words when ``b`` does not divide 32; for 2/4/8 bits this equals the
  older ``32 // b`` values-per-word layout).
* ``<module>.weight_scale`` ``[out, G]`` in the model dtype.
* ``<module>.weight_zero_point`` (asymmetric only) int32 ``[ceil(out * b / 32), G]``:
  the signed zero points packed the same way **along dim 0**.
* ``<module>.weight_shape`` int64 ``[2]`` = ``[out, in]``.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..quant.primitives import qrange

_BITS32 = torch.arange(32, dtype=torch.int64)


@torch.no_grad()
def pack_int32(q: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed ints ``q [rows, cols]`` (int8) into int32 words along ``packed_dim``.

    Returns int32 ``[rows, ceil(cols*b/32)]`` (``packed_dim=1``) or
    ``[ceil(rows*b/32), cols]`` (``packed_dim=0``).

    Raises:
        InputError: a value outside the signed ``num_bits`` range (packing must never
            bleed into neighbouring fields).
    """
    qmin, qmax = qrange(num_bits)
    if q.ndim != 2:
        raise InputError(f"pack_int32 expects a 2-D tensor, got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < qmin or int(q.max()) > qmax):
        raise InputError(f"values outside the int{num_bits} range [{qmin}, {qmax}] cannot be packed")
    if packed_dim == 0:
        return pack_int32(q.t(), num_bits, 1).t().contiguous()
    rows, cols = q.shape
    u = q.to(torch.int64) + (1 << (num_bits - 1))  # unsigned 0..2^b-1
    bits = (u.unsqueeze(-1) >> torch.arange(num_bits, dtype=torch.int64)) & 1  # [rows, cols, b]
    bits = bits.reshape(rows, cols * num_bits)
    n_words = -(-cols * num_bits // 32)
    pad = n_words * 32 - cols * num_bits
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    words = (bits.reshape(rows, n_words, 32) << _BITS32).sum(-1)  # 0 .. 2^32-1
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


@torch.no_grad()
def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], packed_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words -> signed int8 ``shape``."""
    rows, cols = shape
    if packed_dim == 0:
        return unpack_int32(packed.t(), num_bits, (cols, rows), 1).t().contiguous()
    n_words = -(-cols * num_bits // 32)
    if tuple(packed.shape) != (rows, n_words):
        raise InputError(
            f"packed tensor has shape {tuple(packed.shape)}, expected {(rows, n_words)} for {num_bits}-bit {shape}"
        )
    w = packed.to(torch.int64) & 0xFFFFFFFF
    bits = ((w.unsqueeze(-1) >> _BITS32) & 1).reshape(rows, n_words * 32)[:, : cols * num_bits]
    bits = bits.reshape(rows, cols, num_bits)
    u = (bits << torch.arange(num_bits, dtype=torch.int64)).sum(-1)
    return (u - (1 << (num_bits - 1))).to(torch.int8)


def module_tensors(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The stored tensors of one quantized Linear (names without the module prefix).

    Args:
        q: int8 ``[out, in]``; scale: ``[out, G]``; zero_point: int8 ``[out, G]`` or None
        (symmetric); dtype: storage dtype of the scale.
    """
    out = {
        "weight_packed": pack_int32(q, num_bits, 1),
        "weight_scale": scale.to(dtype).contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if zero_point is not None:
        out["weight_zero_point"] = pack_int32(zero_point, num_bits, 0)
    return out


def read_module(tensors: dict[str, torch.Tensor], num_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`module_tensors`: ``(q int8 [out,in], scale [out,G], zero_point int8 [out,G] | None)``."""
    shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
    if len(shape) != 2:
        raise InputError(f"weight_shape must have 2 entries, got {shape}")
    q = unpack_int32(tensors["weight_packed"], num_bits, shape, 1)
    scale = tensors["weight_scale"]
    zp = None
    if "weight_zero_point" in tensors:
        zp = unpack_int32(tensors["weight_zero_point"], num_bits, tuple(scale.shape), 0)
    return q, scale, zp


def _weights_args(num_bits: int, group_size: int, symmetric: bool, actorder: str | None) -> dict:
    return {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": actorder,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(
    schemes: dict[str, tuple[int, int, bool]],
    ignore: list[str],
    ct_version: str,
    actorder: str | None = None,
    kv_cache: dict | None = None,
) -> dict:
    """``config.json["quantization_config"]`` for integer weight-only schemes.

    Args:
        schemes: quantized module name -> ``(num_bits, group_size, symmetric)``.
        ignore: module names left in float (``lm_head`` and ignored linears).
        actorder: ``"weight"`` when GPTQ act-order with static groups was used (the
            only act-order compressed-tensors 0.20 stores; ``"group"`` was removed).
        kv_cache: ``kv_cache_scheme`` (see :func:`kv_cache_scheme`) or None.

    Keys follow compressed-tensors' ``QuantizationConfig`` as saved by llm-compressor
    (see the shared FORMATS.md, section 2a). ``group_size=-1`` is written as
    ``strategy: channel``. The most common scheme targets the class ``Linear``; every
    other scheme gets its own group listing exact module names, which take precedence
    over class targets in compressed-tensors' ``match_targets`` (exact name, then regex,
    then class) and in vLLM's target matching.
    """
    counts: dict[tuple, list[str]] = {}
    for name, sch in schemes.items():
        counts.setdefault(tuple(sch), []).append(name)
    ordered = sorted(counts.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    groups = {}
    for k, (sch, names) in enumerate(ordered):
        groups[f"group_{k}"] = {
            "targets": ["Linear"] if k == 0 else sorted(names),
            "weights": _weights_args(*sch, actorder),
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "config_groups": groups,
        "format": "pack-quantized" if groups else "dense",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": kv_cache,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version,
    }


def kv_cache_scheme(spec) -> dict | None:
    """compressed-tensors ``kv_cache_scheme`` for a static KV spec, ``None`` for the others.

    fp8 per tensor / per head and int8 static per head map to ``strategy: tensor`` /
    ``attn_head`` (FORMATS.md 2a; vLLM's validator accepts those strategies, symmetric
    only). Dynamic per-token int8 and KIVI have no field in compressed-tensors: the
    manifest records them.
    """
    if spec is None or not spec.static:
        return None
    return {
        "num_bits": 8,
        "type": "float" if spec.scheme == "fp8" else "int",
        "strategy": "tensor" if spec.strategy == "tensor" else "attn_head",
        "dynamic": False,
        "symmetric": True,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def kv_scale_tensors(scales: dict[int, tuple[torch.Tensor, torch.Tensor]], layers_path: str, attention: str, strategy: str) -> dict[str, torch.Tensor]:
    """Stored ``<layers>.<i>.<attention>.k_scale`` / ``v_scale`` tensors: shape ``[1]`` per
    tensor, ``[kv_heads, 1, 1]`` per head (compressed-tensors ``initialize_attn_qparams``)."""
    out = {}
    for i, (k, v) in scales.items():
        for name, t in (("k_scale", k), ("v_scale", v)):
            t = t.reshape(1) if strategy == "tensor" else t.reshape(-1, 1, 1)
            out[f"{layers_path}.{i}.{attention}.{name}"] = t.contiguous()
    return out


def module_scheme(qc: dict, module: str) -> dict:
    """The ``weights`` args of the config group that applies to ``module`` (exact name before class target).

    Raises:
        InputError: no group applies.
    """
    groups = list((qc.get("config_groups") or {}).values())
    for g in groups:
        if module in (g.get("targets") or []):
            return g["weights"]
    for g in groups:
        for t in g.get("targets") or []:
            if t.startswith("re:"):
                import re

                if re.match(t[3:], module):  # as compressed-tensors match_name does
                    return g["weights"]
    for g in groups:
        if "Linear" in (g.get("targets") or []):
            return g["weights"]
    raise InputError(f"no quantization config group applies to {module}")
