"""Block-wise refinement of a decoder layer's GPTQ result (the recipe's ``refine`` section).

GPTQ (:mod:`compressor.quant.gptq`) rounds one linear at a time against that linear's own
outputs. AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient
Descent", arXiv:2309.05516) instead tunes, for every weight, a rounding offset
``v`` in ``[-0.5, 0.5]`` and, for every group, factors on the ends of its range, by
sign-gradient descent on the whole decoder layer's output. This step runs AutoRound's loop
**from GPTQ's result**, after the GPTQ solve of a layer:

* each linear's weight is quantized as ``s · (clamp(round(B / s + v) + z) - z)`` where ``B`` is
  the weight as GPTQ rounded it (:attr:`compressor.quant.gptq.GPTQResult.target`: the float
  weight plus the error GPTQ fed back from the columns before), so ``v = 0`` with GPTQ's
  scales and zero points gives GPTQ's integers exactly, and ``v`` reaches the integer on either side;
* a group's range starts as GPTQ's (after its range search): its ends ``(qmin - z₀)·s₀`` and
  ``(qmax - z₀)·s₀`` times the factors ``a_lo``, ``a_hi`` (start 1; within
  :data:`RANGE_BOUNDS`) give the scale (rounded to the storage dtype, as stored) and the zero
  point (rounded); symmetric schemes have one factor on the scale;
* rounding passes the gradient straight through; the loss is the mean squared error of the
  layer's output, on ``refine.batch`` calibration sequences drawn without replacement
  (reshuffled when all are used), against the float layer's output on the float model's
  activations (GPTQ's float stream, ``gptq.gptaq_alpha > 0``) or, without it, on the same
  inputs; every step moves each parameter by ``lr_t · sign(grad)``, ``lr_t`` decaying linearly
  from ``refine.lr`` (``1 / iters`` by default) to 0 (AutoRound's defaults: 200 steps of 8);
* the best iterate is kept (AutoRound's rule: the lowest batch loss, taken before each step, so
  step 0 is GPTQ's start), then scored on every calibration sequence: if it is worse there than
  GPTQ's start the layer keeps GPTQ's result, so the recorded loss never grows.

The layer's figures get ``refine``: the losses (mean squared error over all calibration tokens)
before and after, the iterate kept, and which linears were refined. Memory: per refined linear,
GPTQ's rounded weight and the float weight (kept by :func:`~compressor.quant.gptq_layer.solve_pass`),
``v`` and its gradient, the best integers: a few copies of one decoder layer, plus one batch's
activations for the backward pass. A streamed MoE layer (:mod:`compressor.moe_stream`) refines
its non-expert linears against the layer's output without its routed part (the experts are not
in memory then); its routed experts keep GPTQ's result, as do experts that fell back to RTN.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..arch import get_module
from ..distributed import world
from ..errors import InputError
from .layer import LayerContext, LayerOutcome, layer_forward, stored_dequantize
from .primitives import qrange

#: bounds of a group's range factors (AutoRound bounds its own to [0, 1] around min-max; these
#: start at GPTQ's searched range, which may have shrunk already, so they may also widen it)
RANGE_BOUNDS = (0.5, 1.5)
#: bound of the rounding offset ``v`` (one integer either side of GPTQ's rounding at most)
ROUND_BOUND = 0.5
#: the range factors' step over the offsets' when ``refine.range_lr`` is null: GPTQ's ranges come out of a
#: search already, and AutoRound's equal steps moved them too far (module docstring)
RANGE_LR_FRACTION = 0.1


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` whose gradient is the identity's (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


@dataclass
class _Linear:
    """One refined linear: GPTQ's start (``base`` ``[out, in]``, ``s0``/``z0`` float32 ``[out, G]``,
    ``gi`` the group of each input column ``[in]``) and the tuned tensors (``v`` ``[out, in]``;
    ``lo``/``hi`` the range factors ``[out, G]``)."""

    name: str
    rel: str
    base: torch.Tensor
    original: torch.Tensor
    s0: torch.Tensor
    z0: torch.Tensor
    gi: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    bits: int
    symmetric: bool
    v: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    def ranges(self) -> list[torch.Tensor]:
        return [self.hi] if self.symmetric else [self.lo, self.hi]

    def grid(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dequantized weight [out, in], integers [out, in], scale [out, G], zero point [out, G])``,
        differentiable in the tuned tensors; the scale rounded to the storage ``dtype``."""
        qmin, qmax = qrange(self.bits)
        if self.symmetric:
            s = self.s0 * self.hi
        else:  # the range's ends (qmin - z0)·s0 and (qmax - z0)·s0, each times its factor
            s = self.s0 * ((self.hi * (qmax - self.z0) - self.lo * (qmin - self.z0)) / (qmax - qmin))
        s = s.to(dtype).float().clamp(min=torch.finfo(dtype).tiny)
        if self.symmetric:
            z = torch.zeros_like(s)
        else:
            z = _round_ste(qmin - self.lo * (qmin - self.z0) * self.s0 / s).clamp(qmin, qmax)
        sc, zc = s[:, self.gi], z[:, self.gi]
        q = (_round_ste(self.base / sc + self.v) + zc).clamp(qmin, qmax)
        return sc * (q - zc), q, s, z


