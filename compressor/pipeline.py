"""The sequential, layer-by-layer quantization driver.

Data flow (DESIGN.md): capture the inputs of decoder layer 0 once; for each layer,
observe its linears' inputs, run AWQ (or RTN), quantize, then recompute the layer's
outputs *with the quantized weights* and feed them to the next layer. Only one layer
is on the compute device at a time; the model is modified in place (its linears end
up holding the dequantized weights, its norms the AWQ-folded scales), so memory holds
one float copy of the model plus the packed integers -- never two float copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .arch import ArchSpec, get_arch, get_module
from .errors import InputError, QuantizationError
from .formats.compressed_tensors import module_tensors
from .quant.awq import search_clip, search_scales
from .quant.primitives import dequantize
from .quant.rtn import rtn_quantize
from .recipe import Recipe, resolve_group_size


@dataclass
class QuantizeResult:
    """What the pipeline produced.

    ``modules``: full module name -> stored compressed-tensors tensors (``weight_packed``,
    ``weight_scale``, ``weight_zero_point``, ``weight_shape``). ``layers``: per-layer
    figures (mean relative weight error, relative output error, AWQ ratios, seconds).
    """

    group_size: int
    modules: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def target_modules(model, recipe: Recipe, arch: ArchSpec) -> dict[str, torch.nn.Linear]:
    """Full name -> Linear of every decoder-layer linear the recipe quantizes (in order)."""
    layers = get_module(model, arch.layers)
    out = {}
    for i, layer in enumerate(layers):
        for rel in arch.linears:
            name = f"{arch.layers}.{i}.{rel}"
            mod = get_module(layer, rel)
            if not isinstance(mod, torch.nn.Linear):
                raise InputError(f"{name} is {type(mod).__name__}, expected a Linear")
            if not recipe.is_ignored(name):
                out[name] = mod
    return out


def check_finite(model) -> None:
    """Raise :class:`InputError` naming the first parameter holding NaN or Inf."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")


def _layer_forward(layer, h, pe, pos):
    out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return out[0] if isinstance(out, tuple) else out


def _inspect_forward(module, x, pe, is_attention):
    out = module(hidden_states=x, position_embeddings=pe, attention_mask=None) if is_attention else module(x)
    return out[0] if isinstance(out, tuple) else out


class _Quantizer:
    def __init__(self, recipe: Recipe, group_size: int, dtype: torch.dtype):
        self.recipe, self.gs, self.dtype = recipe, group_size, dtype
        self.bits, self.sym = recipe.weights.num_bits, recipe.weights.symmetric

    def quantize_linear(self, name, lin, clip_max=None, col_scale=None, original=None):
        """Quantize one Linear in place; returns (stored tensors, relative error vs original)."""
        w = lin.weight.detach()
        q, scale, zp = rtn_quantize(w, self.bits, self.gs, self.sym, clip_max)
        scale = scale.to(self.dtype)  # what the artifact stores and loaders dequantize with
        deq = dequantize(q, scale, None if self.sym else zp, self.gs, dtype=torch.float32)
        if not (torch.isfinite(scale.float()).all() and torch.isfinite(deq).all()):
            raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
        ref = (original if original is not None else w).float()
        eff = deq / col_scale if col_scale is not None else deq
        rel = float((eff - ref.to(eff.device)).norm() / ref.norm().clamp(min=1e-12))
        lin.weight.data.copy_(deq.to(lin.weight.dtype))
        tensors = module_tensors(q.cpu(), scale.cpu(), None if self.sym else zp.cpu(), self.bits, self.dtype)
        return tensors, rel


@torch.no_grad()
def quantize_model(
    model,
    recipe: Recipe,
    calib_ids: torch.Tensor | None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
    batch_size: int = 8,
    on_layer: Callable[[int, int, dict], None] | None = None,
) -> QuantizeResult:
    """Quantize ``model`` in place according to ``recipe``.

    Args:
        model: a float decoder-only causal LM whose ``config.model_type`` is in the
            architecture table.
        recipe: the effective recipe.
        calib_ids: int64 ``[n_samples, seqlen]`` calibration tokens (required for AWQ;
            ignored by RTN).
        device: ``cpu`` or ``cuda``: where each layer is processed.
        dtype: storage dtype of scales in the artifact (the in-memory model stays float32).
        on_layer: progress callback ``(layer_index, n_layers, layer_figures)``.

    Raises:
        InputError: unsupported architecture, group size that does not fit, non-finite
            source weights, missing calibration for AWQ.
        QuantizationError: a non-finite scale or weight was produced (names the module).
    """
    t0 = time.perf_counter()
    arch = get_arch(model.config.model_type)
    targets = target_modules(model, recipe, arch)
    if not targets:
        raise InputError("the recipe's ignore list excludes every linear module; nothing to quantize")
    gs = resolve_group_size(recipe, {n: m.in_features for n, m in targets.items()})
    check_finite(model)
    if recipe.algorithm == "awq" and calib_ids is None:
        raise InputError("AWQ needs calibration data (--calib)")
    result = QuantizeResult(group_size=gs)
    quantizer = _Quantizer(recipe, gs, dtype)
    layers = get_module(model, arch.layers)
    n_layers = len(layers)

    if recipe.algorithm == "rtn":
        for i, layer in enumerate(layers):
            t1 = time.perf_counter()
            errs = []
            for rel in arch.linears:
                name = f"{arch.layers}.{i}.{rel}"
                if name in targets:
                    result.modules[name], e = quantizer.quantize_linear(name, targets[name])
                    errs.append(e)
            fig = _figures(i, recipe, gs, errs, None, {}, time.perf_counter() - t1)
            result.layers.append(fig)
            if on_layer:
                on_layer(i, n_layers, fig)
        result.seconds = time.perf_counter() - t0
        return result

    # ---- AWQ: sequential pass over calibration activations ----
    embed = get_module(model, arch.embed_tokens)
    rotary = get_module(model, arch.rotary_emb).to(device)
    seqlen = calib_ids.shape[1]
    pos = torch.arange(seqlen, device=device).unsqueeze(0)
    hidden = [embed(b).float().to(device) for b in calib_ids.split(batch_size)]
    pe = rotary(hidden[0][:1], pos)
    loss_n = min(recipe.awq.loss_samples, calib_ids.shape[0])
    for i, layer in enumerate(layers):
        t1 = time.perf_counter()
        layer.to(device)
        hidden, fig = _awq_layer(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result)
        layer.to("cpu")
        fig["seconds"] = round(time.perf_counter() - t1, 3)
        result.layers.append(fig)
        if on_layer:
            on_layer(i, n_layers, fig)
    rotary.to("cpu")
    result.seconds = time.perf_counter() - t0
    return result


def _figures(i, recipe, gs, errs, out_err, ratios, seconds):
    return {
        "layer": i,
        "num_bits": recipe.weights.num_bits,
        "group_size": gs,
        "modules": len(errs),
        "mean_rel_error": round(sum(errs) / len(errs), 6) if errs else None,
        "output_rel_error": None if out_err is None else round(out_err, 6),
        "awq_ratios": ratios,
        "seconds": round(seconds, 3),
    }


