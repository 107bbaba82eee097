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


_RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import compressor.quant.inplace_linalg as la
la.FACTOR_BLOCK = int(sys.argv[1])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if size > 1:
    dist.init_process_group("gloo", rank=rank, world_size=size)
H, d, out = torch.load(sys.argv[2]), torch.load(sys.argv[3]), sys.argv[4]
if d.ndim == 1:
    ok = la.upper_cholesky_of_inverse_(H, d, (rank, size))
    torch.save((ok, H), f"{out}.{rank}")
else:  # d: a weight; this rank's slice of its rows through GPTQ with the factor made together
    from compressor.quant.gptq import gptq_quantize
    r0, r1 = d.shape[0] * rank // size, d.shape[0] * (rank + 1) // size
    r = gptq_quantize(d[r0:r1], H, 4, 128, False, act_order=True, static_groups=True, collective=True)
    torch.save((r.q, r.scale, r.zero_point), f"{out}.{rank}")
if size > 1:
    dist.destroy_process_group()
"""


def _factor_on_ranks(tmp_path, H, d, size, block):
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    torch.save(H, tmp_path / "H.pt")
    torch.save(d, tmp_path / "d.pt")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    procs = [subprocess.Popen([sys.executable, str(script), str(block), str(tmp_path / "H.pt"), str(tmp_path / "d.pt"),
                               str(tmp_path / f"out{size}")],
                              env={**env, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "RANK": str(r),
                                   "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(size)]
    assert [p.wait(timeout=120) for p in procs] == [0] * size
    return [torch.load(tmp_path / f"out{size}.{r}") for r in range(size)]


@pytest.mark.parametrize("good", [True, False])
def test_ranks_dividing_the_factorization_get_one_process_bits(tmp_path, good):
    """Two and three ranks dividing the blocked factorization (rows and column blocks dealt,
    panels broadcast over gloo) leave every rank the one-process factor bit for bit; a matrix
    that is not positive definite fails on every rank and is restored on each."""
    H = _hessian(700, 900, seed=11)
    d = _damped_diag(H)
    if not good:
        d[650] = -1.0  # fails in the sixth of seven diagonal blocks
    ((ok1, ref),) = _factor_on_ranks(tmp_path, H, d, 1, 100)
    assert ok1 is good
    if good:
        torch.testing.assert_close(ref, _torch_inverse_cholesky(H.clone(), d), rtol=1e-3,
                                   atol=1e-4 * float(ref.abs().max()))
    else:
        expect = H.clone()
        torch.diagonal(expect).copy_(d)
        assert torch.equal(ref, expect)
    for size in (2, 3):
        for ok, U in _factor_on_ranks(tmp_path, H, d, size, 100):
            assert ok is good and torch.equal(U, ref)


def test_gptq_row_slices_factor_together_and_join_to_one_process(tmp_path):
    """GPTQ's row slices of one linear (solve_pass under several ranks) on the in-place path:
    the ranks divide the factorization and the joined slices are the one-process result."""
    from compressor.quant.gptq import gptq_quantize

    n = 2048
    H = _hessian(n, 600, seed=4)
    w = torch.randn(48, n, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (BLAS's sums may differ with the thread count)
    try:
        ref = gptq_quantize(w, H, 4, 128, False, act_order=True, static_groups=True)
    finally:
        torch.set_num_threads(threads)
    parts = _factor_on_ranks(tmp_path, H, w, 2, 512)
    for i, t in enumerate((ref.q, ref.scale, ref.zero_point)):
        assert torch.equal(torch.cat([p[i] for p in parts]), t)