def _linears(i: int, layer, ctx: LayerContext) -> list[_Linear]:
    """A :class:`_Linear` per linear of layer ``i`` that GPTQ solved (``ctx.bases``), in their order."""
    prefix = f"{ctx.arch.layers}.{i}."
    out = []
    for name, (base, original, _err) in ctx.bases.items():
        rec = ctx.modules[name]
        lin = get_module(layer, name[len(prefix):])
        dev = lin.weight.device
        in_f = base.shape[1]
        gs = in_f if rec.group_size in (-1, 0, None) else rec.group_size
        gi = rec.g_idx.long() if rec.g_idx is not None else torch.arange(in_f) // gs
        s0 = rec.scale.float().to(dev)
        z0 = torch.zeros_like(s0) if rec.symmetric else rec.zero_point.float().to(dev)
        g_idx = None if rec.g_idx is None else rec.g_idx.to(dev)
        out.append(_Linear(name, name[len(prefix):], base, original, s0, z0, gi.to(dev), g_idx,
                           rec.group_size, rec.num_bits, rec.symmetric, torch.zeros_like(base, requires_grad=True),
                           torch.ones_like(s0, requires_grad=True), torch.ones_like(s0, requires_grad=True)))
    return out


def _forward(layer, weights: dict, h: torch.Tensor, kw: dict) -> torch.Tensor:
    out = torch.func.functional_call(layer, weights, (h,), kw)
    return out[0] if isinstance(out, tuple) else out


def _loss(layer, hidden: list, kw: dict, targets: list) -> tuple[float, list[torch.Tensor]]:
    """Mean squared error of the layer's outputs (its current weights) against ``targets`` over every
    calibration token, and each sequence's sum of squared errors (float64 ``[b]`` per batch)."""
    sums, n = [], 0
    for h, y in zip(hidden, targets):
        d = layer_forward(layer, h, kw) - y.to(h.device)
        sums.append(d.double().square().flatten(1).sum(1).cpu())
        n += d.numel()
    return float(sum(float(x.sum()) for x in sums)) / max(n, 1), sums


def _write(layer, parts: list[_Linear], chosen: list[tuple], dtype) -> None:
    """Write each linear's dequantized weight for ``chosen`` ``(q, scale, zero point)`` into the layer."""
    for p, (q, s, z) in zip(parts, chosen):
        lin = get_module(layer, p.rel)
        dev = p.base.device
        q, s, z = q.to(dev), s.to(dev), None if p.symmetric else z.to(dev)
        _, deq = stored_dequantize(q, s, z, p.group_size, dtype, p.name, p.g_idx)
        lin.weight.data.copy_(deq.to(lin.weight.device, lin.weight.dtype))


def _descend(i: int, layer, hidden: list, kw: dict, targets: list, start: list, parts: list[_Linear],
             ctx: LayerContext):
    """The sign-gradient loop (module docstring; ``start``: each sequence's squared error at GPTQ's
    start, from :func:`_loss`); returns ``(best (q, s, z) per linear, best batch ratio, its step)``."""
    opts, dtype = ctx.recipe.refine, ctx.quantizer.dtype
    lr0 = opts.lr if opts.lr is not None else 1.0 / opts.iters
    range_lr0 = opts.range_lr if opts.range_lr is not None else lr0 * RANGE_LR_FRACTION
    rows = [(j, r) for j, h in enumerate(hidden) for r in range(h.shape[0])]
    batch = min(opts.batch, len(rows))
    gen = torch.Generator().manual_seed(i)
    order: list[int] = []
    tuned = [(p.v, 1.0) for p in parts] + [(t, range_lr0 / lr0) for p in parts for t in p.ranges()]
    best, best_ratio, best_step = None, float("inf"), 0
    for step in range(opts.iters):
        if len(order) < batch:
            order += torch.randperm(len(rows), generator=gen).tolist()
        pick, order = [rows[k] for k in order[:batch]], order[batch:]
        h = torch.stack([hidden[j][r] for j, r in pick])
        y = torch.stack([targets[j][r] for j, r in pick]).to(h.device)
        grids = [p.grid(dtype) for p in parts]
        out = _forward(layer, {p.rel + ".weight": g[0].to(get_module(layer, p.rel).weight.dtype)
                               for p, g in zip(parts, grids)}, h, kw)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        # the batch's squared error over GPTQ's on the same sequences: batches compare like with like
        ratio = float(loss.detach()) * y.numel() / max(float(sum(start[j][r] for j, r in pick)), 1e-30)
        if ratio < best_ratio:  # the parameters before this step: what gave this loss
            best_ratio, best_step = ratio, step
            best = [(q.detach().to(torch.int8), s.detach().clone(), z.detach().to(torch.int8)) for _, q, s, z in grids]
        del grids, out, loss
        lr = lr0 * (1.0 - step / opts.iters)
        with torch.no_grad():
            for t, f in tuned:
                if t.grad is not None:  # None: an expert no token of the batch was routed to
                    t.sub_(lr * f * torch.sign(t.grad))
                    t.grad = None
            for p in parts:
                p.v.clamp_(-ROUND_BOUND, ROUND_BOUND)
                p.lo.clamp_(*RANGE_BOUNDS)
                p.hi.clamp_(*RANGE_BOUNDS)
    return best, best_ratio, best_step


