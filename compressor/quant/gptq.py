"""GPTQ: accurate post-training quantization from second-order information.

Frantar, Ashkboos, Hoefler, Alistarh, 2022 (arXiv:2210.17323), algorithm 1, with the
refinements the reference implementation (IST-DASLab/gptq ``gptq.py``) and its
descendants (AutoGPTQ, GPTQModel, llm-compressor ``gptq_quantize.py``) use:

* ``H = 2 X Xᵀ / n`` over the calibration tokens (:class:`HessianAccumulator`, streamed);
* dead input channels (``H[i, i] == 0``: the channel never carries signal) get
  ``H[i, i] = 1`` and their weight column is zeroed, as the reference does;
* dampening ``damp * mean(diag(H))`` is added to the diagonal; if the Cholesky
  factorisation still fails (not positive definite) the damping grows by
  ``max(damp_increment, damp)`` (so at least doubles: a bounded number of retries up to
  ``max_damp``) and is retried, and the damping actually used is reported;
* columns are processed in lazy blocks of ``block_size``: inside a block the error of
  each quantized column is propagated to the remaining columns of the block through the
  upper Cholesky factor of ``H⁻¹``, and the whole block's error is applied to the rest
  of the matrix in one matmul;
* groups: the qparams of a group are computed from the (error-updated) weights when the
  loop reaches the group's first column; ``act_order`` visits columns by descending
  ``diag(H)``; with ``static_groups`` the qparams of every group are computed up front
  from the original weights in the original column order, so group boundaries survive
  the reordering and no ``g_idx`` is needed; otherwise groups follow the visiting order
  and ``g_idx[c]`` (int32 ``[in]``) tells which group column ``c`` belongs to.

Integers, scales and zero points use the compressed-tensors convention of
:mod:`compressor.quant.primitives` (signed grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from .primitives import compute_qparams, qrange


class HessianAccumulator:
    """Running ``H = 2/n · Σ x xᵀ`` of one linear's inputs.

    ``add(x)`` takes any ``[..., in]`` float tensor; partial products are computed in
    float32 (BLAS) and summed in float64, so long calibration runs do not lose precision.
    """

    def __init__(self, in_features: int, device="cpu"):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.sum += (x.t() @ x).double()
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """``[in, in]`` float32; raises :class:`QuantizationError` if no token was seen."""
        if self.n == 0:
            raise QuantizationError("GPTQ Hessian has no calibration tokens")
        return (2.0 * self.sum / self.n).float()


@dataclass
class GPTQResult:
    """Output of :func:`gptq_quantize`.

    ``q`` int8 ``[out, in]`` (original column order), ``scale`` float32 ``[out, G]``,
    ``zero_point`` int8 ``[out, G]``, ``g_idx`` int32 ``[in]`` or ``None`` when groups are
    contiguous (``c // group_size``), ``loss`` the GPTQ objective ``Σ (w - ŵ)² / [H⁻¹]_cc``
    / 2 summed over the matrix, ``damp`` the relative damping used, ``retries`` how many
    times it was increased, ``dead_channels`` the number of zero-diagonal inputs.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    g_idx: torch.Tensor | None
    loss: float
    damp: float
    retries: int
    dead_channels: int


def _inverse_cholesky(H: torch.Tensor, damp: float, damp_increment: float, max_damp: float, name: str):
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = damp · mean(diag H)``, retrying with more damping."""
    mean_diag = float(torch.diag(H).mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    retries = 0
    while True:
        Hd = H + (damp * mean_diag) * eye
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0 and torch.isfinite(U).all():
                return U, damp, retries
        retries += 1
        damp = damp + max(damp_increment, damp)  # at least doubles: bounded number of retries
        if damp > max_damp:
            raise QuantizationError(
                f"GPTQ Hessian of {name} is not positive definite even with damping {max_damp:g}; "
                "check the calibration data (constant or NaN activations?)"
            )


@torch.no_grad()
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
) -> GPTQResult:
    """Quantize one weight matrix with GPTQ.

    Args:
        w: ``[out, in]`` float weight (not modified).
        H: ``[in, in]`` float Hessian ``2 X Xᵀ / n`` of the layer inputs (not modified).
        num_bits: 2..8. group_size: divides ``in``; ``-1`` per output channel.
        symmetric: signed symmetric grid (zero point 0) or asymmetric.
        block_size: columns per lazy-update block.
        damp: dampening relative to ``mean(diag(H))`` (paper: 0.01).
        damp_increment, max_damp: retry schedule when ``H + λI`` is not positive definite.
        act_order: visit columns by descending ``diag(H)``.
        static_groups: with ``act_order``, fix the groups' qparams before reordering.
        scale_dtype: storage dtype of the scales; every scale is rounded to it as soon as it
            is computed, so the error GPTQ propagates is the error of the stored weights.
        name: module name for error messages.

    Returns:
        :class:`GPTQResult`.

    Raises:
        QuantizationError: the Hessian stays non positive definite, or non-finite values appear.
    """
    out_f, in_f = w.shape
    gs = in_f if group_size in (-1, 0, None) else int(group_size)
    qmin, qmax = qrange(num_bits)
    W = w.detach().float().clone()
    H = H.detach().float().clone().to(W.device)
    if not (torch.isfinite(W).all() and torch.isfinite(H).all()):
        raise QuantizationError(f"GPTQ input for {name} contains NaN or Inf")
    dead = torch.diag(H) == 0
    n_dead = int(dead.sum())
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    static_qparams = None
    if static_groups or gs == in_f:
        # groups fixed from the original weights, original column order
        s0, z0 = compute_qparams(W, num_bits, gs, symmetric)
        static_qparams = (s0.to(scale_dtype).float(), z0)

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    U, damp_used, retries = _inverse_cholesky(H, damp, damp_increment, max_damp, name)
    del H

    if gs < in_f:
        block_size = max(gs, (block_size // gs) * gs)  # a group never straddles a block
    n_groups = in_f // gs
    Q = torch.empty(out_f, in_f, dtype=torch.int8, device=W.device)
    scale = torch.empty(out_f, n_groups, dtype=torch.float32, device=W.device)
    zero = torch.empty(out_f, n_groups, dtype=torch.int8, device=W.device)
    if static_qparams is not None:
        scale.copy_(static_qparams[0])
        zero.copy_(static_qparams[1])
    # group of the column visited at position j (original index perm[j])
    orig = perm if perm is not None else torch.arange(in_f, device=W.device)
    col_group = (orig // gs) if static_qparams is not None else (torch.arange(in_f, device=W.device) // gs)
    col_group_list = col_group.tolist()
    losses = torch.zeros(out_f, dtype=torch.float64, device=W.device)

    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        Q1 = torch.empty(out_f, i2 - i1, dtype=torch.float32, device=W.device)
        s_col = z_col = None
        for i in range(i2 - i1):
            j = i1 + i
            g = col_group_list[j]
            if static_qparams is None and j % gs == 0:
                s, z = compute_qparams(W1[:, i : i + gs], num_bits, gs, symmetric)
                scale[:, g] = s[:, 0].to(scale_dtype).float()
                zero[:, g] = z[:, 0]
            s_col = scale[:, g]
            z_col = zero[:, g].float()
            col = W1[:, i]
            q = torch.clamp(torch.round(col / s_col) + z_col, qmin, qmax)
            Q1[:, i] = q
            deq = (q - z_col) * s_col
            d = U1[i, i]
            err = (col - deq) / d
            losses += ((col - deq) ** 2 / d**2).double() / 2
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        Q[:, i1:i2] = Q1.to(torch.int8)
        if i2 < in_f:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if static_qparams is None:
            g_idx = col_group[inv].to(torch.int32)
    if not (torch.isfinite(scale).all() and torch.isfinite(losses).all()):
        raise QuantizationError(f"GPTQ produced NaN or Inf for {name}")
    return GPTQResult(
        q=Q.contiguous(), scale=scale, zero_point=zero, g_idx=g_idx, loss=float(losses.sum()),
        damp=damp_used, retries=retries, dead_channels=n_dead,
    )
