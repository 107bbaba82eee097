"""The sequential, layer-by-layer quantization driver.

Data flow (DESIGN.md): capture the inputs of decoder layer 0 once; for each layer,
observe its linears' inputs, run AWQ (or RTN), quantize, then recompute the layer's
outputs *with the quantized weights* and feed them to the next layer. Only one layer
is on the compute device at a time; the model is modified in place (its linears end
up holding the dequantized weights, its norms the AWQ-folded scales), so memory holds
one float copy of the model plus the packed integers -- never two float copies.

Layer inputs and the keyword arguments each layer receives (attention mask -- sliding
windows included --, rotary embeddings of the layer's type, position ids) are captured
by running the model itself with the decoder layers replaced by catchers, so embedding
scaling (Gemma), per-layer-type RoPE and masks come from transformers' own code.

Mixture-of-experts layers (``arch.moe``) are unfused into per-expert linears first
(:mod:`compressor.moe`); every routed expert is quantized. The calibration pass counts
the (token, slot) routings of each expert; an expert with fewer than
``max(recipe.moe.min_tokens, 1)`` is quantized with RTN (no AWQ clipping, no GPTQ
Hessian; with AWQ it still shares the layer's input scaling, folded into the norm) and
reported in :attr:`QuantizeResult.moe_fallback`. Routers stay in float; AWQ scales their
input columns with the experts' so routing is unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .arch import (
    ArchSpec, checkpoint_name, expand, expert_index, find_module, get_arch, get_module, is_expert, layer_fused_sets,
    layer_groups, layer_linears, num_experts,
)
from .distributed import deal
from .errors import InputError, QuantizationError
from .moe import UnfusedExperts, unfuse_experts
from .quant.awq import search_clip, search_scales
from .quant.gptq import HessianAccumulator, gptq_quantize
from .quant.kv import cache_kwarg, check_layout, kv_observer, layer_scales, observed_absmax
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
    #: observed post-RoPE absmax per layer: (k [kv_heads], v [kv_heads]) (MLA: latent, RoPE key)
    kv_absmax: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: per MoE layer: {"layer", "experts", "expert_tokens" (routed (token, slot) pairs per
    #: expert in the calibration pass, None without one), "below_min_tokens"}
    moe: list[dict] = field(default_factory=list)
    #: experts quantized with the RTN fallback: {"layer", "expert", "tokens", "modules", "method", "reason"}
    moe_fallback: list[dict] = field(default_factory=list)


@dataclass
class LayerHooks:
    """Streaming and resume around the per-layer loop (see :mod:`compressor.streaming`).

    ``load(i, layer)`` materializes decoder layer ``i`` before it is processed;
    ``done(i, layer, result, hidden)`` runs after it (``hidden``: the next layer's input
    activations, ``None`` without a calibration pass): it writes the layer's tensors,
    records a resume checkpoint and releases the weights. Layers ``< start`` were done by
    an interrupted run: they are skipped, ``hidden`` holds the inputs of layer ``start``
    and ``kv_absmax`` the KV statistics already observed. Activations above
    ``activation_budget`` bytes move to memory-mapped files in ``spill_dir``.
    """

    load: Callable[[int, torch.nn.Module], None]
    done: Callable[[int, torch.nn.Module, "QuantizeResult", list | None], None]
    start: int = 0
    hidden: list | None = None
    kv_absmax: dict = field(default_factory=dict)
    activation_budget: int | None = None
    spill_dir: object = None
    #: results of the layers done before the interruption (QuantizeResult.layers / moe / moe_fallback)
    layers: list = field(default_factory=list)
    moe: list = field(default_factory=list)
    moe_fallback: list = field(default_factory=list)


def check_patterns(model, recipe: Recipe, arch: ArchSpec) -> list[str]:
    """Every ``targets``/``overrides`` pattern must match some decoder linear (a typo would
    otherwise silently change the scheme); ``ignore`` entries matching nothing are warnings.

    Raises:
        InputError: names the first pattern that matches no decoder linear (a pattern
            naming only MoE routers says that routers stay in float).
    """
    from .arch import routers
    from .recipe import matches

    layers = get_module(model, arch.layers)
    names = [f"{arch.layers}.{i}.{rel}" for i, layer in enumerate(layers) for rel in layer_linears(arch, layer)]
    hint = f"decoder linears are named like {names[0]}" if names else ""
    gates = routers(arch, model)
    for where, pats in [("targets", recipe.targets)] + [(f"overrides[{k}].targets", o.targets) for k, o in enumerate(recipe.overrides)]:
        for p in pats:
            if not any(matches([p], n) for n in names):
                hit = next((g for g in gates if matches([p], g)), None)
                if hit is not None:
                    raise InputError(f"recipe {where}: {p!r} names the MoE router {hit}; routers stay in float "
                                     "(vLLM builds them unquantized): drop the pattern")
                raise InputError(f"recipe {where}: {p!r} matches no decoder linear ({hint}; lm_head and embeddings stay float)")
    return [f"recipe ignore entry {p!r} matches no decoder linear" for p in recipe.ignore if not any(matches([p], n) for n in names)]


def target_modules(model, recipe: Recipe, arch: ArchSpec) -> dict[str, torch.nn.Linear]:
    """Full name -> Linear of every decoder-layer linear the recipe quantizes (in order)."""
    layers = get_module(model, arch.layers)
    out = {}
    for i, layer in enumerate(layers):
        for rel in layer_linears(arch, layer):
            name = f"{arch.layers}.{i}.{rel}"
            mod = get_module(layer, rel)
            if not isinstance(mod, torch.nn.Linear):
                raise InputError(f"{name} is {type(mod).__name__}, expected a Linear")
            if not recipe.is_ignored(name):
                out[name] = mod
    return out


def resolve_schemes(recipe: Recipe, targets: dict[str, torch.nn.Linear], arch: ArchSpec, model=None) -> dict[str, tuple[int, int, bool]]:
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
    layers = get_module(model, arch.layers) if model is not None else None
    for i in _layer_indices(targets, arch):
        fused_sets = layer_fused_sets(arch, layers[i]) if layers is not None else arch.fused
        for fused in fused_sets:
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
        if not p.is_meta and not torch.isfinite(p).all():  # meta: not loaded yet (streaming checks on load)
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")


def _layer_forward(layer, h, kw, observer=None):
    extra = {cache_kwarg(layer): observer, "use_cache": True} if observer is not None else {}
    out = layer(h, **kw, **extra)
    return out[0] if isinstance(out, tuple) else out


def _inspect_forward(module, x, kw, is_attention):
    if is_attention:
        out = module(hidden_states=x, position_embeddings=kw.get("position_embeddings"),
                     attention_mask=kw.get("attention_mask"))
    else:
        out = module(x)
    return out[0] if isinstance(out, tuple) else out


#: keyword arguments of a decoder layer that belong to the caller's cache, not to the layer
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache", "output_attentions", "cache_position")


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer ``index``: records its input, stops the forward at ``stop``."""

    def __init__(self, index: int, record, stop: int):
        super().__init__()
        self.index, self.record, self.stop = index, record, stop

    def forward(self, hidden_states, *args, **kwargs):
        self.record(self.index, hidden_states, kwargs)
        if self.index == self.stop:
            raise _StopForward
        return hidden_states


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_layer_inputs(model, arch: ArchSpec, calib_ids: torch.Tensor, batch_size: int, device: str,
                         kwargs_only: bool = False):
    """Inputs of decoder layer 0 and the keyword arguments of every layer, from the model's own forward.

    The decoder layers are replaced by catchers (restored afterwards): one forward of one
    sequence records each layer's keyword arguments (``attention_mask``,
    ``position_embeddings``, ``position_ids``; batch 1, so they broadcast over any batch);
    then one forward per batch of ``calib_ids [n, T]`` records layer 0's input. Only the
    embedding (and mask/RoPE construction) runs.

    Returns:
        ``(hidden, kwargs)``: list of float32 ``[b, T, H]`` on ``device`` (empty with
        ``kwargs_only``, when resuming), and one dict per layer.

    Raises:
        QuantizationError: the model did not call some decoder layer.
    """
    layers = get_module(model, arch.layers)
    originals = list(layers)
    n = len(originals)
    kwargs: list[dict | None] = [None] * n
    hidden: list[torch.Tensor] = []

    def record_kwargs(i, _h, kw):
        kwargs[i] = {k: v for k, v in kw.items() if k not in _CACHE_KWARGS}

    def record_hidden(_i, h, _kw):
        hidden.append(h.detach().float().to(device))

    try:
        for i in range(n):
            layers[i] = _Catcher(i, record_kwargs, n - 1)
        try:
            model(input_ids=calib_ids[:1], use_cache=False)
        except _StopForward:
            pass
        layers[0] = _Catcher(0, record_hidden, 0)
        for b in [] if kwargs_only else calib_ids.split(batch_size):
            try:
                model(input_ids=b, use_cache=False)
            except _StopForward:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    missing = [i for i, k in enumerate(kwargs) if k is None]
    if missing or (not kwargs_only and len(hidden) != len(calib_ids.split(batch_size))):
        raise QuantizationError(f"the model's forward did not reach decoder layer {missing[0] if missing else 0}; "
                                "cannot capture its inputs")
    return hidden, [_to_device(k, device) for k in kwargs]


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
    hooks: LayerHooks | None = None,
) -> QuantizeResult:
    """Quantize ``model`` in place according to ``recipe`` (RTN, AWQ or GPTQ).

    Args:
        model: a float decoder-only causal LM whose ``config.model_type`` is in the
            architecture table. Fused MoE experts are unfused in place into per-expert
            ``nn.Linear`` modules (:func:`compressor.moe.unfuse_experts`) and stay so.
        recipe: the effective recipe.
        calib_ids: int64 ``[n_samples, seqlen]`` calibration tokens (required for AWQ and
            GPTQ; ignored by RTN).
        device: ``cpu`` or ``cuda``: where each layer is processed.
        dtype: storage dtype of scales in the artifact (the in-memory model stays float32).
        on_layer: progress callback ``(layer_index, n_layers, layer_figures)``.
        hooks: per-layer load/write/release and resume state (:class:`LayerHooks`); with
            them the decoder layers may start on the ``meta`` device.

    Raises:
        InputError: unsupported architecture, group size that does not fit, non-finite
            source weights, missing calibration, fused linears with different schemes, a
            KV scheme the attention layout cannot hold (per-head scales on MLA).
        QuantizationError: a non-finite scale or weight was produced (names the module).
    """
    t0 = time.perf_counter()
    arch = get_arch(model.config.model_type)
    kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
    layout = arch.kv_layout(model.config) if kv is not None else None
    if kv is not None:
        check_layout(kv, layout)
    quantize_weights = recipe.algorithm != "none"
    if not quantize_weights and kv is None:
        raise InputError("the recipe quantizes nothing: algorithm none and no kv_cache scheme")
    unfuse_experts(model, arch)
    pattern_warnings = check_patterns(model, recipe, arch) if quantize_weights else []
    targets = target_modules(model, recipe, arch) if quantize_weights else {}
    if quantize_weights and not targets:
        raise InputError("the recipe's targets/ignore lists exclude every linear module; nothing to quantize")
    schemes = resolve_schemes(recipe, targets, arch, model)
    base = [s for n, s in schemes.items() if not recipe.overrides or recipe.scheme_for(n) == recipe.weights]
    gs = (base[0][1] if base else next(iter(schemes.values()))[1]) if schemes else None
    check_finite(model)
    observe_kv = kv is not None and kv.static
    if (recipe.algorithm in ("awq", "gptq") or observe_kv) and calib_ids is None:
        what = recipe.algorithm.upper() if recipe.algorithm in ("awq", "gptq") else f"static KV-cache scales ({kv.describe()})"
        raise InputError(f"{what} needs calibration data (--calib)")
    result = QuantizeResult(group_size=gs, warnings=pattern_warnings)
    if hooks is not None:
        result.layers.extend(hooks.layers)
        result.moe.extend(hooks.moe)
        result.moe_fallback.extend(hooks.moe_fallback)
    quantizer = _Quantizer(schemes, dtype)
    layers = get_module(model, arch.layers)
    n_layers = len(layers)
    observer = kv_observer(n_layers) if observe_kv else None
    ctx = _Ctx(arch, recipe, quantizer, targets, result, observer, min(recipe.awq.loss_samples, len(calib_ids) if calib_ids is not None else 1))

    start = hooks.start if hooks is not None else 0
    if recipe.algorithm in ("rtn", "none") and not observe_kv:
        for i, layer in enumerate(layers):
            if i < start:
                continue
            t1 = time.perf_counter()
            if hooks is not None:
                hooks.load(i, layer)
            errs = _rtn_layer(i, layer, ctx)
            _record_moe(i, layer, ctx, None)
            fig = _figures(i, schemes, f"{arch.layers}.{i}.", errs, None, time.perf_counter() - t1)
            result.layers.append(fig)
            if hooks is not None:
                hooks.done(i, layer, result, None)
            if on_layer:
                on_layer(i, n_layers, fig)
        result.seconds = time.perf_counter() - t0
        return result

    # ---- sequential pass over calibration activations (AWQ / GPTQ, or RTN/none + KV observers) ----
    resumed = hooks is not None and hooks.hidden is not None
    hidden, layer_kwargs = capture_layer_inputs(model, arch, calib_ids, batch_size, device, kwargs_only=resumed)
    if resumed:
        hidden = hooks.hidden
        for i, (k, v) in hooks.kv_absmax.items():
            if observer is not None:
                observer.layers[i].k_absmax, observer.layers[i].v_absmax = k, v
    layer_fn = {"awq": _awq_layer, "gptq": _gptq_layer}.get(recipe.algorithm, _plain_layer)
    for i, layer in enumerate(layers):
        if i < start:
            continue
        t1 = time.perf_counter()
        if hooks is not None:
            hooks.load(i, layer)
        layer.to(device)
        hidden, fig = layer_fn(i, layer, hidden, layer_kwargs[i], ctx)
        layer.to("cpu")
        if hooks is not None and hooks.activation_budget is not None:
            from .streaming import spill

            hidden = spill(hidden, hooks.spill_dir, f"{i % 2}", hooks.activation_budget)
        fig["seconds"] = round(time.perf_counter() - t1, 3)
        result.layers.append(fig)
        if observer is not None and observer.layers[i].k_absmax is not None:
            result.kv_absmax[i] = (observer.layers[i].k_absmax, observer.layers[i].v_absmax)
        if hooks is not None:
            hooks.done(i, layer, result, hidden)
        if on_layer:
            on_layer(i, n_layers, fig)
    raised = [f for f in result.layers if f.get("gptq", {}).get("damp_retries")]
    if raised:
        worst = max(f["gptq"]["max_damp"] for f in raised)
        result.warnings.append(
            f"GPTQ raised the damping in {len(raised)} layer(s) (Hessian not positive definite; largest damp {worst:.4g}); "
            "see quality.layers[].gptq in the manifest"
        )
    if result.moe_fallback:
        n_layers_fb = len({f["layer"] for f in result.moe_fallback})
        result.warnings.append(
            f"{len(result.moe_fallback)} expert(s) in {n_layers_fb} MoE layer(s) were routed fewer than "
            f"{max(recipe.moe.min_tokens, 1)} calibration tokens and were quantized with RTN; see quality.moe.fallback"
        )
    if observer is not None:
        result.kv_absmax = observed_absmax(observer)
        for i, (k, v) in result.kv_absmax.items():
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise QuantizationError(f"KV-cache statistics of layer {i} are not finite; nothing was written")
            ks, vs = layer_scales(k, v, kv, layout)
            result.kv_scales[i] = (ks.to(dtype), vs.to(dtype))
    result.seconds = time.perf_counter() - t0
    return result


