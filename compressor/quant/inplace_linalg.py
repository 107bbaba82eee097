"""In-place dense linear algebra for GPTQ's ``[in, in]`` Hessians on the CPU.

At ``in = 18,432`` (a DeepSeek-V3 / Kimi K2 dense ``down_proj``) one float32 Hessian is
1.36 GB. torch's ``cholesky_ex`` / ``cholesky_inverse`` / ``index_select`` each make at
least one whole-matrix temporary, so the reference chain (factor, invert, factor the
inverse) holds three such matrices at once. The functions here work in the Hessian's own
storage with temporaries of a few row blocks:

* :func:`permute_symmetric_` -- ``H[perm][:, perm]`` (GPTQ's ``act_order``);
* :func:`upper_cholesky_of_inverse_` -- the upper factor ``U`` of ``H⁻¹ = Uᵀ U``, by LAPACK
  ``potrf`` and ``trtri`` (through SciPy's wrappers, which work on the tensor's memory when
  it is viewed as a Fortran-ordered array) on the exchange-flipped matrix ``J H J``:
  if ``J H J = Rᵀ R`` (``R`` upper) then ``H = Kᵀ K`` with ``K = J R J`` lower, and
  ``H⁻¹ = Vᵀ V`` with ``V = J R⁻ᵀ J`` upper: ``U = V`` (the Cholesky factor is unique, so
  this is the same matrix as ``cholesky(cholesky_inverse(cholesky(H)), upper=True)``, up
  to rounding). LAPACK only touches one triangle, so the other keeps ``H``'s original
  values and a failed attempt is undone without a copy.
"""

from __future__ import annotations

import torch

#: rows per block of the chunked copies (a 1024 x 18,432 float32 block is 75 MB)
BLOCK_ROWS = 1024
#: rows per block of the flips and finiteness checks, whose elementwise ops make a few
#: temporaries of a block each (128 x 18,432 float32: 9.4 MB)
SMALL_ROWS = 128


def all_finite(t: torch.Tensor, rows: int = SMALL_ROWS) -> bool:
    """Whether a floating tensor holds no NaN/Inf. A finite sum settles it (a NaN or Inf anywhere makes
    the sum NaN or Inf; one reduction, 5-10x faster than ``isfinite``); a sum that overflowed is
    checked element by element, ``rows`` rows at a time (no ``[n, m]`` bool temporary)."""
    if t.numel() and bool(torch.isfinite(t.sum())):
        return True
    if t.ndim == 0:
        return bool(torch.isfinite(t))
    return all(bool(torch.isfinite(t[a:a + rows]).all()) for a in range(0, t.shape[0], rows))


def flip_(A: torch.Tensor, rows: int = SMALL_ROWS) -> torch.Tensor:
    """``A ← J A J`` in place (both axes reversed; ``J`` the exchange matrix), ``rows`` rows at a time.

    ``A``: contiguous ``[n, n]``. Returns ``A``."""
    n = A.shape[0]
    half = n // 2
    for a in range(0, half, rows):
        b = min(a + rows, half)
        top = A[a:b].flip(0, 1)  # a copy
        A[a:b] = A[n - b:n - a].flip(0, 1)
        A[n - b:n - a] = top
    if n % 2:
        A[half] = A[half].flip(0)
    return A


def permute_symmetric_(H: torch.Tensor, perm: torch.Tensor, rows: int = BLOCK_ROWS) -> torch.Tensor:
    """``H ← H[perm][:, perm]`` in ``H``'s storage (``H`` contiguous ``[n, n]``, ``perm`` int64 ``[n]``).

    Columns are permuted ``rows`` rows at a time, then rows by following the permutation's
    cycles with one row of temporary. Returns ``H``."""
    n = H.shape[0]
    for a in range(0, n, rows):
        H[a:a + rows] = H[a:a + rows].index_select(1, perm)
    p = perm.tolist()
    seen = bytearray(n)
    for start in range(n):
        if seen[start] or p[start] == start:
            continue
        tmp = H[start].clone()
        cur = start
        while True:
            seen[cur] = 1
            nxt = p[cur]
            if nxt == start:
                H[cur] = tmp
                break
            H[cur] = H[nxt]
            cur = nxt
    return H


def _restore_lower_from_upper_(A: torch.Tensor, diag: torch.Tensor, rows: int = BLOCK_ROWS) -> None:
    """Rebuild ``A``'s lower triangle from its (untouched) strict upper one and ``diag``: ``A`` symmetric again."""
    n = A.shape[0]
    for a in range(0, n, rows):
        b = min(a + rows, n)
        A[a:b, :a] = A[:a, a:b].T
        blk = A[a:b, a:b]
        up = blk.triu(1)
        blk.copy_(up + up.T)
    torch.diagonal(A).copy_(diag)


def _lower_finite(A: torch.Tensor, rows: int = SMALL_ROWS) -> bool:
    """Whether ``A``'s lower triangle (diagonal included) is finite; temporaries of one block's bools."""
    n = A.shape[0]
    for a in range(0, n, rows):
        b = min(a + rows, n)
        if not (bool(torch.isfinite(A[a:b, :a]).all()) and bool(torch.isfinite(A[a:b, a:b].tril()).all())):
            return False
    return True


def upper_cholesky_of_inverse_(H: torch.Tensor, diagonal: torch.Tensor) -> bool:
    """Overwrite ``H`` with the upper Cholesky factor ``U`` of ``(H')⁻¹`` (``H⁻¹ = Uᵀ U``), where
    ``H'`` is ``H`` with its diagonal replaced by ``diagonal``.

    ``H``: float32 contiguous ``[n, n]`` CPU tensor, symmetric (only its upper triangle is
    read). ``diagonal``: float32 ``[n]`` (the damped diagonal). Works in ``H``'s memory: no
    ``[n, n]`` temporary (LAPACK ``spotrf``/``strtri``, see the module docstring).

    Returns ``True`` with ``U`` in ``H`` (strict lower triangle zero), or ``False`` when
    ``H'`` is not positive definite or its factor is not finite; then ``H`` holds ``H'``
    again (restored from the triangle LAPACK did not touch) and the caller may
    retry with another diagonal. ``H`` need not be exactly symmetric in its rounding: after a
    failed attempt it is symmetric with the values of its lower triangle.
    """
    from scipy.linalg import lapack  # imported on use: only GPTQ on the CPU needs it

    flip_(H)  # J H J: its upper triangle is H's lower one mirrored, its lower one H's upper one
    dflip = diagonal.flip(0)
    torch.diagonal(H).copy_(dflip)
    F = H.numpy().T  # the same memory, Fortran order: F = (J H J)ᵀ = J H J; F's upper = H's lower
    c, info = lapack.spotrf(F, lower=0, clean=0, overwrite_a=1)
    ok = info == 0
    if ok:
        c, info = lapack.strtri(c, lower=0, overwrite_c=1)
        ok = info == 0
    if c.ctypes.data != F.ctypes.data:  # the wrappers copied (they do not for this layout): write back
        F[...] = c
    if ok:
        ok = _lower_finite(H)  # H's lower triangle now holds R⁻ᵀ
    if not ok:
        _restore_lower_from_upper_(H, dflip)
        flip_(H)
        return False
    flip_(H)  # J R⁻ᵀ J in the upper triangle, H's original strict lower triangle below it
    H.triu_()
    return True
