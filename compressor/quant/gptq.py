"""GPTQ: accurate post-training quantization from second-order information.

Frantar, Ashkboos, Hoefler, Alistarh, 2022 (arXiv:2210.17323), algorithm 1, with the refinements the reference
implementation (IST-DASLab/gptq ``gptq.py``) and its descendants (AutoGPTQ, GPTQModel, llm-compressor
``gptq_quantize.py``) use:

* ``H = 2 X Xᵀ / n`` over the calibration tokens (:class:`HessianAccumulator`, streamed);
* dead input channels (``H[i, i] == 0``: the channel never carries signal) get ``H[i, i] = 1`` and their weight
  column is zeroed, as the reference does;
* dampening ``damp * mean(diag(H))`` is added to the diagonal; if the Cholesky factorisation still fails (not
  positive definite) the damping grows by ``max(damp_increment, damp)`` (so at least doubles: a bounded number
  of retries up to ``max_damp``) and is retried, and the damping actually used is reported;
* columns are processed in lazy blocks of ``block_size``: inside a block the error of each quantized column is
  propagated to the remaining columns of the block through the upper Cholesky factor of ``H⁻¹``, and the whole
  block's error is applied to the rest of the matrix in one matmul;
* groups: the qparams of a group are computed from the (error-updated) weights when the loop reaches the group's
  first column; ``act_order`` visits columns by descending ``diag(H)``; with ``static_groups`` the qparams of
  every group are computed up front from the original weights in the original column order, so group boundaries
  survive the reordering and no ``g_idx`` is needed; otherwise groups follow the visiting order and ``g_idx[c]``
  (int32 ``[in]``) tells which group column ``c`` belongs to.

Integers, scales and zero points: the compressed-tensors convention of :mod:`compressor.quant.primitives`
(signed grid); with ``e2m1_steps``, FP4 e2m1 codes on fixed steps instead (NVFP4, MXFP4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import world
from ..errors import InputError, QuantizationError
from ..precision import float32_matmuls
from .fp4 import e2m1_codes, e2m1_values
from .inplace_linalg import all_finite, permute_symmetric_, upper_cholesky_of_inverse_
from .primitives import compute_qparams, qrange, search_qparams


#: inputs at least this wide accumulate ``x^T x`` in blocks of :data:`ROW_BLOCK` rows
ROW_BLOCK_FROM = 4096
ROW_BLOCK = 1024
#: narrower inputs are summed in this many row blocks (each at least :data:`MIN_BLOCK_ROWS`
#: rows): the products of the upper block triangle only, about 5/8 of the full product's
#: work at 4 blocks (SmolLM2's [4096, 1536] rows on an AMD EPYC: 126 -> 70 ms)
SYMMETRIC_BLOCKS = 4
MIN_BLOCK_ROWS = 128
#: inputs at least this wide are factored in place on the CPU (:func:`_inverse_cholesky`):
#: there it is also faster than torch's chain (one thread, best of 3 on the 2-core Xeon, other jobs
#: running: 2048: 0.19 vs 0.56 s; 4096: 0.54 vs 1.47 s)
IN_PLACE_FROM = 2048


class HessianAccumulator:
    """Running ``H = 2/n · Σ x xᵀ`` of one linear's inputs.

    ``add(x)`` takes any ``[..., in]`` float tensor; partial products are computed in
    float32 (BLAS; also inside a bfloat16 calibration pass: products rounded to bfloat16 made
    SmolLM2's Hessians indefinite in 4-9 of 30 layers) and summed in float64, so long
    calibration runs do not lose precision.

    ``H`` is symmetric, so only its upper block triangle is summed: the rows are split in
    blocks (:data:`ROW_BLOCK` rows from :data:`ROW_BLOCK_FROM` inputs up, else
    :data:`SYMMETRIC_BLOCKS` blocks), block ``i`` (rows ``r0:r1``) holds columns ``r0:`` and
    is updated from ``x[:, r0:r1]ᵀ x[:, r0:]``; :meth:`hessian` fills the lower triangle from
    the transpose. With ``consume`` each float64 block is turned into float32 and released
    before the next: at in = 18,432 (a DeepSeek-V3/Kimi dense down_proj) the float64 sum
    holds about half the matrix (1.4 GB), no 4 GB float32/float64 temporary of the whole
    matrix is ever made, and the float64 sum and the float32 Hessian are never both whole.
    With ``ranks`` (several ranks running the same pass) each rank sums only its blocks.
    """

    #: the reader set's :class:`CrossAccumulator` when GPTQ's float target is on (set by
    #: :func:`compressor.quant.gptq_layer.accumulate_hessians`), else None
    cross: "CrossAccumulator | None" = None

    def __init__(self, in_features: int, device="cpu", ranks: tuple[int, int] = (0, 1)):
        step = (ROW_BLOCK if in_features >= ROW_BLOCK_FROM
                else max(-(-in_features // SYMMETRIC_BLOCKS), MIN_BLOCK_ROWS))
        self.in_features = in_features
        #: first row of each block
        self.starts = list(range(0, in_features, step))
        self.blocks: list[torch.Tensor] | None = [
            torch.zeros(min(step, in_features - r0), in_features - r0, dtype=torch.float64, device=device)
            for r0 in self.starts]
        #: ``(rank, world_size)`` of ranks that run the same pass and divide the sums: block ``i`` is
        #: summed on rank ``i % world_size`` only, until the blocks are exchanged
        #: (:func:`compressor.quant.gptq_layer.share_hessians`, which sets :attr:`complete`)
        self.ranks = ranks
        self.complete = ranks[1] == 1
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        rank, size = self.ranks
        for i, (r0, b) in enumerate(zip(self.starts, self.blocks)):
            if i % size == rank:
                b += x[:, r0:r0 + b.shape[0]].t() @ x[:, r0:]
        self.n += x.shape[0]

    def hessian(self, consume: bool = False) -> torch.Tensor:
        """``[in, in]`` float32; raises :class:`QuantizationError` if no token was seen.

        ``consume``: scale each float64 block in place (the same values), convert it and
        release it before the next, leaving the accumulator unusable (``blocks`` is ``None``)."""
        if self.n == 0:
            raise QuantizationError("GPTQ Hessian has no calibration tokens")
        if not self.complete:
            raise RuntimeError("a Hessian divided across ranks read before its blocks were exchanged")
        out = torch.empty(self.in_features, self.in_features, dtype=torch.float32, device=self.blocks[0].device)
        blocks = self.blocks
        if consume:
            self.blocks = None
            blocks.reverse()  # popped from the end, first block first
        for i, r0 in enumerate(self.starts):
            b = blocks.pop() if consume else blocks[i]
            r1 = r0 + b.shape[0]
            out[r0:r1, r0:] = b.mul_(2.0).div_(self.n) if consume else 2.0 * b / self.n
            out[r0:r1, :r0] = out[:r0, r0:r1].t()
            del b
        return out


class CrossAccumulator:
    """Running ``Σ (x_f - x_q)ᵀ x_q`` (float64 ``[in, in]``) over paired token rows: ``x_f`` a
    linear's input in the float model, ``x_q`` its input in the partly quantized model (the
    rows GPTQ's Hessian sums). :meth:`matrix` returns ``2 (X_f - X_q)ᵀ X_q / n``, on the
    scale of :meth:`HessianAccumulator.hessian`."""

    def __init__(self, in_features: int, device="cpu"):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.n = 0

    @torch.no_grad()
    def add(self, x_f: torch.Tensor, x_q: torch.Tensor) -> None:
        """``x_f``, ``x_q``: ``[..., in]`` with the same token rows (any float dtype)."""
        xq = x_q.detach().reshape(-1, x_q.shape[-1]).float()
        xf = x_f.detach().reshape(-1, x_f.shape[-1]).to(device=xq.device, dtype=torch.float32)
        self.sum += ((xf - xq).t() @ xq).double()
        self.n += xq.shape[0]

    def matrix(self) -> torch.Tensor:
        """``[in, in]`` float32; raises :class:`QuantizationError` if no row was seen."""
        if self.n == 0:
            raise QuantizationError("GPTQ's float target has no calibration tokens")
        return (2.0 * self.sum / self.n).float()


@torch.no_grad()
@float32_matmuls()
def float_target(w: torch.Tensor, H: torch.Tensor, cross: torch.Tensor, alpha: float, damp: float) -> torch.Tensor:
    """The weight GPTQ quantizes under asymmetric calibration (GPTAQ, Li et al., 2025,
    arXiv:2504.02692): ``W + alpha · W C (H + λI)⁻¹``.

    GPTQ minimises ``‖W X_q - Q X_q‖²`` on the inputs ``X_q`` of the partly quantized model,
    so every layer keeps the errors of the layers before it. The float model's output is
    ``W X_f``; ``‖W X_f - Q X_q‖²`` equals ``‖W* X_q - Q X_q‖²`` up to a constant for the
    least-squares target ``W* = W + W (X_f - X_q) X_qᵀ (X_q X_qᵀ)⁻¹``, i.e. ``alpha = 1`` with
    ``C = 2 (X_f - X_q) X_qᵀ / n`` (``cross``) and ``H = 2 X_q X_qᵀ / n``. ``alpha`` below 1
    moves only part of the way (GPTAQ's own default is 0.25: the full correction fits the
    calibration tokens' noise); ``λ = damp · mean(diag(H))``, GPTQ's damping.

    Args:
        w: float ``[out, in]``. H, cross: float32 ``[in, in]`` (neither modified).
        alpha: 0..1. damp: relative dampening (the recipe's ``gptq.damp``).

    Returns:
        float32 ``[out, in]`` (``w`` itself, as float32, when ``alpha`` is 0).

    Raises:
        QuantizationError: ``H + λI`` is not positive definite.
    """
    W = w.detach().float()
    if alpha == 0.0:
        return W
    Hd = H.float().clone()
    diag = torch.diagonal(Hd)
    diag[diag == 0] = 1.0  # dead inputs (as GPTQ's preparation)
    diag.add_(damp * float(diag.mean()))
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info) != 0:
        raise QuantizationError("GPTQ's float target: the damped Hessian is not positive definite")
    del Hd
    return W + alpha * torch.cholesky_solve(cross.float().t() @ W.t(), L).t()


@dataclass
class GPTQResult:
    """Output of :func:`gptq_quantize`.

    ``q`` int8 ``[out, in]`` (original column order), ``scale`` float32 ``[out, G]``,
    ``zero_point`` int8 ``[out, G]``, ``g_idx`` int32 ``[in]`` or ``None`` when groups are
    contiguous (``c // group_size``), ``loss`` the GPTQ objective ``Σ (w - ŵ)² / [H⁻¹]_cc``
    / 2 summed over the matrix, ``damp`` the relative damping used, ``retries`` how many
    times it was increased, ``dead_channels`` the number of zero-diagonal inputs, ``target``
    (``keep_target`` only, else ``None``) float32 ``[out, in]`` in the original column order:
    each weight as GPTQ rounded it, the earlier columns' errors fed back (``q`` is its
    round-to-nearest on the grid of ``scale``/``zero_point``; :mod:`compressor.quant.refine` starts there).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    g_idx: torch.Tensor | None
    loss: float
    damp: float
    retries: int
    dead_channels: int
    target: torch.Tensor | None = None


def _inverse_cholesky(H: torch.Tensor, damp: float, damp_increment: float, max_damp: float, name: str,
                      ranks: tuple[int, int] = (0, 1)):
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp · mean(diag H)``, retrying with more damping.

    Works in ``H``'s storage (the caller's own float32 copy, overwritten). On the CPU, from
    :data:`IN_PLACE_FROM` inputs, the factor is computed in place
    (:func:`~compressor.quant.inplace_linalg.upper_cholesky_of_inverse_`: a blocked Cholesky
    factorization and triangular inverse of the flipped matrix), so one ``[in, in]`` matrix is
    alive (at in = 18,432: 1.36 GB, where torch's chain holds three); a failed attempt restores
    ``H`` from the triangle left alone. Otherwise (narrower inputs, CUDA) torch's ``cholesky_ex`` /
    ``cholesky_inverse`` run with the inverse in ``H`` and its factor in the first factor's
    buffer (two matrices). ``ranks``: ``(rank, world_size)`` of ranks factoring the same ``H``
    together (in place only; the same ``U`` bit for bit). Returns ``(U, damp_used, retries)``."""
    diag0 = torch.diagonal(H).clone()
    mean_diag = float(diag0.mean())
    retries = 0
    in_place = (H.device.type == "cpu" and H.dtype == torch.float32 and H.is_contiguous()
                and H.shape[0] >= IN_PLACE_FROM)
    while True:
        if in_place:
            if upper_cholesky_of_inverse_(H, diag0 + damp * mean_diag, ranks):
                return H, damp, retries
        else:
            U = _torch_inverse_cholesky(H, diag0 + damp * mean_diag)
            if U is not None:
                return U, damp, retries
        retries += 1
        damp = damp + max(damp_increment, damp)  # at least doubles: bounded number of retries
        if damp > max_damp:
            raise QuantizationError(
                f"GPTQ Hessian of {name} is not positive definite even with damping {max_damp:g}; "
                "check the calibration data (constant or NaN activations?)"
            )


def _torch_inverse_cholesky(H: torch.Tensor, diagonal: torch.Tensor) -> torch.Tensor | None:
    """torch's chain for :func:`_inverse_cholesky` (any device): ``H``'s diagonal set to ``diagonal``,
    the upper factor of its inverse returned, or ``None`` (``H`` restored) when it does not factor.

    ``(H + λI)⁻¹`` goes into ``H``; in the rare case where ``H + λI`` factors but its inverse
    does not, ``H`` is rebuilt by inverting the inverse (its diagonal is rewritten by the retry)."""
    torch.diagonal(H).copy_(diagonal)
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        return None
    torch.cholesky_inverse(L, out=H)
    U, info = torch.linalg.cholesky_ex(H, upper=True, out=(L, info))
    if int(info) == 0 and all_finite(U):
        return U
    H.copy_(torch.linalg.inv(H))
    return None


@dataclass(frozen=True)
class _Grid:
    """The integer grid of one :func:`gptq_quantize` call.

    ``group_size`` is the effective one (``in`` for per-channel); ``qmin``/``qmax`` come from
    :func:`~compressor.quant.primitives.qrange`; every scale is rounded to ``scale_dtype``.
    """

    num_bits: int
    symmetric: bool
    group_size: int
    scale_dtype: torch.dtype
    qmin: int
    qmax: int
    #: range search (:func:`~compressor.quant.primitives.search_qparams`): candidates
    #: ``1 - k/clip_grid`` below ``clip_max_shrink``; ``None``: min-max qparams
    clip_grid: int | None = None
    clip_max_shrink: float = 0.0
    #: FP4 e2m1 codes on fixed steps (NVFP4, MXFP4: ``gptq_quantize``'s ``e2m1_steps``), not integers
    e2m1: bool = False

    def qparams(self, W: torch.Tensor, h_blocks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Qparams of ``W [out, k·gs]`` (scale already rounded to ``scale_dtype``, float32; zero int8):
        min-max, or the range search scored by ``h_blocks`` (``[k, gs, gs]`` or ``[k, gs]``)."""
        if self.clip_grid is None:
            s, z = compute_qparams(W, self.num_bits, self.group_size, self.symmetric)
            return s.to(self.scale_dtype).float(), z
        return search_qparams(W, self.num_bits, self.group_size, self.symmetric, h_blocks, self.clip_grid,
                              self.clip_max_shrink, self.scale_dtype)


def _prepare_inputs(w: torch.Tensor, H: torch.Tensor, name: str,
                    consume: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 copies ``W [out, in]`` and ``H [in, in]`` (on ``w``'s device) with dead channels fixed.
    With ``consume`` a float32 ``H`` already on that device is used (and overwritten) as it is.

    A dead input channel (``H[i, i] == 0``) gets ``H[i, i] = 1`` and its weight column zeroed,
    as in the reference implementation. Returns ``(W, H, dead)``, ``dead`` a bool ``[in]`` mask.

    Raises:
        QuantizationError: ``w`` or ``H`` holds NaN or Inf.
    """
    H2 = H.detach().float().to(w.device)
    H = H2.clone() if not consume and H2.data_ptr() == H.data_ptr() else H2
    if not all_finite(H):
        raise QuantizationError(f"GPTQ input for {name} contains NaN or Inf")
    dead = torch.diag(H) == 0
    W = _prepared_weights(w, dead, name)
    H[dead, dead] = 1.0
    return W, H, dead


def _factorize(W: torch.Tensor, H: torch.Tensor, f: "HessianFactor", act_order: bool, dynamic_gs: int | None,
               damping: tuple[float, float, float], name: str, ranks: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Fill ``f`` from the prepared ``H`` (worked on in place): ``act_order``'s permutation, the
    blocks of the permuted ``H`` for dynamic groups' range search (``dynamic_gs``), the damped
    inverse's upper Cholesky factor. Returns ``W`` in the visiting order."""
    if act_order:
        W, H, f.perm = _act_order_permutation(W, H)
    # dynamic groups follow the visiting order: their blocks of the (permuted) Hessian
    f.dynamic_blocks = _hessian_blocks(H, dynamic_gs) if dynamic_gs else None
    f.U, f.damp, f.retries = _inverse_cholesky(H, *damping, name, ranks)
    return W


def _prepared_weights(w: torch.Tensor, dead: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`_prepare_inputs`' ``W`` for a Hessian already prepared (its ``dead`` input channels known)."""
    W = w.detach().float().clone()
    if not all_finite(W):
        raise QuantizationError(f"GPTQ input for {name} contains NaN or Inf")
    W[:, dead] = 0.0
    return W


@dataclass
class HessianFactor:
    """What :func:`gptq_quantize` derives from ``H`` alone, kept for the other linears that read
    the same input (a routed expert's gate and up: solved one by one when their stacked rows are
    large, :data:`compressor.quant.gptq_layer.BATCH_BYTES`): the dead input channels, the
    range search's blocks of ``H`` (``[G, gs, gs]``), ``act_order``'s permutation, the upper
    Cholesky factor ``U`` of the damped inverse and the damping it took. Reusing it gives each
    linear the integers and scales its own factorization would, bit for bit."""

    dead: torch.Tensor
    static_blocks: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    dynamic_blocks: torch.Tensor | None = None
    U: torch.Tensor | None = None
    damp: float = 0.0
    retries: int = 0


def _hessian_blocks(H: torch.Tensor, gs: int) -> torch.Tensor:
    """The groups' diagonal blocks of ``H [in, in]`` as ``[G, gs, gs]`` (a copy), or its diagonal
    as ``[1, in]`` when one group spans the row (per-channel: the block would be all of ``H``)."""
    in_f = H.shape[0]
    if gs == in_f:
        return torch.diagonal(H).clone().unsqueeze(0)
    return torch.stack([H[g:g + gs, g:g + gs] for g in range(0, in_f, gs)])


def _act_order_permutation(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``act_order``: columns by descending ``diag(H)``; returns ``(W[:, perm], H[perm][:, perm], perm)``,
    the permuted ``H`` written into ``H``'s own storage (one ``[in, in]`` temporary below
    :data:`ROW_BLOCK_FROM` inputs, row blocks above: :func:`~compressor.quant.inplace_linalg.permute_symmetric_`)."""
    perm = torch.argsort(torch.diag(H), descending=True)
    if H.shape[0] >= ROW_BLOCK_FROM and H.is_contiguous():
        permute_symmetric_(H, perm)
    else:
        rows = H.index_select(0, perm)
        torch.index_select(rows, 1, perm, out=H)
    return W[:, perm], H, perm


def _quantize_block(W1t: torch.Tensor, U1: torch.Tensor, i1: int, col_group_list: list[int], scale_t: torch.Tensor,
                    zero_f: torch.Tensor, grid: _Grid, static: bool,
                    h_blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of one lazy block, propagating each column's error inside the block.

    Works on the block transposed, so every column is a contiguous row and each step writes
    into buffers made once per block (the loop is bound by per-operation overhead, not by
    arithmetic). ``W1t`` ``[b, out]`` (updated in place) holds columns ``i1 .. i1 + b`` in
    visiting order, ``U1`` ``[b, b]`` the matching block of the upper Cholesky factor of
    ``H⁻¹``. ``scale_t`` and ``zero_f`` (integer zero points held as float32) are the
    qparams transposed, float32 ``[G, out]``; unless ``static``, a group's qparams are computed when
    its first column is reached and written there (range search: scored by ``h_blocks[g]``,
    the Hessian's block of the group's visited columns). Returns ``Q1t`` (float32 integer
    values ``[b, out]``) and ``Err1t`` (the scaled errors ``[b, out]``, for the update of the
    remaining columns and the loss).
    """
    gs = grid.group_size
    b = W1t.shape[0]
    Err1t = torch.empty_like(W1t)
    Q1t = torch.empty_like(W1t)
    deq = torch.empty_like(W1t[0])
    diag = torch.diagonal(U1).tolist()
    for i in range(b):
        j = i1 + i
        g = col_group_list[j]
        if not static and j % gs == 0:
            s, z = grid.qparams(W1t[i : i + gs].t().contiguous(), None if h_blocks is None else h_blocks[g : g + 1])
            scale_t[g] = s[:, 0]
            zero_f[g] = z[:, 0]
        s_col, z_col, col, q, err = scale_t[g], zero_f[g], W1t[i], Q1t[i], Err1t[i]
        if grid.e2m1:  # the code nearest col / step (ties to even, saturated at 6), as the format's RTN rounds
            q.copy_(e2m1_codes(torch.div(col, s_col, out=deq)))
            torch.mul(e2m1_values(q.to(torch.uint8)), s_col, out=deq)
        else:
            torch.div(col, s_col, out=q)
            q.round_().add_(z_col).clamp_(grid.qmin, grid.qmax)
            torch.sub(q, z_col, out=deq).mul_(s_col)
        torch.sub(col, deq, out=err).div_(diag[i])
        if i + 1 < b:
            W1t[i + 1:].sub_(torch.outer(U1[i, i + 1:], err))
    return Q1t, Err1t


def _quantize_columns(W: torch.Tensor, U: torch.Tensor, grid: _Grid, block_size: int, perm: torch.Tensor | None,
                      static_qparams: tuple[torch.Tensor, torch.Tensor] | None, h_blocks: torch.Tensor | None = None,
                      keep_target: bool = False):
    """The blocked column loop of GPTQ (algorithm 1) over ``W`` ``[out, in]`` in visiting order.

    Blocks are widened to a multiple of the group size so a group never straddles a block;
    after each block its error is applied to the remaining columns in one matmul (``W`` is
    updated in place). With ``static_qparams`` column ``j`` belongs to group
    ``perm[j] // group_size``, otherwise to ``j // group_size`` (``h_blocks``: the Hessian's
    blocks of those visited groups, for the range search). With ``keep_target`` each block's
    columns are written back into ``W`` as they were rounded (the error fed back from the
    columns before them), so ``W`` ends holding what GPTQ rounded.

    Returns ``(Q, scale, zero, col_group, losses)``: int8 ``[out, in]`` in visiting order,
    float32 and int8 ``[out, G]``, the int64 group of each visited column ``[in]``, and the
    float64 per-row loss ``[out]`` (``Σ_c err_c² / 2`` of the scaled errors).
    """
    out_f, in_f = W.shape
    gs = grid.group_size
    if gs < in_f:
        block_size = max(gs, (block_size // gs) * gs)  # a group never straddles a block
    n_groups = in_f // gs
    Q = torch.empty(out_f, in_f, dtype=torch.int8, device=W.device)
    scale_t = torch.empty(n_groups, out_f, dtype=torch.float32, device=W.device)
    zero_f = torch.empty(n_groups, out_f, dtype=torch.float32, device=W.device)
    if static_qparams is not None:
        scale_t.copy_(static_qparams[0].t())
        zero_f.copy_(static_qparams[1].t())
    # group of the column visited at position j (original index perm[j])
    orig = perm if perm is not None else torch.arange(in_f, device=W.device)
    col_group = (orig // gs) if static_qparams is not None else (torch.arange(in_f, device=W.device) // gs)
    col_group_list = col_group.tolist()
    losses = torch.zeros(out_f, dtype=torch.float64, device=W.device)

    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1t = W[:, i1:i2].t().contiguous()
        Q1t, Err1t = _quantize_block(W1t, U[i1:i2, i1:i2], i1, col_group_list, scale_t, zero_f, grid,
                                     static_qparams is not None, h_blocks)
        if keep_target:  # each row of W1t is final once its column is rounded
            W[:, i1:i2] = W1t.t()
        del W1t
        Q[:, i1:i2] = Q1t.t()
        losses += Err1t.double().square_().sum(0).div_(2)
        if i2 < in_f:
            W[:, i2:] -= Err1t.t().contiguous() @ U[i1:i2, i2:]
    return Q, scale_t.t().contiguous(), zero_f.t().to(torch.int8).contiguous(), col_group, losses


def _restore_column_order(Q: torch.Tensor, perm: torch.Tensor | None, col_group: torch.Tensor,
                          static: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Undo the ``act_order`` permutation of ``Q`` ``[out, in]``; returns ``(Q, g_idx)``.

    ``g_idx`` (int32 ``[in]``, group of each original column) only when columns were
    reordered without static groups; ``None`` when groups stay contiguous.
    """
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if not static:
            g_idx = col_group[inv].to(torch.int32)
    return Q, g_idx


def _check_finite(scale: torch.Tensor, losses: torch.Tensor, scale_dtype: torch.dtype, name: str) -> None:
    """Raises InputError for scales beyond ``scale_dtype`` (float16), QuantizationError for NaN or Inf."""
    if torch.isinf(scale).any() and scale_dtype.itemsize < 4 and not torch.isnan(scale).any():
        raise InputError(f"the weight scales of {name} overflow {str(scale_dtype).removeprefix('torch.')} "
                         f"(largest it stores: {torch.finfo(scale_dtype).max:g}); store the artifact in bfloat16 "
                         "(--dtype bfloat16) or float32")
    if not (torch.isfinite(scale).all() and torch.isfinite(losses).all()):
        raise QuantizationError(f"GPTQ produced NaN or Inf for {name}")


@torch.no_grad()
@float32_matmuls()  # the error feedback is never rounded to bfloat16 (--matmul-precision)
def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    block_size: int = 128,
    damp: float = 0.01,
    damp_increment: float = 0.01,
    max_damp: float = 1.0,
    act_order: bool = False,
    static_groups: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    name: str = "",
    consume_hessian: bool = False,
    clip_grid: int | None = None,
    clip_max_shrink: float = 0.25,
    keep_target: bool = False,
    factors: dict | None = None,
    collective: bool = False,
    e2m1_steps: torch.Tensor | None = None,
) -> GPTQResult:
    """Quantize one weight matrix with GPTQ (Frantar et al., 2022, algorithm 1, as the reference implementation).

    Steps: float32 copies with dead channels fixed (:func:`_prepare_inputs`); static group
    qparams from the original weights (``static_groups``, or per-channel); the ``act_order``
    permutation; the upper Cholesky factor of the damped ``H⁻¹`` (:func:`_inverse_cholesky`,
    with retries); the blocked column loop (:func:`_quantize_columns`); un-permutation and
    ``g_idx`` (:func:`_restore_column_order`).

    Args:
        w: ``[out, in]`` float weight (not modified).
        H: ``[in, in]`` float Hessian ``2 X Xᵀ / n`` of the layer inputs (not modified, unless
            ``consume_hessian``: then a float32 ``H`` on ``w``'s device is worked on in place and
            left holding intermediate values, so no copy of it is made).
        num_bits: 2..8. group_size: divides ``in``; ``-1`` per output channel. symmetric: signed
            symmetric grid (zero point 0) or asymmetric. block_size: columns per lazy-update block.
        damp: dampening relative to ``mean(diag(H))`` (paper: 0.01); damp_increment, max_damp: retry
            schedule when ``H + λI`` is not positive definite.
        act_order: visit columns by descending ``diag(H)``.
        static_groups: with ``act_order``, fix the groups' qparams before reordering.
        scale_dtype: storage dtype of the scales; every scale is rounded to it as soon as it
            is computed, so the error GPTQ propagates is the error of the stored weights. name: for errors.
        clip_grid, clip_max_shrink: each group's range from a grid search
            (:func:`~compressor.quant.primitives.search_qparams`: shrinks ``1 - k/clip_grid``
            below ``clip_max_shrink``, scored by ``Δ_gᵀ H_gg Δ_g`` on the group's block of ``H``),
            made where min-max qparams are (up front for static groups, else when the loop
            reaches the group); ``clip_grid=None``: min-max, as the paper.
        keep_target: also return the weights as GPTQ rounded them (:attr:`GPTQResult.target`).
        factors: a dict kept per ``H`` by the caller: the first call stores its :class:`HessianFactor`,
            later ones with the same settings reuse it (``H`` not read); drop it after the last.
        collective: every rank calls this with the same ``H`` (each for its rows): they divide its factorization.
        e2m1_steps: ``[out, in / group_size]`` float32: round onto the FP4 e2m1 grid of these steps (NVFP4, MXFP4:
            :func:`compressor.quant.fp4.group_steps`, fixed as static groups are), not integers; ``q`` then holds
            the e2m1 codes (0..15), ``scale`` the steps (``num_bits``, ``symmetric``, ``clip_grid``: not read).

    Returns:
        :class:`GPTQResult`.

    Raises:
        InputError: ``num_bits`` outside 2..8.
        QuantizationError: the Hessian stays non positive definite, or non-finite values appear.
    """
    _out_f, in_f = w.shape
    gs = in_f if group_size in (-1, 0, None) else int(group_size)
    qmin, qmax = qrange(num_bits)
    e2m1 = e2m1_steps is not None
    grid = _Grid(num_bits, symmetric, gs, scale_dtype, qmin, qmax, None if e2m1 else clip_grid, clip_max_shrink, e2m1)
    static = static_groups or gs == in_f or e2m1
    settings = (gs, static, bool(act_order), clip_grid, damp, damp_increment, max_damp)
    f = factors.get(settings) if factors is not None else None
    if f is None:
        W, H, dead = _prepare_inputs(w, H, name, consume_hessian)
        f = HessianFactor(dead, _hessian_blocks(H, gs) if clip_grid and static else None)
    else:
        W = _prepared_weights(w, f.dead, name)
    # static groups (and e2m1 steps): each group's qparams fixed up front, from the weights in their own column order
    static_qparams = ((e2m1_steps.float().to(W.device), torch.zeros_like(e2m1_steps, dtype=torch.int8, device=W.device))
                      if e2m1 else grid.qparams(W, f.static_blocks) if static else None)
    if f.U is None:
        W = _factorize(W, H, f, act_order, gs if clip_grid and not static else None, (damp, damp_increment, max_damp),
                       name, world() if collective else (0, 1))
        del H
        if factors is not None:
            factors[settings] = f
    elif f.perm is not None:
        W = W[:, f.perm]
    perm, n_dead = f.perm, int(f.dead.sum())
    Q, scale, zero, col_group, losses = _quantize_columns(W, f.U, grid, block_size, perm, static_qparams,
                                                          f.dynamic_blocks, keep_target)
    Q, g_idx = _restore_column_order(Q, perm, col_group, static_qparams is not None)
    target = None
    if keep_target:
        target = W[:, torch.argsort(perm)] if perm is not None else W
    del W
    _check_finite(scale, losses, scale_dtype, name)
    return GPTQResult(
        q=Q.contiguous(), scale=scale, zero_point=zero, g_idx=g_idx, loss=float(losses.sum()),
        damp=f.damp, retries=f.retries, dead_channels=n_dead, target=target,
    )