@dataclass
class _Ctx:
    """What every per-layer step reads: the architecture row, recipe, schemes, targets, results."""

    arch: ArchSpec
    recipe: Recipe
    quantizer: _Quantizer
    targets: dict
    result: QuantizeResult
    observer: object
    loss_n: int


def _experts(layer, ctx) -> UnfusedExperts | None:
    if ctx.arch.moe is None:
        return None
    m = find_module(layer, ctx.arch.moe.experts)
    return m if isinstance(m, UnfusedExperts) else None


def _cold(counts: list[int] | None, ctx) -> set[int]:
    """Experts routed fewer than ``max(moe.min_tokens, 1)`` (token, slot) pairs."""
    if counts is None:
        return set()
    limit = max(ctx.recipe.moe.min_tokens, 1)
    return {e for e, c in enumerate(counts) if c < limit}


def _record_moe(i, layer, ctx, counts: list[int] | None) -> None:
    """Per-layer routing figures (and the RTN fallbacks they caused) for the manifest."""
    n = num_experts(ctx.arch, layer)
    if not n:
        return
    cold = sorted(_cold(counts, ctx))
    ctx.result.moe.append({"layer": i, "experts": n, "expert_tokens": counts, "below_min_tokens": cold})
    prefix = f"{ctx.arch.layers}.{i}."
    limit = max(ctx.recipe.moe.min_tokens, 1)
    for e in cold if ctx.recipe.algorithm in ("awq", "gptq") else []:
        mods = [checkpoint_name(ctx.arch, prefix + r) for r in layer_linears(ctx.arch, layer)
                if expert_index(ctx.arch, r) == e and prefix + r in ctx.targets]
        if mods:
            ctx.result.moe_fallback.append({
                "layer": i, "expert": e, "tokens": counts[e], "modules": mods, "method": "rtn",
                "reason": f"{counts[e]} routed calibration tokens < moe.min_tokens {limit}"})


