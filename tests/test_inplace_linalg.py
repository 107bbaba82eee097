"""In-place linear algebra for GPTQ's Hessians (compressor/quant/inplace_linalg.py)."""

import sys

import pytest
import torch

from compressor.quant.gptq import _torch_inverse_cholesky, gptq_quantize
from compressor.quant.inplace_linalg import all_finite, flip_, permute_symmetric_, upper_cholesky_of_inverse_


def _hessian(n, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, n, dtype=torch.float64)
    H = (2 * x.T @ x / tokens).float()
    return (H + H.T) / 2  # exactly symmetric, as a restore leaves it


def _damped_diag(H, damp=0.01):
    d = torch.diagonal(H).clone()
    return d + damp * float(d.mean())


@pytest.mark.parametrize("n", [1, 2, 7, 64, 301])
def test_upper_factor_of_the_inverse_matches_torch_chain(n):
    H = _hessian(n, max(4, n // 3))  # rank deficient below the damping: as calibration Hessians are
    d = _damped_diag(H)
    ref = _torch_inverse_cholesky(H.clone(), d)
    A = H.clone()
    assert upper_cholesky_of_inverse_(A, d)
    assert torch.equal(A, A.triu())
    torch.testing.assert_close(A, ref, rtol=1e-3, atol=1e-4 * float(ref.abs().max()))
    # and it is the factor: Uᵀ U (H + λ I) = I
    Hd = H.clone().double()
    torch.diagonal(Hd).copy_(d.double())
    eye = A.double().T @ A.double() @ Hd
    torch.testing.assert_close(eye, torch.eye(n, dtype=torch.float64), rtol=0, atol=2e-3)


def test_a_failed_attempt_restores_the_matrix():
    H = _hessian(50, 200)
    d = torch.diagonal(H).clone()
    d[7] = -1.0  # not positive definite
    A = H.clone()
    assert not upper_cholesky_of_inverse_(A, d)
    expect = H.clone()
    torch.diagonal(expect).copy_(d)
    assert torch.equal(A, expect)


def test_flip_and_permutation_in_place():
    for n in (1, 5, 6, 513):
        A = torch.randn(n, n)
        assert torch.equal(flip_(A.clone(), rows=4), A.flip(0, 1))
        S = A + A.T
        perm = torch.randperm(n)
        assert torch.equal(permute_symmetric_(S.clone(), perm, rows=64), S[perm][:, perm])
    assert all_finite(torch.ones(5, 3), rows=2)
    bad = torch.ones(5, 3)
    bad[4, 2] = float("inf")
    assert not all_finite(bad, rows=2)


def test_gptq_retry_still_works_in_place():
    torch.manual_seed(3)
    w = torch.randn(16, 32)
    H = torch.eye(32)
    H[0, 0] = -0.05
    r = gptq_quantize(w, H, 4, -1, True, damp=0.01, damp_increment=0.1, max_damp=1.0)
    assert r.retries > 0 and r.damp > 0.01


def _hwm_mib():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_no_matrix_sized_temporary_at_a_wide_hessian():
    """At in = 6144 (one matrix: 144 MiB) the factorisation and the act_order permutation add
    less than a quarter of a matrix to the peak RSS (torch's chain adds two to three)."""
    n = 6144
    H = _hessian(n, 256)
    d = _damped_diag(H)
    perm = torch.randperm(n)
    mib = n * n * 4 / 2**20
    small = _hessian(1024, 64)
    upper_cholesky_of_inverse_(small, _damped_diag(small))  # LAPACK's libraries and thread buffers: loaded once
    for step in (lambda: permute_symmetric_(H, perm, rows=256), lambda: upper_cholesky_of_inverse_(H, d)):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current RSS
        before = _hwm_mib()
        step()
        assert _hwm_mib() - before < 0.25 * mib


def test_gptq_gives_the_same_weights_through_either_factorisation(monkeypatch):
    """At in = 2048 (the in-place path) GPTQ's integers agree with torch's chain but for rounding ties."""
    import compressor.quant.gptq as gptq

    torch.manual_seed(5)
    n = 2048
    w = torch.randn(24, n)
    H = _hessian(n, 512, seed=5)
    a = gptq_quantize(w, H, 4, 64, False, act_order=True, static_groups=True)
    monkeypatch.setattr(gptq, "IN_PLACE_FROM", 10**9)
    b = gptq_quantize(w, H, 4, 64, False, act_order=True, static_groups=True)
    assert (a.q != b.q).float().mean() < 0.01
    assert abs(a.loss - b.loss) < 0.01 * b.loss
