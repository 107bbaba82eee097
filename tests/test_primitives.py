import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor.errors import InputError
from compressor.formats.compressed_tensors import pack_int32, unpack_int32
from compressor.quant.primitives import (
    compute_qparams, dequantize, fake_quantize, fake_quantize_grouped, qrange, quantize,
)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(2, 8),
    rows=st.integers(1, 9),
    groups=st.integers(1, 4),
    gs=st.sampled_from([8, 16, 32]),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_dequantize_error_bound(bits, rows, groups, gs, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * gs, generator=g) * torch.rand(1, generator=g) * 3
    scale, zp = compute_qparams(w, bits, gs, symmetric)
    q = quantize(w, scale, zp, bits, gs)
    qmin, qmax = qrange(bits)
    assert q.dtype == torch.int8 and int(q.min()) >= qmin and int(q.max()) <= qmax
    if symmetric:
        assert torch.all(zp == 0)
    w_hat = dequantize(q, scale, zp, gs)
    # every value lies inside the representable range, so the error is at most half a step
    # (the symmetric grid loses the top half-step at +absmax: one full step there)
    step = scale.repeat_interleave(gs, dim=1)
    bound = step * (1.0 if symmetric else 0.5) + 1e-5
    assert torch.all((w_hat - w).abs() <= bound)
    # quantize(dequantize(q)) is the identity on the integer grid
    assert torch.equal(quantize(w_hat, scale, zp, bits, gs), q)


def test_matches_compressed_tensors_qparams():
    import compressed_tensors.quantization.utils.helpers as ct
    from compressed_tensors.quantization import QuantizationArgs

    w = torch.randn(16, 64)
    for symmetric in (True, False):
        args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=32)
        wg = w.reshape(16, 2, 32)
        s_ct, z_ct = ct.calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        scale, zp = compute_qparams(w, 4, 32, symmetric)
        torch.testing.assert_close(scale, s_ct.float(), rtol=1e-6, atol=1e-8)
        assert torch.equal(zp.to(torch.int32), z_ct.to(torch.int32))


def test_all_zero_group_gets_unit_scale_not_nan():
    w = torch.zeros(4, 64)
    w[0, :32] = 1.0
    for symmetric in (True, False):
        scale, zp = compute_qparams(w, 4, 32, symmetric)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.equal(fake_quantize(w, 4, 32, symmetric)[1:], w[1:])


def test_per_channel_group_size_minus_one():
    w = torch.randn(8, 48)
    scale, zp = compute_qparams(w, 8, -1, True)
    assert scale.shape == (8, 1)
    assert (fake_quantize(w, 8, -1, True) - w).abs().max() < w.abs().max() / 100


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_fake_quantize_equals_quantize_then_dequantize(bits):
    w = torch.randn(6, 64) * 2
    w[0, :16] = 0.0
    for symmetric in (True, False):
        scale, zp = compute_qparams(w, bits, 16, symmetric)
        explicit = dequantize(quantize(w, scale, zp, bits, 16), scale, zp, 16)
        torch.testing.assert_close(fake_quantize(w, bits, 16, symmetric), explicit, rtol=0, atol=1e-6)
        grouped = fake_quantize_grouped(w.reshape(6, 4, 16), bits, symmetric).reshape(6, 64)
        torch.testing.assert_close(grouped, explicit, rtol=0, atol=1e-6)