def _rtn_layer(i, layer, ctx) -> list[float]:
    errs = []
    for rel in layer_linears(ctx.arch, layer):
        name = f"{ctx.arch.layers}.{i}.{rel}"
        if name in ctx.targets:
            ctx.result.modules[name], e = ctx.quantizer.quantize_linear(name, ctx.targets[name])
            errs.append(e)
    return errs


def _plain_layer(i, layer, hidden, kw, ctx):
    """RTN (or no weight quantization) inside the sequential pass, so KV observers see the quantized layer."""
    errs = _rtn_layer(i, layer, ctx)
    experts = _experts(layer, ctx)
    if experts is not None:
        experts.counts.zero_()
    new_hidden = _recompute(i, layer, hidden, kw, ctx.observer)
    _record_moe(i, layer, ctx, experts.counts.tolist() if experts is not None else None)
    return new_hidden, _figures(i, ctx.quantizer.schemes, f"{ctx.arch.layers}.{i}.", errs, None, 0.0)


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


def _recompute(i, layer, hidden, kw, observer=None):
    """The layer's outputs with its quantized weights (the next layer's inputs); KV statistics on the way."""
    new_hidden = [_layer_forward(layer, h, kw, observer) for h in hidden]
    for j, h in enumerate(new_hidden):
        if not torch.isfinite(h).all():
            raise QuantizationError(f"decoder layer {i} produced NaN/Inf after quantization (batch {j}); nothing was written")
    return new_hidden


def _out_error(q_out: torch.Tensor, f_out: torch.Tensor) -> float:
    return float((q_out - f_out).norm() / f_out.norm().clamp(min=1e-12))


class _StopForward(Exception):
    """Raised by a hook once the inputs it needs are captured (skips the rest of the layer)."""


def _reader_sets(stage: list[str], fused_sets: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Partition a stage's linears into sets reading the same input (fused sets; the rest alone)."""
    out, seen = [], set()
    for f in fused_sets:
        members = tuple(r for r in f if r in stage)
        if members:
            out.append(members)
            seen.update(members)
    out += [(r,) for r in stage if r not in seen]
    order = {r: k for k, r in enumerate(stage)}
    return sorted(out, key=lambda m: order[m[0]])


def _gptq_layer(i, layer, hidden, kw, ctx):
    """GPTQ for one decoder layer: one Hessian per set of linears sharing an input, stage by
    stage (true-sequential) or all at once; cold experts fall back to RTN."""
    arch, quantizer, opts = ctx.arch, ctx.quantizer, ctx.recipe.gptq
    prefix = f"{arch.layers}.{i}."
    phases: dict[str, float] = {}
    tp = time.perf_counter()
    n_ref = min(ctx.loss_n, hidden[0].shape[0])
    float_out = None  # the float layer's output on hidden[0][:n_ref], for the output error: taken
    # from the first Hessian pass (nothing in the layer is quantized yet), which runs batch 0 to the end
    n_exp = num_experts(arch, layer)
    present = set(layer_linears(arch, layer))
    stages = [[r for pat in st for r in expand(pat, n_exp) if r in present and prefix + r in ctx.targets]
              for st in arch.sequential]
    stages = [st for st in stages if st]
    passes = stages if opts.true_sequential else [[r for st in stages for r in st]]
    fused_sets = layer_fused_sets(arch, layer)
    experts = _experts(layer, ctx)
    counts: list[int] | None = None
    errs, damps, retries, dead = [], [], 0, 0
    hess_t = quant_t = 0.0
    for p_i, group in enumerate(passes):
        sets = _reader_sets(group, fused_sets)
        accs = {st[0]: HessianAccumulator(get_module(layer, st[0]).in_features, device=hidden[0].device) for st in sets}
        conditional = any(is_expert(arch, r) for r in group)  # experts fire only for routed tokens: no early stop
        fired: set[str] = set()
        run_through = [False]  # this batch runs to the layer's output (the float reference)

        def make_hook(rel):
            def hook(_mod, args):
                accs[rel].add(args[0])
                fired.add(rel)
                if not conditional and not run_through[0] and len(fired) == len(accs):
                    raise _StopForward
            return hook

        t_h = time.perf_counter()
        if experts is not None:
            experts.counts.zero_()
        handles = [get_module(layer, key).register_forward_pre_hook(make_hook(key)) for key in accs]
        try:
            for j, h in enumerate(hidden):
                fired.clear()
                run_through[0] = p_i == 0 and j == 0
                try:
                    out = _layer_forward(layer, h, kw)
                except _StopForward:
                    continue
                if run_through[0]:
                    float_out = out[:n_ref]
        finally:
            for hd in handles:
                hd.remove()
        if conditional and counts is None and experts is not None:
            counts = experts.counts.tolist()
        cold = _cold(counts, ctx)
        hess_t += time.perf_counter() - t_h
        t_q = time.perf_counter()
        tasks = []  # (linear, Hessian): the solves of this pass, dealt to the ranks (compressor.distributed)
        for st in sets:
            e = expert_index(arch, st[0])
            if (e is not None and e in cold) or accs[st[0]].n == 0:
                for rel in st:  # RTN fallback: too few routed tokens for a Hessian
                    name = prefix + rel
                    ctx.result.modules[name], err = quantizer.quantize_linear(name, get_module(layer, rel))
                    errs.append(err)
                continue
            H = accs[st[0]].hessian()
            tasks += [(rel, H) for rel in st]

        def solve(task):
            rel, H = task
            name = prefix + rel
            bits, gs, sym = quantizer.schemes[name]
            r = gptq_quantize(
                get_module(layer, rel).weight.detach(), H, bits, gs, sym, block_size=opts.block_size, damp=opts.damp,
                damp_increment=opts.damp_increment, act_order=opts.act_order,
                static_groups=opts.static_groups, scale_dtype=quantizer.dtype, name=name,
            )
            return r.q, r.scale, r.zero_point, r.g_idx, r.damp, r.retries, r.dead_channels

        for (rel, _H), (q, scale, zp, g_idx, damp, r_retries, r_dead) in zip(tasks, deal(tasks, solve)):
            name = prefix + rel
            ctx.result.modules[name], err = quantizer.finish(name, get_module(layer, rel), q, scale, zp, g_idx)
            errs.append(err)
            damps.append(damp)
            retries += r_retries
            dead += r_dead
        del tasks
        quant_t += time.perf_counter() - t_q
    phases["hessian"], phases["gptq"] = hess_t, quant_t
    tp = time.perf_counter()
    if float_out is None:  # no pass ran (nothing targeted in this layer)
        float_out = _layer_forward(layer, hidden[0][:n_ref], kw)
    if experts is not None and counts is None:  # no expert targeted: count routing on the recompute pass
        experts.counts.zero_()
    new_hidden = _recompute(i, layer, hidden, kw, ctx.observer)
    if experts is not None and counts is None:
        counts = experts.counts.tolist()
    _record_moe(i, layer, ctx, counts)
    out_err = _out_error(new_hidden[0][:n_ref], float_out)
    phases["recompute"] = time.perf_counter() - tp
    fig = _figures(i, quantizer.schemes, prefix, errs, out_err, 0.0,
                   gptq={"max_damp": max(damps) if damps else None, "damp_retries": retries, "dead_channels": dead})
    fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig


def _fold(prev, s: torch.Tensor, prev_rows, norm_offset: float) -> torch.Tensor | None:
    """Divide ``prev``'s output by ``s`` in its weights (exactly); returns the per-row scale
    of a linear ``prev`` (``None`` for a norm)."""
    if isinstance(prev, torch.nn.Linear):
        rows = torch.ones(prev.weight.shape[0], dtype=s.dtype, device=s.device)
        if prev_rows is None:
            rows = s.to(rows)
        else:
            k, n = prev_rows
            step = prev.weight.shape[0] // n
            rows[k * step:(k + 1) * step] = s
        prev.weight.data.div_(rows.view(-1, 1).to(prev.weight))
        if prev.bias is not None:
            prev.bias.data.div_(rows.to(prev.bias))
        return rows
    # a norm: y = x_hat * (norm_offset + w) [+ b] -> (norm_offset + w) / s
    w = prev.weight.data
    w.copy_(((w.float() + norm_offset) / s.to(w.device) - norm_offset).to(w.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.data.div_(s.to(prev.bias))
    return None


def _awq_layer(i, layer, hidden, kw, ctx):
    arch, quantizer, opts, targets = ctx.arch, ctx.quantizer, ctx.recipe.awq, ctx.targets
    loss_n = ctx.loss_n
    prefix = f"{arch.layers}.{i}."
    linears = {rel: get_module(layer, rel) for rel in layer_linears(arch, layer)}
    groups = layer_groups(arch, layer)
    watched = dict(linears)
    for g in groups:
        if g.inputs_at:
            watched[g.inputs_at] = get_module(layer, g.inputs_at)
    dev = hidden[0].device

    # 1. observe: mean |x| per input channel over every token a module sees; full inputs
    #    of the first loss_n sequences (routed experts: their tokens among them, [n, in])
    abs_sum = {k: None for k in watched}
    n_rows = {k: 0 for k in watched}
    stored: dict[str, list[torch.Tensor]] = {k: [] for k in watched}
    keep = [True]

    def make_hook(key):
        def hook(_mod, args):
            x = args[0].detach()
            flat = x.abs().float().reshape(-1, x.shape[-1])
            abs_sum[key] = flat.sum(0) if abs_sum[key] is None else abs_sum[key] + flat.sum(0)
            n_rows[key] += flat.shape[0]
            if keep[0]:
                stored[key].append(x.float())
        return hook

    phases = {}
    tp = time.perf_counter()
    experts = _experts(layer, ctx)
    if experts is not None:
        experts.counts.zero_()
    handles = [m.register_forward_pre_hook(make_hook(k)) for k, m in watched.items()]
    float_out = []
    seen = 0
    try:
        for h in hidden:
            keep[0] = seen < loss_n
            y = _layer_forward(layer, h, kw)
            if seen < loss_n:
                float_out.append(y[: loss_n - seen])
            seen += h.shape[0]
    finally:
        for hd in handles:
            hd.remove()
    counts = experts.counts.tolist() if experts is not None else None
    cold = _cold(counts, ctx)
    x_loss = {}
    for k, v in stored.items():
        if not v:
            x_loss[k] = torch.zeros(0, watched[k].in_features if k in linears else hidden[0].shape[-1], device=dev)
        elif v[0].ndim == 2:  # routed tokens of one expert
            x_loss[k] = torch.cat(v)[: loss_n * hidden[0].shape[1]]
        else:
            x_loss[k] = torch.cat(v)[:loss_n]
    x_mean = {k: (s / max(n_rows[k], 1)) if s is not None else None for k, s in abs_sum.items()}
    originals = {rel: m.weight.detach().clone() for rel, m in linears.items()}
    col_scale: dict[str, torch.Tensor] = {}
    row_scale: dict[str, torch.Tensor] = {}
    ratios = {}
    phases["observe"], tp = time.perf_counter() - tp, time.perf_counter()

    # 2. AWQ scale search, one scaling group at a time
    for group in groups:
        prev = get_module(layer, group.prev_op)
        lins = [linears[r] for r in group.linears]
        quantized = [prefix + r in targets for r in group.linears]
        if not any(quantized):
            continue
        if group.requires_square:
            prev_out = prev.weight.shape[0]
            if any(m.in_features != prev_out for m in lins) or lins[0].weight.shape != prev.weight.shape:
                continue
        if expert_index(arch, group.prev_op) in cold:
            continue  # a cold expert's own group (up -> down): RTN fallback, no scaling
        key = group.inputs_at or group.linears[0]
        x = x_loss[key]
        if x.numel() == 0 or x_mean[key] is None:
            continue  # no token reached this group among the loss samples
        inspect = get_module(layer, group.inspect)
        ref_out = _inspect_forward(inspect, x, kw, group.inspect_is_attention)
        weights = [m.weight.detach().clone() for m in lins]

        def loss_fn(cands, lins=lins, weights=weights, quantized=quantized, inspect=inspect, x=x, ref=ref_out, g=group):
            for m, c, w, q in zip(lins, cands, weights, quantized):
                m.weight.data.copy_(c if q else w)
            try:
                out = _inspect_forward(inspect, x, kw, g.inspect_is_attention)
                return (out - ref).float().pow(2).mean()
            finally:
                for m, w in zip(lins, weights):
                    m.weight.data.copy_(w)

        shown = group.linears if len(group.linears) <= 4 else group.linears[:2] + (f"... ({len(group.linears)} linears)",)
        name = f"{prefix}{group.prev_op} -> {', '.join(shown)}"
        specs = [quantizer.schemes.get(prefix + r, quantizer.schemes[next(iter(quantizer.schemes))]) for r in group.linears]
        s, ratio, _ = search_scales(
            x_mean[key], weights, loss_fn, [b for b, _, _ in specs], [g for _, g, _ in specs],
            [y for _, _, y in specs], n_grid=opts.n_grid, duo_scaling=opts.duo_scaling, name=name,
        )
        ratios[group.prev_op] = ratio
        # fold: prev_op output /= s, consumers' (and routers') input channels *= s (float function unchanged)
        rows = _fold(prev, s, group.prev_rows, arch.norm_offset)
        if group.prev_op in linears:
            row_scale[group.prev_op] = rows
        for r, m in zip(group.linears, lins):
            m.weight.data.mul_(s)
            col_scale[r] = s
        for a in group.also_scale:
            get_module(layer, a).weight.data.mul_(s.to(get_module(layer, a).weight))
        for k in set(group.linears) | {key}:
            x_loss[k] = x_loss[k] / s

    # 3. clip search and quantization (cold experts: RTN, no clipping)
    phases["scale_search"], tp = time.perf_counter() - tp, time.perf_counter()
    errs = []
    for rel, lin in linears.items():
        name = prefix + rel
        if name not in targets:
            continue
        clip_max = None
        e = expert_index(arch, rel)
        xs = x_loss[rel].reshape(-1, lin.in_features)
        if opts.clip and rel not in arch.clip_skip and not (e is not None and e in cold) and xs.shape[0]:
            idx = torch.linspace(0, xs.shape[0] - 1, min(opts.clip_tokens, xs.shape[0])).long()
            bits, gs, sym = quantizer.schemes[name]
            clip_max = search_clip(lin.weight.detach(), xs[idx], bits, gs, sym, opts.clip_grid, opts.clip_max_shrink)
        ctx.result.modules[name], err = quantizer.quantize_linear(
            name, lin, clip_max, col_scale.get(rel), originals[rel], row_scale.get(rel)
        )
        errs.append(err)
    _record_moe(i, layer, ctx, counts)

    # 4. recompute this layer's outputs with the quantized weights -> next layer's inputs
    phases["clip_and_quantize"], tp = time.perf_counter() - tp, time.perf_counter()
    new_hidden = _recompute(i, layer, hidden, kw, ctx.observer)
    out_err = _out_error(torch.cat(new_hidden)[:loss_n], torch.cat(float_out))
    phases["recompute"] = time.perf_counter() - tp
    fig = _figures(i, quantizer.schemes, prefix, errs, out_err, 0.0, awq_ratios=ratios)
    fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig
