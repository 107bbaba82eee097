"""The format objects (compressed-tensors, AutoAWQ GEMM, GPTQ v1/v2): writers/readers,
round trips, per-element reference packers written from the upstream loops, dequant
equality, refusals, a cross-check of the AWQ layout with compressed-tensors' own AutoAWQ
converter, the compressed-tensors config against the library, and the packer's memory."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig

from compressor import formats
from compressor.errors import InputError
from compressor.formats import compressed_tensors as ct
from compressor.pipeline import QuantizedLinear
from compressor.quant.primitives import Scheme
from compressor.recipe import load_recipe, with_overrides
from compressor.formats.awq import (
    awq_module_tensors, awq_quantization_config, check_awq_compatible, read_awq_module,
)
from compressor.formats.gptq import (
    check_gptq_compatible, default_g_idx, gptq_module_tensors, gptq_quantization_config, pack_rows,
    read_gptq_module, sniff_checkpoint_format, unpack_rows,
)

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm.py from_linear
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ packing_utils.py


# ---------------------------------------------------------------- helpers

def make_case(out_f, in_f, bits, group_size, symmetric, act_order, seed):
    """Random internal-convention (q, scale, zero_point, g_idx)."""
    g = torch.Generator().manual_seed(seed)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    gs = in_f if group_size == -1 else group_size
    n_groups = -(-in_f // gs)
    q = torch.randint(qmin, qmax + 1, (out_f, in_f), generator=g, dtype=torch.int64).to(torch.int8)
    # make sure the extremes appear (they are the ones that could bleed)
    q[0, 0], q[-1, -1] = qmin, qmax
    scale = torch.rand(out_f, n_groups, generator=g) * 0.1 + 1e-3
    zp = None
    if not symmetric:
        zp = torch.randint(qmin, qmax + 1, (out_f, n_groups), generator=g, dtype=torch.int64).to(torch.int8)
        zp[0, 0], zp[-1, -1] = qmin, qmax
    g_idx = None
    if act_order:
        perm = torch.randperm(in_f, generator=g)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)
    return q, scale, zp, g_idx


def internal_dequant(q, scale, zp, g_idx, group_size):
    """w[:, c] = (q[:, c] - zp[:, g(c)]) * scale[:, g(c)] (the spec, per column index)."""
    in_f = q.shape[1]
    gs = in_f if group_size == -1 else group_size
    gi = (torch.arange(in_f) // gs) if g_idx is None else g_idx.long()
    z = 0.0 if zp is None else zp.float()[:, gi]
    return (q.float() - z) * scale.float()[:, gi]


def per_bit_pack_int32(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """kvq's former compressed-tensors packer (one int64 per bit, ~64 bytes per weight),
    kept as the byte reference for the bounded-memory packer: ``[rows, cols]`` -> int32."""
    rows, cols = q.shape
    u = q.to(torch.int64) + (1 << (num_bits - 1))
    bits = ((u.unsqueeze(-1) >> torch.arange(num_bits, dtype=torch.int64)) & 1).reshape(rows, cols * num_bits)
    n_words = -(-cols * num_bits // 32)
    bits = torch.nn.functional.pad(bits, (0, n_words * 32 - cols * num_bits))
    words = (bits.reshape(rows, n_words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def u32_to_i32(w: int) -> int:
    return w - (1 << 32) if w >= (1 << 31) else w


# ------------------------------------------------- naive reference packers (per element)

def naive_awq_pack(intweight):
    """AutoAWQ WQLinear_GEMM.from_linear loop: ``qweight[:, col] |= int[:, col*8 + order_map[i]] << (i*4)``.

    intweight: list of rows of unsigned nibbles, row length % 8 == 0.
    """
    out = []
    for row in intweight:
        words = []
        for col in range(len(row) // 8):
            w = 0
            for i in range(8):
                w |= row[col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
            words.append(u32_to_i32(w))
        out.append(words)
    return torch.tensor(out, dtype=torch.int32)


def naive_gptq_pack_seq(vals, bits):
    """AutoGPTQ qlinear_cuda_old.pack() loop over one packed sequence (uint32 words).

    2/4/8 bits: ``word |= v[j] << (bits*(j-i))``; 3 bits: 10-1-10-1-10 over 3 words.
    """
    words = []
    i = 0
    if bits in (2, 4, 8):
        per = 32 // bits
        while i < len(vals):
            w = 0
            for j in range(i, i + per):
                w |= vals[j] << (bits * (j - i))
            words.append(w)
            i += per
    else:
        assert bits == 3 and len(vals) % 32 == 0
        while i < len(vals):
            w0 = 0
            for j in range(i, i + 10):
                w0 |= vals[j] << (3 * (j - i))
            i += 10
            w0 |= (vals[i] << 30) & 0xFFFFFFFF
            w1 = (vals[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                w1 |= vals[j] << (3 * (j - i) + 1)
            i += 10
            w1 |= (vals[i] << 31) & 0xFFFFFFFF
            w2 = (vals[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                w2 |= vals[j] << (3 * (j - i) + 2)
            i += 10
            words += [w0, w1, w2]
    return [u32_to_i32(w) for w in words]


def naive_gptq_tensors(q, zp, bits, v1):
    """qweight [in*b/32, out] and qzeros [G, out*b/32] by the per-element loops."""
    off = 1 << (bits - 1)
    u = (q.long() + off).tolist()  # [out][in]
    out_f, in_f = q.shape
    cols = [naive_gptq_pack_seq([u[o][c] for c in range(in_f)], bits) for o in range(out_f)]
    qweight = torch.tensor(cols, dtype=torch.int32).t().contiguous()
    z = (zp.long() + off - (1 if v1 else 0)).t().tolist()  # [G][out]
    qzeros = torch.tensor([naive_gptq_pack_seq(row, bits) for row in z], dtype=torch.int32)
    return qweight, qzeros


def naive_unpack_seq(words, bits, n):
    """Dense little-endian bit stream read one bit at a time (the spec in docs/formats.md)."""
    ws = [w & 0xFFFFFFFF for w in words]
    vals = []
    for j in range(n):
        v = 0
        for t in range(bits):
            pos = j * bits + t
            v |= ((ws[pos // 32] >> (pos % 32)) & 1) << t
        vals.append(v)
    return vals


# ================================================================ AWQ

AWQ_SHAPES = [(16, 128), (40, 384), (8, 256), (72, 128)]


@pytest.mark.parametrize("shape", AWQ_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_round_trip(shape, group_size, symmetric):
    out_f, in_f = shape
    q, scale, zp, _ = make_case(out_f, in_f, 4, group_size, symmetric, False, seed=out_f * in_f + group_size)
    for dtype in (torch.float16, torch.bfloat16):
        t = awq_module_tensors(q, scale, zp, group_size, dtype=dtype)
        n_groups = in_f // group_size
        assert t["qweight"].dtype == torch.int32 and tuple(t["qweight"].shape) == (in_f, out_f // 8)
        assert t["qzeros"].dtype == torch.int32 and tuple(t["qzeros"].shape) == (n_groups, out_f // 8)
        assert t["scales"].dtype == dtype and tuple(t["scales"].shape) == (n_groups, out_f)
        q2, s2, z2 = read_awq_module(t)
        assert q2.dtype == torch.int8 and torch.equal(q2, q)
        assert s2.dtype == dtype and torch.equal(s2, scale.to(dtype))
        assert z2.dtype == torch.int8
        assert torch.equal(z2, torch.zeros_like(q2[:, :n_groups]) if zp is None else zp)


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_matches_naive_autoawq_loop(symmetric):
    out_f, in_f, gs = 24, 64, 32
    q, scale, zp, _ = make_case(out_f, in_f, 4, gs, symmetric, False, seed=7)
    t = awq_module_tensors(q, scale, zp, gs)
    intweight = (q.long() + 8).t().tolist()  # [in][out]
    zeros = (torch.full((out_f, 2), 8) if zp is None else zp.long() + 8).t().tolist()
    assert torch.equal(t["qweight"], naive_awq_pack(intweight))
    assert torch.equal(t["qzeros"], naive_awq_pack(zeros))


def test_awq_nibble_order_is_upstream_not_inverse():
    # one output row group: logical column k holds value k; slot i must hold order_map[i]
    q = (torch.arange(8) - 8).to(torch.int8).reshape(8, 1).repeat(1, 32)  # row k == k-8 -> unsigned k
    t = awq_module_tensors(q, torch.ones(8, 1), None, 32)
    word = int(t["qweight"][0, 0]) & 0xFFFFFFFF
    slots = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert slots == AWQ_ORDER_MAP  # slot i holds column order_map[i]
    assert slots != [AWQ_ORDER_MAP.index(i) for i in range(8)]  # i.e. not column i -> slot order_map[i]


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_dequant_matches_internal(symmetric):
    out_f, in_f, gs = 32, 128, 64
    q, scale, zp, _ = make_case(out_f, in_f, 4, gs, symmetric, False, seed=11)
    t = awq_module_tensors(q, scale, zp, gs)
    # AutoAWQ dequantize_gemm semantics, done on the raw tensors
    shifts = torch.arange(0, 32, 4)
    iw = ((t["qweight"].long()[:, :, None] >> shifts) & 0xF).reshape(in_f, -1)
    iz = ((t["qzeros"].long()[:, :, None] >> shifts) & 0xF).reshape(in_f // gs, -1)
    rev = torch.arange(out_f).view(-1, 8)[:, AWQ_REVERSE].reshape(-1)
    iw, iz = iw[:, rev], iz[:, rev]
    w_awq = (iw - iz.repeat_interleave(gs, 0)).float() * t["scales"].float().repeat_interleave(gs, 0)
    expected = internal_dequant(q, scale.half(), zp, None, gs)
    assert torch.equal(w_awq.t(), expected)
    q2, s2, z2 = read_awq_module(t)
    assert torch.equal(internal_dequant(q2, s2, z2, None, gs), expected)


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_matches_compressed_tensors_converter(symmetric):
    from compressed_tensors.entrypoints.convert.converters import autoawq as conv_mod  # a move fails loudly
    out_f, in_f, gs = 48, 128, 32
    q, scale, zp, _ = make_case(out_f, in_f, 4, gs, symmetric, False, seed=5)
    t = awq_module_tensors(q, scale, zp, gs)
    conv = conv_mod.AutoAWQConverter(bits=4, group_size=gs, zero_point=not symmetric)
    got = conv.process({f"m.{k}": v.clone() for k, v in t.items()})
    ours = ct.module_tensors(q, scale, zp, 4, torch.float16)
    assert set(got) == {f"m.{k}" for k in ours}
    for k, v in ours.items():
        assert torch.equal(got[f"m.{k}"].to(v.dtype), v), k
    assert got["m.weight_scale"].dtype == torch.float16


def test_awq_refusals():
    q, scale, zp, _ = make_case(16, 64, 4, 32, False, False, seed=1)
    with pytest.raises(InputError, match="group_size -1"):
        awq_module_tensors(q, scale[:, :1], zp[:, :1], -1)
    with pytest.raises(InputError, match="out_features"):
        awq_module_tensors(q[:12], scale[:12], zp[:12], 32)
    bad = q.clone()
    bad[3, 3] = 8
    with pytest.raises(InputError, match="1 quantized values"):
        awq_module_tensors(bad, scale, zp, 32)
    with pytest.raises(InputError, match="scale has shape"):
        awq_module_tensors(q, scale[:, :1], zp, 32)


def test_check_awq_compatible():
    check_awq_compatible(4, 128, [576, 1536], False, False)
    cases = [
        ((8, 128, [64], False, False), "4-bit weights only"),
        ((4, -1, [64], False, False), "group_size -1"),
        ((4, 128, [64, 20], False, False), r"divisible by 8; got \[20\]"),
        ((4, 128, [64], True, False), "g_idx"),
        ((4, 128, [64], False, True), "mixed precision"),
    ]
    for args, msg in cases:
        with pytest.raises(InputError, match=msg) as ei:
            check_awq_compatible(*args)
        assert "\n" not in str(ei.value)


def test_awq_quantization_config():
    assert awq_quantization_config(128, None) == {
        "quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4,
        "version": "gemm", "modules_to_not_convert": None,
    }
    assert awq_quantization_config(64, ["lm_head"])["modules_to_not_convert"] == ["lm_head"]


# ================================================================ GPTQ

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 10, 11, 21, 22, 32, 33, 75, 96])
def test_dense_packer_equals_the_per_bit_reference(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(qmin, qmax + 1, (5, n), generator=g).to(torch.int8)
    packed = pack_rows(q.long() - qmin, bits)
    assert torch.equal(packed, per_bit_pack_int32(q, bits))
    assert torch.equal(packed, ct.pack_int32(q, bits, 1))
    assert torch.equal(unpack_rows(packed, bits, n) + qmin, q.long())
    ws = packed[2].tolist()
    assert naive_unpack_seq(ws, bits, n) == (q[2].long() - qmin).tolist()



@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("offset", [0, 8, 3, 15, 16, -8])
def test_four_bit_packer_equals_the_byte_wise_one(dtype, offset):
    """4-bit values in bytes take the nibble packer (packing._pack_nibbles, two values a 16-bit
    word): the words of the byte-wise packer for any byte values and offset, over several row blocks."""
    from compressor.formats import packing

    g = torch.Generator().manual_seed(offset + 100)
    q = torch.randint(0, 256, (300, 4096), generator=g).to(torch.uint8).view(dtype)
    want = torch.zeros(300, 4096 // 8, dtype=torch.int64)
    u = (q.long() + offset) & 15
    for k in range(8):
        want |= u[:, k::8] << (4 * k)
    want = torch.where(want >= 2**31, want - 2**32, want).to(torch.int32)
    assert torch.equal(packing.pack_rows(q, 4, offset), want)
    assert torch.equal(packing.pack_rows(q.long(), 4, offset), want)  # the int64 path, for comparison
    col = q[:1].reshape(-1, 1)[:16]  # [16, 1]: its transpose is contiguous with a row stride of 1 (a zero point's)
    assert torch.equal(packing.pack_rows(col.t(), 4, offset), packing.pack_rows(col.t().long(), 4, offset))

GPTQ_CASES = [
    # (out, in, group_size)
    (64, 128, 32),
    (32, 256, 64),
    (96, 128, 128),
    (40, 192, -1),
    (12, 96, 32),  # out*b not a multiple of 32 for most b: padded qzeros
]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("case", GPTQ_CASES)
@pytest.mark.parametrize("symmetric,act_order", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_round_trip(bits, case, symmetric, act_order, fmt):
    out_f, in_f, gs = case
    q, scale, zp, g_idx = make_case(out_f, in_f, bits, gs, symmetric, act_order, seed=bits + out_f + in_f)
    if fmt == "gptq" and zp is not None:
        zp = zp.clamp(min=-(1 << (bits - 1)) + 1)  # v1 cannot store unsigned zero 0
    n_groups = 1 if gs == -1 else in_f // gs
    t = gptq_module_tensors(q, scale, zp, g_idx, bits, gs, checkpoint_format=fmt)
    assert t["qweight"].dtype == torch.int32 and tuple(t["qweight"].shape) == (-(-in_f * bits // 32), out_f)
    assert t["qzeros"].dtype == torch.int32 and tuple(t["qzeros"].shape) == (n_groups, -(-out_f * bits // 32))
    assert t["scales"].dtype == torch.float16 and tuple(t["scales"].shape) == (n_groups, out_f)
    assert t["g_idx"].dtype == torch.int32 and tuple(t["g_idx"].shape) == (in_f,)
    exp_g = default_g_idx(in_f, gs) if g_idx is None else g_idx
    assert torch.equal(t["g_idx"], exp_g)
    if gs == -1 and g_idx is None:
        assert not t["g_idx"].any()
    q2, s2, z2, g2 = read_gptq_module(t, bits, checkpoint_format=fmt)
    assert q2.dtype == torch.int8 and torch.equal(q2, q)
    assert s2.dtype == torch.float16 and torch.equal(s2, scale.half())
    assert z2.dtype == torch.int8 and torch.equal(z2, torch.zeros_like(z2) if zp is None else zp)
    assert g2.dtype == torch.int32 and torch.equal(g2, exp_g)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_matches_naive_autogptq_loop(bits, fmt, symmetric):
    out_f, in_f, gs = 64, 64, 32
    q, scale, zp, _ = make_case(out_f, in_f, bits, gs, symmetric, False, seed=bits * 3 + symmetric)
    if zp is None:
        zp_eff = torch.zeros(out_f, 2, dtype=torch.int8)
    else:
        zp = zp.clamp(min=-(1 << (bits - 1)) + 1)
        zp_eff = zp
    t = gptq_module_tensors(q, scale, zp, None, bits, gs, checkpoint_format=fmt)
    qweight, qzeros = naive_gptq_tensors(q, zp_eff, bits, v1=(fmt == "gptq"))
    assert torch.equal(t["qweight"], qweight)
    assert torch.equal(t["qzeros"], qzeros)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_kernel_style_dequant_matches_internal(bits, fmt):
    """Dequant the way the AutoGPTQ torch fallback does: scale[g_idx] * (w - (z_stored + 1 if v1))."""
    out_f, in_f, gs = 32, 96, 32
    q, scale, zp, g_idx = make_case(out_f, in_f, bits, gs, False, True, seed=bits)
    zp = zp.clamp(min=-(1 << (bits - 1)) + 1)
    t = gptq_module_tensors(q, scale, zp, g_idx, bits, gs, checkpoint_format=fmt)
    qw = t["qweight"].tolist()
    w_u = torch.tensor([naive_unpack_seq([qw[r][o] for r in range(len(qw))], bits, in_f) for o in range(out_f)])
    z_s = torch.tensor([naive_unpack_seq(row, bits, out_f) for row in t["qzeros"].tolist()])  # [G, out]
    z = z_s + (1 if fmt == "gptq" else 0)
    gi = t["g_idx"].long()
    w = (w_u.t() - z[gi]).float() * t["scales"].float()[gi]  # [in, out], as the kernels lay it out
    expected = internal_dequant(q, scale.half(), zp, g_idx, gs)
    assert torch.equal(w.t(), expected)
    q2, s2, z2, g2 = read_gptq_module(t, bits, checkpoint_format=fmt)  # and through the reader
    assert torch.equal(internal_dequant(q2, s2, z2, g2, gs), expected)


def test_gptq_symmetric_stores_7_v1_and_8_v2():
    q, scale, _, _ = make_case(32, 64, 4, 32, True, False, seed=3)
    v1 = gptq_module_tensors(q, scale, None, None, 4, 32, checkpoint_format="gptq")
    v2 = gptq_module_tensors(q, scale, None, None, 4, 32, checkpoint_format="gptq_v2")
    assert torch.all(v1["qzeros"] == 0x77777777)
    assert torch.all(v2["qzeros"] == u32_to_i32(0x88888888))
    # GPTQModel's packed-word v1 -> v2 conversion for 4-bit adds 0x11111111
    assert torch.equal((v1["qzeros"].long() + 0x11111111) & 0xFFFFFFFF, v2["qzeros"].long() & 0xFFFFFFFF)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_v1_refuses_unsigned_zero_zero(bits):
    q, scale, zp, _ = make_case(32, 64, bits, 32, False, False, seed=9)
    zp = zp.clamp(min=-(1 << (bits - 1)) + 1)
    zp[1, 0] = zp[2, 1] = -(1 << (bits - 1))
    with pytest.raises(InputError, match=r"2 of 64 zero points") as ei:
        gptq_module_tensors(q, scale, zp, None, bits, 32, checkpoint_format="gptq")
    assert "gptq_v2" in str(ei.value) and "\n" not in str(ei.value)
    t = gptq_module_tensors(q, scale, zp, None, bits, 32, checkpoint_format="gptq_v2")  # v2 can
    assert torch.equal(read_gptq_module(t, bits, "gptq_v2")[2], zp)
    # an AutoGPTQ-style wrapped -1 (all ones) in a v1 artifact is refused on read
    t["qzeros"][0, 0] = -1
    with pytest.raises(InputError, match="wrapped -1"):
        read_gptq_module(t, bits, "gptq")


def test_gptq_validates_before_packing():
    q, scale, zp, g_idx = make_case(32, 64, 4, 32, False, True, seed=2)
    bad = q.clone()
    bad[0, 5] = 9
    with pytest.raises(InputError, match="1 quantized values"):
        gptq_module_tensors(bad, scale, zp, None, 4, 32, checkpoint_format="gptq_v2")
    badz = zp.clone()
    badz[0, 0] = 8
    with pytest.raises(InputError, match="1 zero points"):
        gptq_module_tensors(q, scale, badz, None, 4, 32, checkpoint_format="gptq_v2")
    badg = g_idx.clone()
    badg[0] = 2
    with pytest.raises(InputError, match="g_idx"):
        gptq_module_tensors(q, scale, zp, badg, 4, 32, checkpoint_format="gptq_v2")
    with pytest.raises(InputError, match="2, 3, 4 or 8 bits"):
        gptq_module_tensors(q, scale, zp, None, 5, 32)
    with pytest.raises(InputError, match="checkpoint_format"):
        gptq_module_tensors(q, scale, zp, None, 4, 32, checkpoint_format="gptq_v3")


def test_sniff_checkpoint_format():
    for bits in (2, 3, 4, 8):
        q, scale, zp, _ = make_case(64, 64, bits, 32, True, False, seed=bits)
        for fmt in ("gptq", "gptq_v2"):
            t = gptq_module_tensors(q, scale, None, None, bits, 32, checkpoint_format=fmt)
            assert sniff_checkpoint_format(t["qzeros"], bits) == fmt
            assert sniff_checkpoint_format(t["qzeros"], bits, out_features=64) == fmt
    q, scale, zp, _ = make_case(64, 64, 4, 32, False, False, seed=1)
    t = gptq_module_tensors(q, scale, zp, None, 4, 32, checkpoint_format="gptq_v2")
    assert sniff_checkpoint_format(t["qzeros"], 4) is None
    # the vLLM PR #38966 hazard: v2 zeros (8) while the config says "gptq"
    assert sniff_checkpoint_format(torch.full((2, 4), u32_to_i32(0x88888888), dtype=torch.int32), 4) == "gptq_v2"
    assert sniff_checkpoint_format(torch.zeros((0, 4), dtype=torch.int32), 4) is None


def test_check_gptq_compatible():
    for bits in (2, 3, 4, 8):
        check_gptq_compatible(bits, False, shapes=[(576, 1536), (1536, 576)])
    with pytest.raises(InputError, match="2, 3, 4 or 8 bits"):
        check_gptq_compatible(5, False)
    with pytest.raises(InputError, match="mixed precision"):
        check_gptq_compatible(4, True)
    with pytest.raises(InputError, match=r"\[12, 64\]"):
        check_gptq_compatible(4, False, shapes=[(12, 64)])


def test_gptq_quantization_config():
    cfg = gptq_quantization_config(4, 128, True, True, False, True, 0.01, "gptq", "0.1.0")
    assert cfg == {
        "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "true_sequential": True,
        "damp_percent": 0.01, "static_groups": False, "lm_head": False, "quant_method": "gptq",
        "checkpoint_format": "gptq", "pack_dtype": "int32",
        "meta": {"quantizer": ["kvq:0.1.0"], "damp_percent": 0.01, "static_groups": False,
                 "true_sequential": True},
    }
    assert gptq_quantization_config(3, -1, False, False, False, True, 0.1, "gptq_v2", "x")["checkpoint_format"] == "gptq_v2"
    with pytest.raises(InputError):
        gptq_quantization_config(4, 128, False, True, False, True, 0.01, "marlin", "x")


def test_readers_reject_inconsistent_tensors():
    q, scale, zp, _ = make_case(32, 64, 4, 32, False, False, seed=4)
    t = gptq_module_tensors(q, scale, zp, None, 4, 32, checkpoint_format="gptq_v2")
    with pytest.raises(InputError, match="g_idx"):
        read_gptq_module({k: v for k, v in t.items() if k != "g_idx"}, 4, "gptq_v2")
    with pytest.raises(InputError, match="words per row"):
        read_gptq_module({**t, "g_idx": torch.zeros(80, dtype=torch.int32)}, 4, "gptq_v2")
    a = awq_module_tensors(q, scale, zp, 32)
    with pytest.raises(InputError, match="scales"):
        read_awq_module({**a, "scales": a["scales"][:, :16]})


def test_row_blocking_gives_identical_bytes(monkeypatch):
    import compressor.formats.packing as packing

    q, scale, zp, g_idx = make_case(40, 128, 3, 32, False, True, seed=12)
    zp = zp.clamp(min=-3)
    ref = gptq_module_tensors(q, scale, zp, g_idx, 3, 32)
    q4, s4, z4, _ = make_case(40, 128, 4, 32, False, False, seed=13)
    ref_awq = awq_module_tensors(q4, s4, z4, 32)
    monkeypatch.setattr(packing, "_CHUNK_ELEMS", 100)  # the one packer: GPTQ, AWQ and compressed-tensors
    got = gptq_module_tensors(q, scale, zp, g_idx, 3, 32)
    got_awq = awq_module_tensors(q4, s4, z4, 32)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    for k in ref_awq:
        assert torch.equal(got_awq[k], ref_awq[k]), k
    assert torch.equal(read_gptq_module(got, 3)[0], q)
    assert torch.equal(read_awq_module(got_awq)[0], q4)
    ref_ct = ct.module_tensors(q4, s4, z4, 4, torch.float16)
    monkeypatch.setattr(packing, "_CHUNK_ELEMS", 1 << 20)
    got_ct = ct.module_tensors(q4, s4, z4, 4, torch.float16)
    for k in ref_ct:
        assert torch.equal(got_ct[k], ref_ct[k]), k


# ================================================================ format objects, config, packer memory

def test_registry_and_import_direction():
    from compressor.registry import FORMATS

    assert [f.name for f in FORMATS.entries()][:3] == ["compressed-tensors", "awq", "gptq"]
    for name in ("compressed-tensors", "awq", "gptq"):
        f = formats.get_format(name)
        assert f.name == f.quant_method == name and f.marker in f.leaves and formats.reader_for(name) is f
    assert formats.reader_for("marlin") is None and formats.reader_for(None) is None
    with pytest.raises(InputError, match="unknown format 'marlin'; choose one of compressed-tensors, awq, gptq"):
        formats.get_format("marlin")
    root = Path(formats.__file__).parent.parent
    for path in [root / "artifact.py", *sorted((root / "formats").glob("*.py"))]:  # runtime -> formats, never back
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "runtime" not in (node.module or ""), f"{path.name} imports {node.module}"


@pytest.mark.parametrize("fmt,bits,gs,symmetric,act_order", [
    ("compressed-tensors", 4, 32, False, False), ("compressed-tensors", 8, -1, True, False),
    ("awq", 4, 32, False, False), ("awq", 4, 64, True, False),
    ("gptq", 3, 32, False, True), ("gptq", 4, -1, True, False),
])
def test_format_objects_write_then_read(fmt, bits, gs, symmetric, act_order):
    q, scale, zp, g_idx = make_case(64, 128, bits, gs, symmetric, act_order, seed=bits + gs)
    if fmt == "gptq" and not symmetric:
        zp = zp.clamp(min=-(1 << (bits - 1)) + 1)
    rec = QuantizedLinear(q, scale.half(), zp, g_idx, Scheme(bits, gs, symmetric))
    qc = {"compressed-tensors": lambda: ct.quantization_config({"m": rec.scheme}, ["lm_head"], "x"),
          "awq": lambda: awq_quantization_config(gs, None),
          "gptq": lambda: gptq_quantization_config(bits, gs, act_order, symmetric, False, True, 0.01,
                                                   "gptq" if symmetric else "gptq_v2", "x")}[fmt]()
    stored = formats.get_format(fmt).pack(rec, torch.float16)
    assert set(stored) <= set(formats.get_format(fmt).leaves)
    w = formats.read_quant_weight(fmt, qc, "m", stored)
    assert torch.equal(w.dequantize(), internal_dequant(q, scale.half(), zp, g_idx, gs))
    with pytest.raises(InputError, match="^module m: lacks "):
        formats.read_quant_weight(fmt, qc, "m", {k: v for k, v in stored.items() if k != formats.get_format(fmt).marker})


def test_compressed_tensors_config_is_built_by_the_library_and_unchanged():
    """The bundled w4a16-mixed recipe (GPTQ act-order with static groups, down_proj W8 per
    channel) plus static fp8 per-head KV: the quantization_config kvq wrote before it was
    built through compressed-tensors' pydantic models (golden file, key order included),
    and the library parses it back."""
    recipe = with_overrides(load_recipe("w4a16-mixed"), kv_cache={"scheme": "fp8", "strategy": "head"})
    names = [f"model.layers.{i}.{m}" for i in range(2)
             for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    schemes = {n: (8, -1, True) if "down_proj" in n else (4, 64, False) for n in names}
    cfg = formats.get_format("compressed-tensors").config(recipe, schemes, ["model.layers.1.mlp.gate_proj"],
                                                          {"compressed-tensors": "0.20.1", "kvq": "0.1.0"})
    golden = Path(__file__).parent / "golden" / "ct-mixed-quantization_config.json"
    assert json.dumps(cfg, indent=2) + "\n" == golden.read_text()
    parsed = QuantizationConfig.model_validate(cfg)  # the library reads it back
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    assert parsed.ignore == cfg["ignore"] and parsed.kv_cache_scheme.strategy == "attn_head"
    for name, group in parsed.config_groups.items():
        assert group.targets == cfg["config_groups"][name]["targets"]
        assert group.weights.model_dump(mode="json").items() <= cfg["config_groups"][name]["weights"].items()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_int32_bytes_equal_the_per_bit_packer(bits, dim):
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(qmin, qmax + 1, (37, 301), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    ref = per_bit_pack_int32(q, bits) if dim == 1 else per_bit_pack_int32(q.t(), bits).t().contiguous()
    assert torch.equal(ct.pack_int32(q, bits, dim), ref)
    assert torch.equal(ct.unpack_int32(ref, bits, tuple(q.shape), dim), q)


PEAK_SCRIPT = r"""
import re, torch
from compressor.formats.compressed_tensors import pack_int32, unpack_int32
def kb(key):
    return int(re.search(rf"^{key}:\s+(\d+) kB", open("/proc/self/status").read(), re.M).group(1)) * 1024
def peak(fn):  # extra peak RSS of fn(), per weight: reset VmHWM to the current RSS first
    open("/proc/self/clear_refs", "w").write("5")
    base = kb("VmRSS")
    return fn(), (kb("VmHWM") - base) / q.numel()
q = torch.randint(-8, 8, (4096, 11008), dtype=torch.int8)
packed, pack_peak = peak(lambda: pack_int32(q, 4, 1))
back, unpack_peak = peak(lambda: unpack_int32(packed, 4, tuple(q.shape), 1))
assert torch.equal(back, q)
print(pack_peak, unpack_peak)
"""


def test_default_packer_memory_is_bounded_at_a_real_shape():
    """pack_int32 on one 4096x11008 int4 matrix (a Llama-7B MLP): peak extra RSS, output
    included, under 4 bytes per weight (the per-bit packer took ~64, +3.1 GiB); the same
    bound for unpacking."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    pack_peak, unpack_peak = map(float, out.stdout.split())
    assert pack_peak < 4.0 and unpack_peak < 4.0, out.stdout


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64])
def test_aligned_packer_leaves_its_input_alone(bits, dtype):
    """The byte-wise aligned path (2/4/8 bits) gives the general path's words for every integer
    dtype and never writes into the caller's tensor (a uint8 input is not converted, so not copied)."""
    g = torch.Generator().manual_seed(bits)
    u = torch.randint(0, 1 << bits, (7, 64), generator=g).to(dtype)
    before = u.clone()
    packed = pack_rows(u, bits)
    assert torch.equal(u, before) and packed.dtype == torch.int32 and packed.is_contiguous()
    fields = before.long() & ((1 << bits) - 1)  # int8 holds 128..255 as negatives: the same low bits
    assert torch.equal(unpack_rows(packed, bits, 64), fields)
    assert torch.equal(packed, per_bit_pack_int32((fields - (1 << (bits - 1))).to(torch.int8), bits))


@pytest.mark.parametrize("num_bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 9, 64, 130])
def test_unpack_signed_fast_path_equals_the_general_one(num_bits, n):
    """The byte-wise unpacking (2/4/8 bits) and the gather path give the same int8 values,
    rows whose last word is partly filled included, and :func:`unpack_int32` returns them."""
    from compressor.formats.packing import unpack_rows, unpack_signed

    lo, hi = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    q = torch.randint(lo, hi, (37, n), dtype=torch.int8, generator=torch.Generator().manual_seed(num_bits * 1000 + n))
    q[0, 0], q[-1, -1] = lo, hi - 1  # both ends of the range
    words = ct.pack_int32(q, num_bits)
    general = (unpack_rows(words, num_bits, n) - hi).to(torch.int8)
    assert torch.equal(general, q)
    assert torch.equal(unpack_signed(words, num_bits, n), q)
    assert torch.equal(ct.unpack_int32(words, num_bits, (37, n)), q)
    with pytest.raises(InputError, match="words per row"):
        unpack_signed(words[:, :0], num_bits, n)
