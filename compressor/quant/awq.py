"""Activation-aware Weight Quantization (AWQ), Lin et al., 2023 (arXiv:2306.00978).

Tensor-in, tensor-out pieces; the per-layer handler (:mod:`compressor.quant.awq_layer`) owns
the hooks and the layer's state. Follows the reference implementation's math (mit-han-lab/llm-awq,
AutoAWQ ``awq/quantize/quantizer.py``):

* scale search: ``s = x_mean^a / w_mean^(1-a)`` (``duo_scaling``) or ``x_mean^a``, for
  ``a`` on a grid over [0, 1); ``s /= sqrt(max(s) * min(s))``; the weights of the group are
  multiplied by ``s``, fake-quantized, divided by ``s``, and the MSE of the inspected
  module's output against the float output picks ``a``.
* clip search: per output row and group, the clipping threshold
  ``absmax * (1 - i / clip_grid)`` (``i < max_shrink * clip_grid``) that minimises the
  error of the group's partial dot products on sampled input tokens.

Everything runs in float32: half-precision activations produced NaN/zero scales in peers.

On the FP4 e2m1 grids (NVFP4, MXFP4: :mod:`compressor.quant.fp4`, :mod:`compressor.quant.mxfp4`) both searches
round each candidate as the format's writer rounds it: NVFP4's per-16 e4m3 scales under the global scale of the
weight's fused set (q/k/v, gate/up, DeepSeek's q_a/kv_a), taken from the largest ``|w * s|`` over the set's
scaled weights (:func:`candidate_weights`) or, in the clip search, from the folded set the artifact stores;
MXFP4's E8M0 power of two per 32. A clip threshold lowers a group's absmax, so its scale: the clipped weight
quantized by the format's own rule is what the artifact stores
(:func:`compressor.quant.primitives.clip_groups`). A linear whose output rows a later scaling group divides
(``up_proj`` before ``down_proj``; ``v_proj`` before ``o_proj`` without grouped-query attention) is stored as
the rounding of its final weights, that division included (NVFP4: its set's global scale taken from them), as on
the integer grid, where the division moves its groups' scales too: its candidates were rounded before it.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import QuantizationError
from . import fp4, mxfp4
from .primitives import fake_quantize, fake_quantize_grouped, resolve_group_size

#: the e2m1 grids a weight may be rounded on (``None``: the integer grid of its scheme)
NVFP4, MXFP4 = "nvfp4", "mxfp4"


@torch.no_grad()
def weight_row_sum(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum over the output rows of ``w [out, in]`` of ``|w| / max|w| in its group``; ``[in]`` float32."""
    in_f = w.shape[1]
    gs = resolve_group_size(group_size, in_f)
    wg = w.float().abs().reshape(w.shape[0], in_f // gs, gs)
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return wg.reshape(w.shape[0], in_f).sum(0)


@torch.no_grad()
def mean_of_rows(sums: Iterable[torch.Tensor], rows: int) -> torch.Tensor:
    """``sum(sums) / rows``, the ``[in]`` terms added one at a time in the order given (the order
    :func:`weight_mean` adds them: a caller holding the terms gets its bits)."""
    total = None
    for t in sums:
        total = torch.zeros_like(t) if total is None else total
        total += t
    return total / rows


@torch.no_grad()
def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of ``|w| / max|w| in its group``; ``[in]`` float32.

    ``weights``: list of ``[out_i, in]`` tensors sharing ``in`` (summed one at a time, no
    concatenated copy: an MoE group holds every expert's gate/up).
    """
    return mean_of_rows((weight_row_sum(x, group_size) for x in weights), sum(x.shape[0] for x in weights))


@torch.no_grad()
def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """AWQ per-input-channel scales for exponent ``ratio``; ``[in]`` float32, finite and > 0.

    Channels that never carry activation (``x_mean == 0``, e.g. behind a Gemma
    ``(1 + w)`` norm weight of exactly -1) are dead: their scale is 1 and they are left out
    of the ``sqrt(max * min)`` normalisation, which they would otherwise dominate (their
    clamped 1e-4 drove every other channel's scale up by ~100x, and a folded ``(1 + w)``
    norm next to -1 loses its precision in bf16).
    """
    x = x_mean.float().clamp(min=0)
    if w_mean is not None:
        s = (x.pow(ratio) / (w_mean.float().pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x.pow(ratio).clamp(min=1e-4)
    dead = x == 0
    if ratio > 0 and dead.any() and not dead.all():
        live = s[~dead]
        s = torch.where(dead, torch.ones_like(s), s / (live.max() * live.min()).sqrt())
        return s
    s = s / (s.max() * s.min()).sqrt()
    return s


def tie_kv_heads(s: torch.Tensor, kv_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """``s [heads * head_dim]`` (o_proj's input channels, query head ``h`` at rows
    ``h * head_dim ...``) with the ``groups`` query heads that read one KV head given the
    same scale per channel (their geometric mean): grouped-query attention repeats KV head
    ``k`` for query heads ``k * groups ... k * groups + groups - 1`` (transformers'
    ``repeat_kv``), so dividing v_proj's rows by ``s_v`` and multiplying o_proj's columns by
    ``s_v`` repeated is exact only when the repeated copies agree."""
    g = s.view(kv_heads, groups, head_dim).log().mean(1, keepdim=True).exp()
    return g.expand(kv_heads, groups, head_dim).reshape(-1).contiguous()


@torch.no_grad()
def search_scales(
    x_mean: torch.Tensor,
    weights: list[torch.Tensor],
    loss_fn: Callable[[list[torch.Tensor]], float],
    num_bits: int | list[int],
    group_size: int | list[int],
    symmetric: bool | list[bool],
    n_grid: int = 20,
    duo_scaling: bool = True,
    name: str = "",
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
    e2m1: tuple[list, list] | None = None,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search the AWQ scales of one scaling group.

    Args:
        x_mean: ``[in]`` mean absolute activation per input channel (all calibration tokens).
        weights: float ``[out_i, in]`` weights of the group's linears (not modified).
        loss_fn: given candidate effective weights (scaled, fake-quantized, unscaled),
            returns the output MSE of the inspected module against its float output.
        num_bits, group_size, symmetric: the weight scheme, or one per weight (mixed precision).
        name: used in error messages.
        tie: applied to every candidate ``s`` before it is tried (channels that must share
            one scale: a GQA ``v_proj -> o_proj`` group, :func:`tie_kv_heads`).
        e2m1: ``(grids, sets)`` of :func:`candidate_weights` (FP4 weights); ``None``: integer grids.

    Returns:
        ``(scales [in] float32, best ratio, losses per grid point)``.

    Raises:
        QuantizationError: every candidate gave a non-finite loss or the scales are not finite.
    """
    losses, pick = search_scale_range(x_mean, weights, loss_fn, num_bits, group_size, symmetric, range(n_grid),
                                      n_grid, duo_scaling, tie, e2m1)
    s, ratio = pick_scale([pick], name)
    return s, ratio, losses


def search_scale_range(x_mean: torch.Tensor, weights: list[torch.Tensor], loss_fn: Callable, num_bits, group_size,
                       symmetric, points: range, n_grid: int = 20, duo_scaling: bool = True,
                       tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       e2m1: tuple[list, list] | None = None) -> tuple[list[float], tuple | None]:
    """The grid points ``points`` (indices ``i`` of ``ratio = i / n_grid``) of :func:`search_scales`, the
    same arguments: ``(losses [len(points)], (loss, ratio, s [in] float32) of the first smallest loss, or None
    when none is finite)``. A grid cut into ranges searched apart (on several ranks) gives the whole grid's
    choice bit for bit through :func:`pick_scale`."""
    bits, sizes, syms = per_weight(len(weights), num_bits, group_size, symmetric)
    grids, sets = e2m1 or (None, None)
    grid = scale_grid(x_mean, weight_mean(weights, sizes[0]) if duo_scaling else None, n_grid, tie, points)
    losses = [float(loss_fn(candidate_weights(weights, s, bits, sizes, syms, grids, sets))) for _, s in grid]
    return losses, first_smallest(grid, losses)


def pick_scale(picks: list[tuple | None], name: str) -> tuple[torch.Tensor, float]:
    """``(s, ratio)`` of the first smallest loss among consecutive grid ranges' picks
    (:func:`search_scale_range`, in grid order): :func:`best_scale`'s choice over the whole grid.

    Raises:
        QuantizationError: no range has a finite loss, or the chosen scales are not finite.
    """
    best = (float("inf"), None, None)
    for pick in picks:
        if pick is not None and pick[0] < best[0]:
            best = pick
    if best[2] is None or not torch.isfinite(best[2]).all():
        raise QuantizationError(f"AWQ scale search for {name} produced no finite loss/scale (NaN or Inf in activations?)")
    return best[2], best[1]


def per_weight(n: int, num_bits, group_size, symmetric) -> tuple[list, list, list]:
    """The weight scheme of :func:`search_scales` as one ``(bits, group sizes, symmetric)`` list each, ``n`` long."""
    return tuple(v if isinstance(v, list) else [v] * n for v in (num_bits, group_size, symmetric))


def scale_grid(x_mean: torch.Tensor, w_mean: torch.Tensor | None, n_grid: int,
               tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
               points: range | None = None) -> list[tuple[float, torch.Tensor]]:
    """The candidates of :func:`search_scales`: ``(ratio, s [in] float32)`` for ``ratio = i / n_grid``,
    ``i`` in ``points`` (default: the whole grid, ``range(n_grid)``)."""
    out = []
    for i in (range(n_grid) if points is None else points):
        s = candidate_scales(x_mean, w_mean, i / n_grid)
        out.append((i / n_grid, tie(s) if tie is not None else s))
    return out


#: elements of a weight :func:`candidate_weights` fake-quantizes at once (64 MiB of float32 temporaries each)
CANDIDATE_BLOCK = 2**24


def candidate_weights(weights: list[torch.Tensor], s: torch.Tensor, bits: list, sizes: list, syms: list,
                      grids: list | None = None, sets: list | None = None) -> list:
    """Each ``[out, in]`` weight scaled by ``s [in]``, fake-quantized with its scheme, unscaled (float32).

    ``grids``: per weight ``None`` (the integer grid of its ``bits``, ``sizes``, ``syms``), :data:`NVFP4` or
    :data:`MXFP4` (the e2m1 grid as the format's writer rounds it; default: every weight integer); ``sets``:
    per weight a key, the NVFP4 weights with one key (a fused set, targeted) sharing one global scale from the
    largest ``|w * s|`` among them, as the artifact's set shares the one of its folded weights (``None``: the
    weight's own).

    Rows are done in blocks of about :data:`CANDIDATE_BLOCK` elements written into the result: a
    row's groups depend on that row alone, so the values are those of the whole weight at once,
    and the temporaries stay near 64 MiB per block instead of several copies of the weight (a
    Kimi K2 dense gate_proj is 132 M weights, 528 MB in float32).
    """
    grids = grids or [None] * len(weights)
    absmax = _set_absmax(weights, s, grids, sets or [None] * len(weights))
    out = []
    for j, (w, b, g, y, grid) in enumerate(zip(weights, bits, sizes, syms, grids)):
        c = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        step = max(1, CANDIDATE_BLOCK // max(1, w.shape[-1]))
        gs = fp4.global_scale(absmax[j]).to(w.device) if grid == NVFP4 else None
        for r in range(0, w.shape[0], step):
            ws = w[r:r + step].float() * s
            q = fake_quantize(ws, b, g, y) if grid is None else e2m1_fake_quantize(ws, grid, gs)
            torch.div(q, s, out=c[r:r + step])
        out.append(c)
    return out


def _set_absmax(weights: list, s: torch.Tensor, grids: list, sets: list) -> list:
    """Per weight, the absmax its NVFP4 global scale is taken from: the largest ``|w * s|`` over the weights of its
    set key (its own without one); ``None`` for the others. Row blocks as :func:`candidate_weights`'s."""
    own = []
    for w, grid in zip(weights, grids):
        m = None
        if grid == NVFP4:
            step = max(1, CANDIDATE_BLOCK // max(1, w.shape[-1]))
            m = max(float((w[r:r + step].float() * s).abs().max()) for r in range(0, w.shape[0], step))
        own.append(m)
    shared: dict = {}
    for m, key in zip(own, sets):
        if m is not None and key is not None:
            shared[key] = max(shared.get(key, m), m)
    return [shared[key] if m is not None and key is not None else m for m, key in zip(own, sets)]


@torch.no_grad()
def e2m1_fake_quantize(w: torch.Tensor, grid: str, g: torch.Tensor | None = None) -> torch.Tensor:
    """``w [out, in]`` (float32) rounded onto the FP4 grid ``grid`` (:data:`NVFP4` under the global scale ``g``,
    float32 ``[1]``; :data:`MXFP4`): float32 ``[out, in]``, the values the format's writer stores for ``w``
    (:func:`compressor.quant.fp4.quantize_weight` with the absmax ``g`` is taken from, then its dequantization).

    Raises:
        InputError: ``in`` is not a multiple of the format's group (16, 32).
    """
    (fp4 if grid == NVFP4 else mxfp4).check_shape(w)
    gs = fp4.GROUP if grid == NVFP4 else mxfp4.GROUP
    return e2m1_fake_grouped(w.reshape(w.shape[0], -1, gs), grid, g).reshape(w.shape)


@torch.no_grad()
def e2m1_fake_grouped(wg: torch.Tensor, grid: str, g: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`e2m1_fake_quantize` of weights already grouped, ``[..., G, gs]`` (float32, same shape)."""
    amax = wg.abs().amax(dim=-1)
    step = fp4.steps_of(amax, g)[0] if grid == NVFP4 else mxfp4.steps_of(amax)[0]
    return fp4.round_to_steps(wg, step)


def best_scale(grid: list[tuple[float, torch.Tensor]], losses: list[float], name: str) -> tuple[torch.Tensor, float]:
    """``(s, ratio)`` of the first candidate with the smallest loss.

    Raises:
        QuantizationError: every loss is non-finite, or the chosen scales are not finite.
    """
    return pick_scale([first_smallest(grid, losses)], name)


def first_smallest(grid: list[tuple[float, torch.Tensor]], losses: list[float]) -> tuple | None:
    """``(loss, ratio, s)`` of the first smallest of ``losses`` (NaN never chosen); None when none is finite."""
    pick = None
    for (ratio, s), loss in zip(grid, losses):
        if loss < (pick[0] if pick is not None else float("inf")):
            pick = (loss, ratio, s)
    return pick


@torch.no_grad()
def group_grams(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group second moments of the inputs, ``[G, gs, gs]`` float32: ``G_g = x_gᵀ x_g / T``.

    ``x``: ``[T, in]`` input tokens of one linear; ``group_size`` as in the weight scheme
    (``-1``: one group). For a weight error ``Δ [out, in]`` the mean squared partial output of
    group ``g`` over the tokens, ``mean_t (Δ_g · x_{t,g})²``, is ``Δ_g G_g Δ_gᵀ``.
    """
    t, in_f = x.shape
    gs = resolve_group_size(group_size, in_f)
    xg = x.float().reshape(t, in_f // gs, gs).permute(1, 2, 0)  # [G, gs, T]
    return torch.bmm(xg, xg.transpose(1, 2)).div_(max(t, 1))


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    clip_grid: int = 20,
    max_shrink: float = 0.5,
    row_batch: int = 256,
    grid: str | None = None,
    absmax: float | None = None,
) -> torch.Tensor:
    """AWQ weight-clipping search; returns ``clip_max [out, G]`` float32.

    Args:
        w: ``[out, in]`` float weight (already AWQ-scaled).
        x: ``[n_tokens, in]`` sampled inputs of this linear (scaled consistently with ``w``).
        grid: :data:`NVFP4` or :data:`MXFP4`: each clipped candidate rounded onto that e2m1 grid (``group_size``
            16 or 32; NVFP4's global scale from ``absmax``, the one the artifact's fused set takes: the clip
            lowers a group's e4m3 scale, not the global scale); ``None``: the integer grid.

    Each candidate threshold is scored, per output row and group, by the mean squared error
    of the group's partial outputs over the tokens, ``mean_t ((q_g - w_g) · x_{t,g})²``, the
    objective of the reference implementation. It is computed from the group's input second
    moments (:func:`group_grams`) as ``Δ_g G_g Δ_gᵀ``: ``out * in * group_size`` multiply-adds
    a candidate instead of ``out * in * n_tokens``, and the error itself rather than the
    difference of two full partial outputs (no cancellation when the inputs are rounded).
    """
    out_f, in_f = w.shape
    gs = resolve_group_size(group_size, in_f)
    n_groups = in_f // gs
    gram = group_grams(x, gs)  # [G, gs, gs]
    result = torch.empty(out_f, n_groups, device=w.device)
    steps = max(1, int(max_shrink * clip_grid))
    g = fp4.global_scale(absmax if absmax is not None else w.float().abs().max()).to(w.device) \
        if grid == NVFP4 else None
    for r0 in range(0, out_f, row_batch):
        wb = w[r0 : r0 + row_batch].float().reshape(-1, n_groups, gs)  # [R, G, gs]
        org_max = wb.abs().amax(dim=-1, keepdim=True)  # [R, G, 1]
        best_err = torch.full(org_max.shape[:2], float("inf"), device=w.device)
        best_max = org_max.squeeze(-1).clone()
        for i in range(steps):
            max_val = org_max * (1 - i / clip_grid)
            cur = torch.maximum(torch.minimum(wb, max_val), -max_val)
            fq = fake_quantize_grouped(cur, num_bits, symmetric) if grid is None else e2m1_fake_grouped(cur, grid, g)
            delta = fq.sub_(wb).permute(1, 0, 2)  # [G, R, gs]
            err = torch.bmm(delta, gram).mul_(delta).sum(-1).t()  # [R, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val.squeeze(-1), best_max)
        result[r0 : r0 + row_batch] = best_max
    return result