def _awq_layer(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result):
    opts = recipe.awq
    prefix = f"{arch.layers}.{i}."
    linears = {rel: get_module(layer, rel) for rel in arch.linears}
    in_dim = {rel: m.in_features for rel, m in linears.items()}

    # 1. observe: mean |x| per input channel over all tokens; full inputs of the first loss_n sequences
    abs_sum = {rel: torch.zeros(in_dim[rel], device=pe[0].device) for rel in linears}
    n_tok = [0]
    stored: dict[str, list[torch.Tensor]] = {rel: [] for rel in linears}
    keep = [True]

    def make_hook(rel):
        def hook(_mod, args):
            x = args[0]
            abs_sum[rel] += x.detach().abs().float().reshape(-1, x.shape[-1]).sum(0)
            if keep[0]:
                stored[rel].append(x.detach().float())
        return hook

    phases = {}
    tp = time.perf_counter()
    handles = [m.register_forward_pre_hook(make_hook(rel)) for rel, m in linears.items()]
    float_out = []
    seen = 0
    try:
        for h in hidden:
            keep[0] = seen < loss_n
            y = _layer_forward(layer, h, pe, pos)
            if seen < loss_n:
                float_out.append(y[: loss_n - seen])
            seen += h.shape[0]
            n_tok[0] += h.shape[0] * h.shape[1]
    finally:
        for hd in handles:
            hd.remove()
    x_loss = {rel: torch.cat(v)[:loss_n] for rel, v in stored.items()}
    x_mean = {rel: s / n_tok[0] for rel, s in abs_sum.items()}
    originals = {rel: m.weight.detach().clone() for rel, m in linears.items()}
    col_scale: dict[str, torch.Tensor] = {}
    ratios = {}
    phases["observe"], tp = time.perf_counter() - tp, time.perf_counter()

    # 2. AWQ scale search, one scaling group at a time
    for group in arch.awq_groups:
        prev = get_module(layer, group.prev_op)
        lins = [linears[r] for r in group.linears]
        quantized = [prefix + r in targets for r in group.linears]
        if not any(quantized):
            continue
        if group.requires_square:
            prev_out = prev.weight.shape[0]
            if any(m.in_features != prev_out for m in lins) or lins[0].weight.shape != prev.weight.shape:
                continue
        inspect = get_module(layer, group.inspect)
        x = x_loss[group.linears[0]]
        ref_out = _inspect_forward(inspect, x, pe, group.inspect_is_attention)
        weights = [m.weight.detach().clone() for m in lins]

        def loss_fn(cands, lins=lins, weights=weights, quantized=quantized, inspect=inspect, x=x, ref=ref_out, g=group):
            for m, c, w, q in zip(lins, cands, weights, quantized):
                m.weight.data.copy_(c if q else w)
            try:
                out = _inspect_forward(inspect, x, pe, g.inspect_is_attention)
                return (out - ref).float().pow(2).mean()
            finally:
                for m, w in zip(lins, weights):
                    m.weight.data.copy_(w)

        name = f"{prefix}{group.prev_op} -> {', '.join(group.linears)}"
        s, ratio, _ = search_scales(
            x_mean[group.linears[0]], weights, loss_fn, quantizer.bits, quantizer.gs, quantizer.sym,
            n_grid=opts.n_grid, duo_scaling=opts.duo_scaling, name=name,
        )
        ratios[group.prev_op] = ratio
        # fold: prev_op output /= s, consumers' input channels *= s (float function unchanged)
        prev.weight.data.div_(s.view(-1, *([1] * (prev.weight.ndim - 1))))
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s)
        for r, m in zip(group.linears, lins):
            m.weight.data.mul_(s)
            col_scale[r] = s
        scaled_x = x_loss[group.linears[0]] / s
        for r in group.linears:
            x_loss[r] = scaled_x

    # 3. clip search and quantization
    phases["scale_search"], tp = time.perf_counter() - tp, time.perf_counter()
    errs = []
    for rel, lin in linears.items():
        name = prefix + rel
        if name not in targets:
            continue
        clip_max = None
        if opts.clip and rel not in arch.clip_skip:
            xs = x_loss[rel].reshape(-1, in_dim[rel])
            idx = torch.linspace(0, xs.shape[0] - 1, min(opts.clip_tokens, xs.shape[0])).long()
            clip_max = search_clip(lin.weight.detach(), xs[idx], quantizer.bits, quantizer.gs, quantizer.sym,
                                   opts.clip_grid, opts.clip_max_shrink)
        result.modules[name], e = quantizer.quantize_linear(
            name, lin, clip_max, col_scale.get(rel), originals[rel]
        )
        errs.append(e)

    # 4. recompute this layer's outputs with the quantized weights -> next layer's inputs
    phases["clip_and_quantize"], tp = time.perf_counter() - tp, time.perf_counter()
    new_hidden = [_layer_forward(layer, h, pe, pos) for h in hidden]
    for j, h in enumerate(new_hidden):
        if not torch.isfinite(h).all():
            raise QuantizationError(f"decoder layer {i} produced NaN/Inf after quantization (batch {j}); nothing was written")
    q_out = torch.cat(new_hidden)[:loss_n]
    f_out = torch.cat(float_out)
    out_err = float((q_out - f_out).norm() / f_out.norm().clamp(min=1e-12))
    phases["recompute"] = time.perf_counter() - tp
    fig = _figures(i, recipe, quantizer.gs, errs, out_err, ratios, 0.0)
    fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig
