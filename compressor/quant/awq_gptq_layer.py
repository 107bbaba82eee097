"""AWQ's scaling, then GPTQ's error feedback (``algorithm: awq-gptq``), as a per-layer handler.

The two methods fix different errors: AWQ (Lin et al., 2023, arXiv:2306.00978) moves
activation-salient input channels' magnitude into the weights before rounding, exactly
(the scales are folded into the preceding norm/linear, the float function is unchanged);
GPTQ (Frantar et al., 2022, arXiv:2210.17323) then rounds each weight column while
propagating its error to the columns not yet rounded, through the inverse Hessian of the
(folded) inputs. Running GPTQ on the AWQ-scaled layer is the combination GPTQModel and
llm-compressor users build by chaining the two modifiers; here it is one step per layer:

1. :func:`~compressor.quant.awq_layer.awq_scale_layer` -- observe, search and fold each
   scaling group's scales (``recipe.awq``: grid, duo scaling; AWQ's clip search is not
   run: GPTQ's rounding replaces it);
2. :func:`~compressor.quant.gptq_layer.gptq_layer` on the folded layer (``recipe.gptq``:
   damping, act_order, static groups, true-sequential), its weight errors measured
   against the weights before folding.

The artifact is a plain W4A16 (or other width) checkpoint in any output format: the folded
scales live in the stored weights and norms, as with AWQ. On the FP4 e2m1 grids (NVFP4, MXFP4) the
scale search rounds each candidate as the format's writer does (:func:`compressor.quant.awq.candidate_weights`)
and GPTQ rounds the folded weights onto the steps fixed from them (NVFP4: each fused set's global scale from
its folded weights).
"""

from __future__ import annotations

import time

from .algorithms import register_algorithm
from .awq_layer import AWQ, awq_scale_layer, skipped_warnings
from .gptq_layer import GPTQ, gptq_layer
from .layer import LayerContext, LayerOutcome


def awq_gptq_layer(i: int, layer, hidden: list, kw: dict, ctx: LayerContext) -> LayerOutcome:
    """AWQ scale search and folding, then GPTQ, for decoder layer ``i`` (module docstring)."""
    sl = awq_scale_layer(i, layer, hidden, kw, ctx)
    sl.x_loss = None  # AWQ's loss inputs: only its clip search would read them
    tp = time.perf_counter()
    # the float layer's output before any fold, from AWQ's observe pass (GPTQ's passes need not compute it again)
    out = gptq_layer(i, layer, hidden, kw, ctx, folds=(sl.col_scale, sl.row_scale, sl.originals), float_out=sl.float_out)
    out.phases = {**sl.phases, **out.phases, "gptq_total": time.perf_counter() - tp}
    out.figures = {**out.figures, **sl.figures()}
    return out


@register_algorithm
class AWQGPTQ(GPTQ):
    """AWQ's folded input scales, then GPTQ (calibration, summary fields and warnings as GPTQ's;
    both recipes' sections apply)."""

    name = "awq-gptq"
    reads = ("awq", "gptq")
    act_order = True
    folds_input_scales = AWQ.folds_input_scales
    fp4_grid = True  # AWQ's scale search and GPTQ's columns both round onto the format's grid
    fp8_fallback = False  # AWQ's scale search spans a layer's linears, FP8 ones included: refused, as AWQ's

    def quantize_layer(self, i, layer, hidden, kw, ctx):
        return awq_gptq_layer(i, layer, hidden, kw, ctx)

    def run_warnings(self, layers):
        return super().run_warnings(layers) + skipped_warnings(layers)
