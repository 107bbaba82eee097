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
from .quant.awq import search_clip, search_scales
from .quant.gptq import HessianAccumulator, gptq_quantize
from .quant.kv import cache_kwarg, kv_observer, observed_absmax, static_scales
from .quant.primitives import dequantize
from .quant.rtn import rtn_quantize
from .recipe import Recipe, resolve_group_size


@dataclass
class QuantizedLinear:
    """One quantized Linear in the internal (compressed-tensors, signed) convention.

    ``q`` int8 ``[out, in]``; ``scale`` ``[out, G]`` in the storage dtype; ``zero_point``
    int8 ``[out, G]`` or ``None`` (symmetric); ``g_idx`` int32 ``[in]`` or ``None`` (groups
    are contiguous, ``c // group_size``). Format writers (``compressor.formats``) pack it.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    num_bits: int
    group_size: int
    symmetric: bool

    @property
    def scheme(self) -> tuple[int, int, bool]:
        return (self.num_bits, self.group_size, self.symmetric)


@dataclass
class QuantizeResult:
    """What the pipeline produced.

    ``modules``: full module name -> :class:`QuantizedLinear`. ``group_size``: the group
    size of the recipe's base scheme after ``auto`` resolution. ``layers``: per-layer
    figures (mean relative weight error, relative output error, AWQ ratios / GPTQ
    damping, seconds).
    """

    group_size: int | None
    modules: dict[str, QuantizedLinear] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    #: static KV-cache scales: layer index -> (k_scale, v_scale) in the storage dtype
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: things the user should know (patterns matching nothing, damping raised, ...)
    warnings: list[str] = field(default_factory=list)
    #: observed post-RoPE absmax per layer: (k [kv_heads], v [kv_heads])
    kv_absmax: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def check_patterns(model, recipe: Recipe, arch: ArchSpec) -> list[str]:
    """Every ``targets``/``overrides`` pattern must match some decoder linear (a typo would
    otherwise silently change the scheme); ``ignore`` entries matching nothing are warnings.

    Raises:
        InputError: names the first pattern that matches no decoder linear.
    """
    from .recipe import matches

    n_layers = len(get_module(model, arch.layers))
    names = [f"{arch.layers}.{i}.{rel}" for i in range(n_layers) for rel in arch.linears]
    hint = f"decoder linears are named like {names[0]}" if names else ""
    for where, pats in [("targets", recipe.targets)] + [(f"overrides[{k}].targets", o.targets) for k, o in enumerate(recipe.overrides)]:
        for p in pats:
            if not any(matches([p], n) for n in names):
                raise InputError(f"recipe {where}: {p!r} matches no decoder linear ({hint}; lm_head and embeddings stay float)")
    return [f"recipe ignore entry {p!r} matches no decoder linear" for p in recipe.ignore if not any(matches([p], n) for n in names)]


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


def resolve_schemes(recipe: Recipe, targets: dict[str, torch.nn.Linear], arch: ArchSpec) -> dict[str, tuple[int, int, bool]]:
    """Module name -> ``(num_bits, group_size, symmetric)`` with ``auto`` group sizes resolved.

    Modules that share a recipe scheme share one resolved group size.

    Raises:
        InputError: a group size does not fit; linears vLLM fuses (q/k/v, gate/up) were
            given different schemes or were only partly ignored.
    """
    by_scheme: dict[tuple, dict[str, int]] = {}
    for name, mod in targets.items():
        ws = recipe.scheme_for(name)
        by_scheme.setdefault((ws.num_bits, ws.group_size, ws.symmetric), {})[name] = mod.in_features
    out = {}
    for (bits, gs, sym), in_features in by_scheme.items():
        scheme = recipe.weights.model_copy(update={"num_bits": bits, "group_size": gs, "symmetric": sym})
        resolved = resolve_group_size(recipe.model_copy(update={"weights": scheme}), in_features)
        for name in in_features:
            out[name] = (bits, resolved, sym)
    for i in _layer_indices(targets, arch):
        for fused in arch.fused:
            names = [f"{arch.layers}.{i}.{rel}" for rel in fused]
            present = [n for n in names if n in out]
            if present and len(present) != len(names):
                raise InputError(
                    f"{', '.join(names)} are fused into one kernel by vLLM: quantize all of them or none "
                    f"(only {', '.join(p.rsplit('.', 1)[-1] for p in present)} targeted)"
                )
            if len({out[n] for n in present}) > 1:
                raise InputError(
                    f"{', '.join(names)} are fused into one kernel by vLLM and must share one weight scheme; "
                    "adjust the recipe's overrides"
                )
    return out


def _layer_indices(targets: dict[str, torch.nn.Module], arch: ArchSpec) -> list[int]:
    """Sorted decoder-layer indices that hold at least one target."""
    prefix = arch.layers + "."
    return sorted({int(n[len(prefix):].split(".", 1)[0]) for n in targets})


def check_finite(model) -> None:
    """Raise :class:`InputError` naming the first parameter holding NaN or Inf."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")


