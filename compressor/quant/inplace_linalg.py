"""In-place dense linear algebra for GPTQ's ``[in, in]`` Hessians on the CPU.

At ``in = 18,432`` (a DeepSeek-V3 / Kimi K2 dense ``down_proj``) one float32 Hessian is
1.36 GB. torch's ``cholesky_ex`` / ``cholesky_inverse`` / ``index_select`` each make at
least one whole-matrix temporary, so the reference chain (factor, invert, factor the
inverse) holds three such matrices at once. The functions here work in the Hessian's own
storage with temporaries of a few row blocks:

* :func:`permute_symmetric_` -- ``H[perm][:, perm]`` (GPTQ's ``act_order``);
* :func:`upper_cholesky_of_inverse_` -- the upper factor ``U`` of ``H⁻¹ = Uᵀ U`` on the
  exchange-flipped matrix ``J H J``: if ``J H J = L Lᵀ`` (``L`` lower) then
  ``H⁻¹ = J L⁻ᵀ L⁻¹ J = Uᵀ U`` with ``U = J L⁻¹ J`` upper (the Cholesky factor is unique, so
  this is the same matrix as ``cholesky(cholesky_inverse(cholesky(H)), upper=True)``, up to rounding): one factorization
  and one triangular inverse, ``2n³/3`` flops, where torch's chain does about ``n³``. Both
  are blocked (:data:`FACTOR_BLOCK`; right-looking Cholesky, then block forward substitution
  by column blocks) in torch's own BLAS calls -- so ``--threads`` governs them -- and their
  blocks can be dealt to several ranks that need the same factor. Only one triangle is
  written (besides the diagonal blocks, saved first), so the other keeps ``H``'s original
  values and a failed attempt is undone without a copy of the matrix.
"""

from __future__ import annotations

import torch

#: rows per block of the chunked copies (a 1024 x 18,432 float32 block is 75 MB)
BLOCK_ROWS = 1024
#: rows and columns per block of the blocked factorization (:func:`upper_cholesky_of_inverse_`)
FACTOR_BLOCK = 512
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


def upper_cholesky_of_inverse_(H: torch.Tensor, diagonal: torch.Tensor, ranks: tuple[int, int] = (0, 1)) -> bool:
    """Overwrite ``H`` with the upper Cholesky factor ``U`` of ``(H')⁻¹`` (``H⁻¹ = Uᵀ U``), where
    ``H'`` is ``H`` with its diagonal replaced by ``diagonal``.

    ``H``: float32 contiguous ``[n, n]`` CPU tensor, symmetric (only its upper triangle is
    read). ``diagonal``: float32 ``[n]`` (the damped diagonal). Works in ``H``'s memory: no
    ``[n, n]`` temporary, a few ``[n, FACTOR_BLOCK]`` ones (see the module docstring).

    ``ranks``: ``(rank, world_size)`` of the ranks that call this together on the same ``H``
    (GPTQ's row slices of one linear, :func:`compressor.quant.gptq_layer.row_slices`): the
    blocked factorization's row blocks and the inverse's column blocks are dealt to them and
    broadcast (:func:`compressor.distributed.broadcast`), so each does about ``1/world_size`` of
    the ``n³/3`` work of each step. Every block is computed by the same operations on the same
    values whatever the number of ranks, so ``U`` is the same bit for bit; ``(0, 1)``: alone.

    Returns ``True`` with ``U`` in ``H`` (strict lower triangle zero), or ``False`` when
    ``H'`` is not positive definite or its factor is not finite (the same answer on every
    rank); then ``H`` holds ``H'`` again (restored from the triangle the factorization did
    not touch) and the caller may retry with another diagonal. ``H`` need not be exactly
    symmetric in its rounding: after a failed attempt it is symmetric with the values of its
    lower triangle.
    """
    n = H.shape[0]
    flip_(H)  # J H J: its lower triangle is H's upper one mirrored
    dflip = diagonal.flip(0)
    torch.diagonal(H).copy_(dflip)
    blocks = [(a, min(a + FACTOR_BLOCK, n)) for a in range(0, n, FACTOR_BLOCK)]
    saved = [H[a:b, a:b].clone() for a, b in blocks]  # the diagonal blocks: their upper parts are overwritten
    ok = _cholesky_lower_(H, blocks, *ranks)
    if ok:
        _invert_lower_(H, blocks, *ranks)
        ok = _lower_finite(H)  # H's lower triangle now holds L⁻¹, the same on every rank
    if not ok:
        for (a, b), blk in zip(blocks, saved):
            H[a:b, a:b] = blk
        _restore_lower_from_upper_(H, dflip)
        flip_(H)
        return False
    flip_(H)  # J L⁻¹ J in the upper triangle, H's original strict lower triangle below it
    H.triu_()
    return True


def _send(buf: torch.Tensor, src: int, size: int) -> torch.Tensor:
    """``buf`` of rank ``src`` on every one of ``size`` ranks (itself when alone)."""
    if size > 1:
        from ..distributed import broadcast

        broadcast(buf, src)
    return buf


def _cholesky_lower_(A: torch.Tensor, blocks: list[tuple[int, int]], rank: int, size: int) -> bool:
    """Right-looking blocked Cholesky ``A = L Lᵀ`` into ``A``'s lower triangle (its upper triangle
    outside the diagonal blocks untouched). Row block ``i`` belongs to rank ``i % size``: its
    owner keeps it updated, factors it when it is the diagonal block, solves its panel part;
    each step's diagonal factor and panel are broadcast from their owners. ``False`` (on every
    rank) when a diagonal block is not positive definite."""
    for k, (k0, k1) in enumerate(blocks):
        owner = k % size
        status = torch.zeros(1, dtype=torch.int32)
        if owner == rank:
            L, info = torch.linalg.cholesky_ex(A[k0:k1, k0:k1])
            L = L.contiguous()  # LAPACK's column-major result: a broadcast sends the storage as it lies
            status[0] = int(info)
        else:
            L = torch.empty(k1 - k0, k1 - k0)
        if int(_send(status, owner, size)[0]) != 0:
            return False
        A[k0:k1, k0:k1] = _send(L, owner, size)
        rest = blocks[k + 1:]
        for r in range(size):  # the panel below the diagonal block, one broadcast per owner
            mine = [(i0, i1) for j, (i0, i1) in enumerate(rest, k + 1) if j % size == r]
            if not mine:
                continue
            if r == rank:
                panel = torch.cat([torch.linalg.solve_triangular(L.mT, A[i0:i1, k0:k1], upper=True, left=False)
                                   for i0, i1 in mine])
            else:
                panel = torch.empty(sum(i1 - i0 for i0, i1 in mine), k1 - k0)
            _send(panel, r, size)
            p0 = 0
            for i0, i1 in mine:
                A[i0:i1, k0:k1] = panel[p0:p0 + i1 - i0]
                p0 += i1 - i0
        for j, (i0, i1) in enumerate(rest, k + 1):  # this rank's rows of the trailing matrix
            if j % size == rank:
                A[i0:i1, k1:i1].addmm_(A[i0:i1, k0:k1], A[k1:i1, k0:k1].T, alpha=-1)
    return True


def _invert_lower_(A: torch.Tensor, blocks: list[tuple[int, int]], rank: int, size: int) -> None:
    """``A``'s lower triangle ``L`` replaced by ``L⁻¹`` (block forward substitution, column block by
    column block). Column block ``j`` belongs to rank ``j % size``: each rank solves its own in
    ascending order (a column block's solve reads ``L``'s columns from its own on, which this
    rank has not yet overwritten), then every column block is broadcast from its owner."""
    n = A.shape[0]
    for j, (j0, j1) in enumerate(blocks):
        if j % size != rank:
            continue
        X = torch.empty(n - j0, j1 - j0)
        X[:j1 - j0] = torch.linalg.solve_triangular(A[j0:j1, j0:j1], torch.eye(j1 - j0), upper=False)
        for i0, i1 in blocks[j + 1:]:
            rhs = A[i0:i1, j0:i0] @ X[:i0 - j0]
            X[i0 - j0:i1 - j0] = torch.linalg.solve_triangular(A[i0:i1, i0:i1], rhs.neg_(), upper=False)
        A[j0:, j0:j1] = X
        del X
    if size == 1:
        return
    for j, (j0, j1) in enumerate(blocks):
        col = A[j0:, j0:j1].contiguous() if j % size == rank else torch.empty(n - j0, j1 - j0)
        A[j0:, j0:j1] = _send(col, j % size, size)