def refine_linears(i: int, layer, hidden: list, kw: dict, targets: list, ctx: LayerContext) -> tuple[dict, dict]:
    """Refine the linears of decoder layer ``i`` that GPTQ solved (``ctx.bases``) on the layer's
    output (module docstring), in place: the kept result is stored in ``ctx.modules`` and written
    into the layer.

    Args:
        hidden: the layer's inputs, float32 ``[b, T, H]`` per batch; ``targets``: the float
            layer's outputs to match, the same shapes.

    Returns:
        ``(figures, errors)``: the ``refine`` figures (losses as mean squared errors over every
        calibration token, ``loss_end <= loss_start``) and the new relative weight error of each
        refined linear (full name -> error).
    """
    parts = _linears(i, layer, ctx)
    dtype = ctx.quantizer.dtype
    loss_start, start = _loss(layer, hidden, kw, targets)
    fig = {"iters": ctx.recipe.refine.iters, "modules": len(parts), "loss_start": loss_start}
    if not parts:
        return {**fig, "loss_end": loss_start, "kept": "gptq", "best_iter": 0}, {}
    grads = [(t, t.requires_grad) for t in layer.parameters()]
    try:
        for t, _ in grads:
            t.requires_grad_(False)
        with torch.enable_grad():
            best, _ratio, best_step = _descend(i, layer, hidden, kw, targets, start, parts, ctx)
    finally:
        for t, flag in grads:
            t.requires_grad_(flag)
    loss_end, errors = loss_start, {}
    if best_step > 0:
        _write(layer, parts, best, dtype)
        loss_end = _loss(layer, hidden, kw, targets)[0]
        if loss_end <= loss_start:
            for p, (q, s, z) in zip(parts, best):
                ctx.modules[p.name], errors[p.name] = ctx.quantizer.finish(
                    p.name, get_module(layer, p.rel), q, s, z, p.g_idx, original=p.original)
        else:  # worse on the whole calibration set than GPTQ's start: GPTQ's result stays
            recs = [ctx.modules[p.name] for p in parts]
            _write(layer, parts, [(r.q, r.scale, r.zero_point) for r in recs], dtype)
            loss_end = loss_start
    kept = "refined" if errors else "gptq"
    return {**fig, "loss_end": loss_end, "kept": kept, "best_iter": best_step if errors else 0}, errors


def refined_layer(i: int, layer, hidden: list, kw: dict, ctx: LayerContext, solve) -> LayerOutcome:
    """GPTQ's step for decoder layer ``i`` (``solve``: :func:`~compressor.quant.gptq_layer.gptq_layer`),
    then :func:`refine_linears` on its result; the outcome's errors and figures updated
    (``refine``), its replay dropped (the recompute runs the refined weights).

    Raises:
        InputError: under several ``torchrun`` ranks (the refinement runs in one process).
    """
    if world()[1] > 1:
        raise InputError("the refine section runs in one process: quantize without torchrun, or set refine=null")
    t0 = time.perf_counter()
    own_targets = None
    if ctx.recipe.gptq.gptaq_alpha == 0.0:  # no float stream: the float layer's outputs on these inputs
        with torch.no_grad():
            own_targets = [layer_forward(layer, h, kw) for h in hidden]
        if ctx.spill is not None:
            own_targets = ctx.spill(own_targets, "refine")
    t_t = time.perf_counter() - t0
    ctx.bases = {}
    try:
        outcome = solve(i, layer, hidden, kw, ctx)
        t1 = time.perf_counter()
        targets = own_targets if own_targets is not None else ctx.float_hidden
        fig, errors = refine_linears(i, layer, hidden, kw, targets, ctx)
        gptq_errs = [ctx.bases[name][2] for name in errors]
    finally:
        ctx.bases = None
    errs = list(outcome.errs)
    for e in gptq_errs:  # the refined linears' errors replace GPTQ's (the figure is their mean)
        errs.remove(e)
    outcome.errs = errs + list(errors.values())
    experts = ctx.experts(layer)
    if experts is not None and any(t.is_meta for t in experts.parameters()):  # streamed (compressor.moe_stream)
        fig["note"] = "non-expert linears only: the routed experts, read in groups, keep GPTQ's result"
    outcome.figures = {**outcome.figures, "refine": {k: float(f"{v:.6g}") if isinstance(v, float) else v
                                                     for k, v in fig.items()}}
    outcome.replay = None  # its kept outputs are GPTQ's weights'
    if outcome.phases is not None:
        outcome.phases = {**outcome.phases, "refine": time.perf_counter() - t1 + t_t}
    return outcome