def _layer_forward(layer, h, pe, pos, observer=None):
    kw = {cache_kwarg(layer): observer, "use_cache": True} if observer is not None else {}
    out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe, **kw)
    return out[0] if isinstance(out, tuple) else out


def _inspect_forward(module, x, pe, is_attention):
    out = module(hidden_states=x, position_embeddings=pe, attention_mask=None) if is_attention else module(x)
    return out[0] if isinstance(out, tuple) else out


class _Quantizer:
    """Per-module schemes plus the storage dtype; turns a Linear into a :class:`QuantizedLinear`."""

    def __init__(self, schemes: dict[str, tuple[int, int, bool]], dtype: torch.dtype):
        self.schemes, self.dtype = schemes, dtype

    def finish(self, name, lin, q, scale, zp, g_idx, col_scale=None, original=None, row_scale=None):
        """Store ``(q, scale, zp, g_idx)``, write the dequantized weight into ``lin``; returns (record, rel. error)."""
        bits, gs, sym = self.schemes[name]
        scale = scale.to(self.dtype)  # what the artifact stores and loaders dequantize with
        deq = dequantize(q, scale, None if sym else zp, gs, dtype=torch.float32, g_idx=g_idx)
        if not (torch.isfinite(scale.float()).all() and torch.isfinite(deq).all()):
            raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
        ref = (original if original is not None else lin.weight.detach()).float()
        # error in the original's space: AWQ's folded input scales (col) and, when this linear
        # feeds another scaling group, its divided output rows (row) undone
        eff = deq / col_scale if col_scale is not None else deq
        if row_scale is not None:
            eff = eff * row_scale.view(-1, 1).to(eff)
        rel = float((eff - ref.to(eff.device)).norm() / ref.norm().clamp(min=1e-12))
        lin.weight.data.copy_(deq.to(lin.weight.dtype))
        record = QuantizedLinear(
            q=q.cpu(), scale=scale.cpu().contiguous(), zero_point=None if sym else zp.cpu(),
            g_idx=None if g_idx is None else g_idx.cpu().to(torch.int32), num_bits=bits, group_size=gs, symmetric=sym,
        )
        return record, rel

    def quantize_linear(self, name, lin, clip_max=None, col_scale=None, original=None, row_scale=None):
        """Round-to-nearest (optionally clipped) quantization of one Linear, in place."""
        bits, gs, sym = self.schemes[name]
        q, scale, zp = rtn_quantize(lin.weight.detach(), bits, gs, sym, clip_max)
        return self.finish(name, lin, q, scale, zp, None, col_scale, original, row_scale)


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
    """Quantize ``model`` in place according to ``recipe`` (RTN, AWQ or GPTQ).

    Args:
        model: a float decoder-only causal LM whose ``config.model_type`` is in the
            architecture table.
        recipe: the effective recipe.
        calib_ids: int64 ``[n_samples, seqlen]`` calibration tokens (required for AWQ and
            GPTQ; ignored by RTN).
        device: ``cpu`` or ``cuda``: where each layer is processed.
        dtype: storage dtype of scales in the artifact (the in-memory model stays float32).
        on_layer: progress callback ``(layer_index, n_layers, layer_figures)``.

    Raises:
        InputError: unsupported architecture, group size that does not fit, non-finite
            source weights, missing calibration, fused linears with different schemes.
        QuantizationError: a non-finite scale or weight was produced (names the module).
    """
    t0 = time.perf_counter()
    arch = get_arch(model.config.model_type)
    kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
    quantize_weights = recipe.algorithm != "none"
    if not quantize_weights and kv is None:
        raise InputError("the recipe quantizes nothing: algorithm none and no kv_cache scheme")
    pattern_warnings = check_patterns(model, recipe, arch) if quantize_weights else []
    targets = target_modules(model, recipe, arch) if quantize_weights else {}
    if quantize_weights and not targets:
        raise InputError("the recipe's targets/ignore lists exclude every linear module; nothing to quantize")
    schemes = resolve_schemes(recipe, targets, arch)
    base = [s for n, s in schemes.items() if not recipe.overrides or recipe.scheme_for(n) == recipe.weights]
    gs = (base[0][1] if base else next(iter(schemes.values()))[1]) if schemes else None
    check_finite(model)
    observe_kv = kv is not None and kv.static
    if (recipe.algorithm in ("awq", "gptq") or observe_kv) and calib_ids is None:
        what = recipe.algorithm.upper() if recipe.algorithm in ("awq", "gptq") else f"static KV-cache scales ({kv.describe()})"
        raise InputError(f"{what} needs calibration data (--calib)")
    result = QuantizeResult(group_size=gs, warnings=pattern_warnings)
    quantizer = _Quantizer(schemes, dtype)
    layers = get_module(model, arch.layers)
    n_layers = len(layers)
    observer = kv_observer(n_layers) if observe_kv else None

    if recipe.algorithm in ("rtn", "none") and not observe_kv:
        for i, layer in enumerate(layers):
            t1 = time.perf_counter()
            errs = _rtn_layer(i, arch, targets, quantizer, result)
            fig = _figures(i, schemes, f"{arch.layers}.{i}.", errs, None, time.perf_counter() - t1)
            result.layers.append(fig)
            if on_layer:
                on_layer(i, n_layers, fig)
        result.seconds = time.perf_counter() - t0
        return result

    # ---- sequential pass over calibration activations (AWQ / GPTQ, or RTN/none + KV observers) ----
    embed = get_module(model, arch.embed_tokens)
    rotary = get_module(model, arch.rotary_emb).to(device)
    seqlen = calib_ids.shape[1]
    pos = torch.arange(seqlen, device=device).unsqueeze(0)
    hidden = [embed(b).float().to(device) for b in calib_ids.split(batch_size)]
    pe = rotary(hidden[0][:1], pos)
    loss_n = min(recipe.awq.loss_samples, calib_ids.shape[0])
    layer_fn = {"awq": _awq_layer, "gptq": _gptq_layer}.get(recipe.algorithm, _plain_layer)
    for i, layer in enumerate(layers):
        t1 = time.perf_counter()
        layer.to(device)
        hidden, fig = layer_fn(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result, observer)
        layer.to("cpu")
        fig["seconds"] = round(time.perf_counter() - t1, 3)
        result.layers.append(fig)
        if on_layer:
            on_layer(i, n_layers, fig)
    rotary.to("cpu")
    raised = [f for f in result.layers if f.get("gptq", {}).get("damp_retries")]
    if raised:
        worst = max(f["gptq"]["max_damp"] for f in raised)
        result.warnings.append(
            f"GPTQ raised the damping in {len(raised)} layer(s) (Hessian not positive definite; largest damp {worst:.4g}); "
            "see quality.layers[].gptq in the manifest"
        )
    if observer is not None:
        result.kv_absmax = observed_absmax(observer)
        for i, (k, v) in result.kv_absmax.items():
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise QuantizationError(f"KV-cache statistics of layer {i} are not finite; nothing was written")
            result.kv_scales[i] = (static_scales(k, kv).to(dtype), static_scales(v, kv).to(dtype))
    result.seconds = time.perf_counter() - t0
    return result