def test_bad_bits_and_group():
    with pytest.raises(InputError):
        qrange(9)
    with pytest.raises(InputError, match="does not divide"):
        compute_qparams(torch.randn(4, 48), 4, 32, True)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 8), rows=st.integers(1, 12), cols=st.integers(1, 70), dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_pack_round_trip(bits, rows, cols, dim, seed):
    qmin, qmax = qrange(bits)
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(qmin, qmax + 1, (rows, cols), generator=g, dtype=torch.int8)
    packed = pack_int32(q, bits, dim)
    assert packed.dtype == torch.int32
    n = -(-(cols if dim == 1 else rows) * bits // 32)
    assert packed.shape == ((rows, n) if dim == 1 else (n, cols))
    assert torch.equal(unpack_int32(packed, bits, (rows, cols), dim), q)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_matches_compressed_tensors(bits, dim):
    import compressed_tensors.compressors.pack_quantized.helpers as helpers
    qmin, qmax = qrange(bits)
    q = torch.randint(qmin, qmax + 1, (24, 72), dtype=torch.int8)
    assert torch.equal(pack_int32(q, bits, dim), helpers.pack_to_int32(q, bits, packed_dim=dim))
    ours = pack_int32(q, bits, dim)
    theirs = helpers.unpack_from_int32(ours, bits, torch.Size(q.shape), packed_dim=dim)
    assert torch.equal(theirs.to(torch.int8), q)


def test_pack_refuses_out_of_range():
    with pytest.raises(InputError, match="range"):
        pack_int32(torch.tensor([[8]], dtype=torch.int8), 4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gs", [32, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_rtn_equals_quantize_then_finish(bits, symmetric, gs, dtype, monkeypatch):
    """LinearQuantizer.quantize_linear's fused RTN (quant.rtn.rtn_linear_inplace, a few rows at a
    time) stores the codes, scales and zero points of rtn_quantize + finish bit for bit, reports
    the same relative error and leaves the same dequantized weight in the linear; an all-zero
    group, a row of large weights and a chunk boundary inside the weight included."""
    from compressor.quant import rtn
    from compressor.quant.layer import LinearQuantizer
    from compressor.quant.primitives import Scheme

    monkeypatch.setattr(rtn, "CHUNK_ELEMS", 3 * 128)  # 3 rows a chunk: the last chunk is partial
    g = torch.Generator().manual_seed(bits * 7 + gs)
    w = torch.randn(10, 128, generator=g) * 0.02
    w[0, :32] = 0
    w[3] *= 1e3
    lq = LinearQuantizer({"x": Scheme(bits, gs, symmetric)}, dtype)
    fused, plain = torch.nn.Linear(128, 10, bias=False), torch.nn.Linear(128, 10, bias=False)
    fused.weight.data.copy_(w)
    plain.weight.data.copy_(w)
    a, ea = lq.quantize_linear("x", fused)
    b, eb = lq.finish("x", plain, *rtn.rtn_quantize(plain.weight.detach(), bits, gs, symmetric), None)
    assert torch.equal(a.q, b.q) and a.q.dtype == torch.int8
    assert a.scale.dtype == b.scale.dtype == dtype and torch.equal(a.scale, b.scale)
    assert (a.zero_point is None) == symmetric and (symmetric or torch.equal(a.zero_point, b.zero_point))
    assert ea == eb
    assert torch.equal(fused.weight.view(torch.int32), plain.weight.view(torch.int32))
    assert a.scheme == b.scheme and a.g_idx is None


def test_fused_rtn_reuses_its_buffer_across_linears():
    """One LinearQuantizer keeps the fused RTN's difference buffer from linear to linear (smaller
    and larger weights in turn); each linear's record and error are still those of rtn_quantize + finish."""
    from compressor.quant.layer import LinearQuantizer
    from compressor.quant.primitives import Scheme
    from compressor.quant.rtn import rtn_quantize

    lq = LinearQuantizer({"x": Scheme(4, 32, False)}, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    for out, inp in [(64, 256), (8, 64), (96, 512), (64, 256)]:
        w = torch.randn(out, inp, generator=g)
        fused, plain = torch.nn.Linear(inp, out, bias=False), torch.nn.Linear(inp, out, bias=False)
        fused.weight.data.copy_(w)
        plain.weight.data.copy_(w)
        a, ea = lq.quantize_linear("x", fused)
        b, eb = lq.finish("x", plain, *rtn_quantize(plain.weight.detach(), 4, 32, False), None)
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
        assert ea == eb and torch.equal(fused.weight, plain.weight)
    assert lq._scratch is not None and lq._scratch.numel() == 96 * 512