def _rtn_layer(i, arch, targets, quantizer, result) -> list[float]:
    errs = []
    for rel in arch.linears:
        name = f"{arch.layers}.{i}.{rel}"
        if name in targets:
            result.modules[name], e = quantizer.quantize_linear(name, targets[name])
            errs.append(e)
    return errs


def _plain_layer(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result, observer):
    """RTN (or no weight quantization) inside the sequential pass, so KV observers see the quantized layer."""
    errs = _rtn_layer(i, arch, targets, quantizer, result)
    new_hidden = _recompute(i, layer, hidden, pe, pos, observer)
    return new_hidden, _figures(i, quantizer.schemes, f"{arch.layers}.{i}.", errs, None, 0.0)


def _figures(i, schemes, prefix, errs, out_err, seconds, **extra):
    layer_schemes = sorted({v for k, v in schemes.items() if k.startswith(prefix)})
    bits = [b for b, _, _ in layer_schemes]
    sizes = [g for _, g, _ in layer_schemes]
    return {
        "layer": i,
        "num_bits": (bits[0] if len(set(bits)) == 1 else sorted(set(bits))) if bits else None,
        "group_size": (sizes[0] if len(set(sizes)) == 1 else sorted(set(sizes))) if sizes else None,
        "modules": len(errs),
        "mean_rel_error": round(sum(errs) / len(errs), 6) if errs else None,
        "output_rel_error": None if out_err is None else round(out_err, 6),
        **extra,
        "seconds": round(seconds, 3),
    }


def _recompute(i, layer, hidden, pe, pos, observer=None):
    """The layer's outputs with its quantized weights (the next layer's inputs); KV statistics on the way."""
    new_hidden = [_layer_forward(layer, h, pe, pos, observer) for h in hidden]
    for j, h in enumerate(new_hidden):
        if not torch.isfinite(h).all():
            raise QuantizationError(f"decoder layer {i} produced NaN/Inf after quantization (batch {j}); nothing was written")
    return new_hidden


def _out_error(q_out: torch.Tensor, f_out: torch.Tensor) -> float:
    return float((q_out - f_out).norm() / f_out.norm().clamp(min=1e-12))


class _StopForward(Exception):
    """Raised by a hook once the inputs it needs are captured (skips the rest of the layer)."""


def _gptq_layer(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result, observer=None):
    """GPTQ for one decoder layer: Hessians per stage (true-sequential) or all at once, then quantize."""
    opts = recipe.gptq
    prefix = f"{arch.layers}.{i}."
    phases: dict[str, float] = {}
    tp = time.perf_counter()
    n_ref = min(loss_n, hidden[0].shape[0])
    float_out = _layer_forward(layer, hidden[0][:n_ref], pe, pos)  # reference for the output error
    stages = [tuple(r for r in st if prefix + r in targets) for st in arch.sequential]
    stages = [st for st in stages if st]
    passes = stages if opts.true_sequential else [tuple(r for st in stages for r in st)]
    errs, damps, retries, dead = [], [], 0, 0
    phases["reference"], tp = time.perf_counter() - tp, time.perf_counter()
    hess_t = quant_t = 0.0
    for group in passes:
        # one Hessian per distinct input: the first linear of each stage in this pass
        readers = [st[0] for st in stages if st[0] in group]
        accs = {rel: HessianAccumulator(get_module(layer, rel).in_features, device=pe[0].device) for rel in readers}
        last = readers[-1]

        def make_hook(rel):
            def hook(_mod, args):
                accs[rel].add(args[0])
                if rel == last:
                    raise _StopForward
            return hook

        t_h = time.perf_counter()
        handles = [get_module(layer, rel).register_forward_pre_hook(make_hook(rel)) for rel in readers]
        try:
            for h in hidden:
                try:
                    _layer_forward(layer, h, pe, pos)
                except _StopForward:
                    pass
        finally:
            for hd in handles:
                hd.remove()
        hess_t += time.perf_counter() - t_h
        t_q = time.perf_counter()
        for st in stages:
            if st[0] not in accs:
                continue
            H = accs[st[0]].hessian()
            for rel in st:
                name = prefix + rel
                lin = get_module(layer, rel)
                bits, gs, sym = quantizer.schemes[name]
                r = gptq_quantize(
                    lin.weight.detach(), H, bits, gs, sym, block_size=opts.block_size, damp=opts.damp,
                    damp_increment=opts.damp_increment, act_order=opts.act_order,
                    static_groups=opts.static_groups, scale_dtype=quantizer.dtype, name=name,
                )
                result.modules[name], e = quantizer.finish(name, lin, r.q, r.scale, r.zero_point, r.g_idx)
                errs.append(e)
                damps.append(r.damp)
                retries += r.retries
                dead += r.dead_channels
            del H
        quant_t += time.perf_counter() - t_q
    phases["hessian"], phases["gptq"] = hess_t, quant_t
    tp = time.perf_counter()
    new_hidden = _recompute(i, layer, hidden, pe, pos, observer)
    out_err = _out_error(new_hidden[0][:n_ref], float_out)
    phases["recompute"] = time.perf_counter() - tp
    fig = _figures(i, quantizer.schemes, prefix, errs, out_err, 0.0,
                   gptq={"max_damp": max(damps) if damps else None, "damp_retries": retries, "dead_channels": dead})
    fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig


def _awq_layer(i, layer, hidden, pe, pos, arch, recipe, quantizer, targets, loss_n, result, observer=None):
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
    row_scale: dict[str, torch.Tensor] = {}
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
        specs = [quantizer.schemes.get(prefix + r, quantizer.schemes[next(iter(quantizer.schemes))]) for r in group.linears]
        s, ratio, _ = search_scales(
            x_mean[group.linears[0]], weights, loss_fn, [b for b, _, _ in specs], [g for _, g, _ in specs],
            [y for _, _, y in specs], n_grid=opts.n_grid, duo_scaling=opts.duo_scaling, name=name,
        )
        ratios[group.prev_op] = ratio
        # fold: prev_op output /= s, consumers' input channels *= s (float function unchanged)
        prev.weight.data.div_(s.view(-1, *([1] * (prev.weight.ndim - 1))))
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s)
        if group.prev_op in linears:
            row_scale[group.prev_op] = s
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
            bits, gs, sym = quantizer.schemes[name]
            clip_max = search_clip(lin.weight.detach(), xs[idx], bits, gs, sym, opts.clip_grid, opts.clip_max_shrink)
        result.modules[name], e = quantizer.quantize_linear(
            name, lin, clip_max, col_scale.get(rel), originals[rel], row_scale.get(rel)
        )
        errs.append(e)

    # 4. recompute this layer's outputs with the quantized weights -> next layer's inputs
    phases["clip_and_quantize"], tp = time.perf_counter() - tp, time.perf_counter()
    new_hidden = _recompute(i, layer, hidden, pe, pos, observer)
    out_err = _out_error(torch.cat(new_hidden)[:loss_n], torch.cat(float_out))
    phases["recompute"] = time.perf_counter() - tp
    fig = _figures(i, quantizer.schemes, prefix, errs, out_err, 0.0, awq_ratios=ratios)
    fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig
