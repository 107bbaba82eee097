"""The sequential, layer-by-layer quantization driver.

Data flow (docs/architecture.md): capture the inputs of decoder layer 0 once; for each layer, run
the recipe's algorithm -- a registered per-layer handler (:mod:`compressor.quant.algorithms`:
RTN, AWQ, GPTQ, or ``none``) that observes the layer's inputs and quantizes its linears --,
then recompute the layer's outputs *with the quantized weights* (the KV observers run on
that pass) and feed them to the next layer. Without a calibration pass (RTN, no static KV
scales) the same loop quantizes each layer where it lies. Only one layer is on the compute
device at a time; the model is modified in place (its linears end up holding the dequantized
weights, its norms the AWQ-folded scales), so memory holds one float copy of the model plus
the packed integers -- never two float copies.

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

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from .arch import (ArchSpec, checkpoint_name, expert_index, find_module, get_arch, get_module, layer_fused_sets,
                   layer_linears, linear_weight, num_experts)
from .errors import InputError, QuantizationError
from .moe import unfuse_experts
from .moe_ranks import ExpertShare, divides
from .moe_schemes import check_expert_schemes
from .precision import calibration_matmuls, resolve_matmul_precision
from .quant.algorithms import Algorithm, get_algorithm
from .quant.head import head_hessian
from .quant.inplace_linalg import all_finite
from .quant.kv import check_layout, kv_observer, layer_scales, observed_absmax
from .quant.kv_rotation import apply_layer_search, resolve_kv_search, rotate_layer
from .quant.kv_search import layer_recorder, search_warnings
from .quant.layer import LayerContext, LinearQuantizer, QuantizedLinear, recompute_layer
from .quant.fp4_inputs import ACT, InputObserver, observed_inputs
from .quant.fp8 import kernel_warnings
from .quant.primitives import Scheme
from .recipe import Recipe, resolve_group_size
from .recipe_mixed import by_pair, module_recipe
from .recipe_schemes import observes_inputs
from .gc_policy import frozen_gc
from .layer_inputs import capture_layer_inputs
from .layer_figures import first_rows, layer_figures, out_error
from .sample_ranks import Samples, division_warnings

__all__ = ["LayerHooks", "QuantizeResult", "QuantizedLinear", "check_finite", "check_patterns",
           "quantize_model", "resolve_schemes", "target_modules", "check_group_sizes"]


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
    seconds: float = 0.0  #: wall seconds of the run (a resumed run adds the finished layers' own seconds)
    #: static KV-cache scales: layer index -> (k_scale, v_scale) in the storage dtype
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: things the user should know (patterns matching nothing, damping raised, ...)
    warnings: list[str] = field(default_factory=list)
    #: observed post-RoPE absmax per layer: (k [kv_heads], v [kv_heads]) (MLA: latent, RoPE key)
    kv_absmax: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kv_scale_search: str = "absmax"  #: or ``attention``: kv_absmax holds absmax x the searched multiplier
    kv_key_rotation: str = "none"  #: or ``pairs``: q_proj/k_proj rows changed per RoPE pair (kv_rotation)
    #: per MoE layer: {"layer", "experts", "expert_tokens" (routed (token, slot) pairs per
    #: expert in the calibration pass, None without one), "below_min_tokens"}
    moe: list[dict] = field(default_factory=list)
    #: experts quantized with the RTN fallback: {"layer", "expert", "tokens", "modules", "method", "reason"}
    moe_fallback: list[dict] = field(default_factory=list)
    head_hessian: torch.Tensor | None = None  #: the head inputs' GPTQ Hessian (recipe head:, with a calibration pass)
    workers: list = field(default_factory=list)  #: ``--workers`` processes' reads and peak RSS (compressor.data_free)
    samples: dict | None = None  #: several ranks: this rank's share of the batches (compressor.sample_ranks.Samples)


@dataclass
class LayerHooks:
    """Streaming and resume around the per-layer loop (see :mod:`compressor.source.lazy`).

    ``load(i, layer)`` materializes decoder layer ``i`` before it is processed;
    ``done(i, layer, result, hidden)`` runs after it (``hidden``: the next layer's input
    activations, ``None`` without a calibration pass): it writes the layer's tensors,
    records a resume checkpoint and releases the weights. Layers ``< start`` were done by
    an interrupted run: they are skipped, ``hidden`` holds the inputs of layer ``start``
    and ``kv_absmax`` the KV statistics already observed. Activations above
    ``activation_budget`` bytes move to memory-mapped files in ``spill_dir``. Optional:
    ``expert_groups(i)`` (``None`` or the layer's tensor names in bounded groups) and
    ``load_groups(i, result, groups)`` (reads, yields and writes those groups), used instead of
    ``load`` for uncalibrated steps that quantize each linear on its own and, with a calibration
    pass, for handlers that quantize each routed expert from its own tokens
    (:mod:`compressor.moe_stream`), and
    ``release_outer()``, called once layer 0's inputs are captured (see
    :class:`compressor.staging.LayerWriter`).
    """

    load: Callable[[int, torch.nn.Module], None]
    done: Callable[[int, torch.nn.Module, "QuantizeResult", list | None], None]
    start: int = 0
    hidden: list | None = None
    #: the float model's activations beside ``hidden`` (GPTQ's float target), restored and checkpointed alike
    float_hidden: list | None = None
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
                    raise InputError(f"recipe {where}: {p} names the MoE router {hit}; routers stay in float "
                                     "(vLLM builds them unquantized): drop the pattern")
                raise InputError(f"recipe {where}: {p} matches no decoder linear ({hint}; lm_head and embeddings stay float)")
    return [f"recipe ignore entry {p} matches no decoder linear" for p in recipe.ignore if not any(matches([p], n) for n in names)]


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


def _group_sizes(recipe: Recipe, targets: dict[str, torch.nn.Linear]) -> dict[str, Scheme]:
    """Module name -> :class:`Scheme` of its ``(weights, activations)`` pair, group sizes resolved per pair
    (InputError: a size that does not fit, a refused pair: :func:`compressor.recipe_mixed.by_pair`)."""
    out = {}
    for w, a, in_features in by_pair(recipe, {name: mod.in_features for name, mod in targets.items()}):
        module = module_recipe(recipe, w, a)
        # FP8 blocks at a matrix's edge are partial (as compressed-tensors pads): no width needs to divide
        resolved = w.group_size if w.block_structure else resolve_group_size(module, in_features)
        out.update({name: Scheme(w.num_bits, resolved, w.symmetric, *float_scheme_fields(module))
                    for name in in_features})
    return out


def float_scheme_fields(recipe: Recipe) -> tuple:
    """``(type, rows, act)`` of :class:`~compressor.quant.primitives.Scheme` for the recipe's weights:
    ``()`` (the defaults) for integer weight-only, ``("int", 1, "fp8-token")`` for integer weights with
    fp8 inputs (W4A8), ``("float", rows, "fp8-token" | "fp8-group" | "nvfp4")`` for FP8 and FP4 (W4A4)."""
    w, a = recipe.weights, recipe.activations
    act = ("" if a is None or not get_algorithm(recipe.algorithm).quantizes_weights else
           ACT if a.num_bits == 4 else f"fp8-{a.strategy}")  # NVFP4 activations (W4A4), fp8 ones
    if w.type != "float":
        return ("int", 1, act) if act else ()
    return ("float", w.block_structure[0] if w.block_structure else 1, act)  # NVFP4: ("float", 1, "")


def check_group_sizes(model, recipe: Recipe) -> None:
    """The group-size refusal of :func:`resolve_schemes`, run before calibration: the shapes
    are known once the model is built, on the meta device too (``kvq quantize`` runs it on the
    model built from the configuration alone, before loading it). Routed experts still fused
    into 3-D parameters are checked by their slices (:func:`compressor.arch.linear_weight`).

    Raises:
        InputError: a group size does not divide some targeted module's in_features; a MoE layer's routed
            experts get several schemes (:func:`compressor.moe_schemes.check_expert_schemes`).
    """
    if not get_algorithm(recipe.algorithm).quantizes_weights:
        return
    arch = get_arch(model.config.model_type)
    targets = {}
    for i, layer in enumerate(get_module(model, arch.layers)):
        for rel in layer_linears(arch, layer):
            name = f"{arch.layers}.{i}.{rel}"
            if recipe.is_ignored(name):
                continue
            mod = find_module(layer, rel)
            if isinstance(mod, torch.nn.Linear):
                targets[name] = mod
            elif mod is None:  # an expert of fused experts: its [out, in] slice
                targets[name] = SimpleNamespace(in_features=linear_weight(arch, layer, rel).shape[1])
    check_expert_schemes(model, arch, _group_sizes(recipe, targets))


def resolve_schemes(recipe: Recipe, targets: dict[str, torch.nn.Linear], arch: ArchSpec,
                    model=None) -> dict[str, Scheme]:
    """Module name -> :class:`~compressor.quant.primitives.Scheme` with ``auto`` group sizes resolved.

    Modules that share a recipe scheme share one resolved group size.

    Raises:
        InputError: a group size does not fit; linears vLLM fuses (q/k/v, gate/up) were given different
            schemes or were only partly ignored; a MoE layer's routed experts several (:mod:`compressor.moe_schemes`).
    """
    out = check_expert_schemes(model, arch, _group_sizes(recipe, targets))
    layers = get_module(model, arch.layers) if model is not None else None
    for i in _layer_indices(targets, arch):
        fused_sets = layer_fused_sets(arch, layers[i]) if layers is not None else arch.fused
        for fused in fused_sets:
            names = [f"{arch.layers}.{i}.{rel}" for rel in fused]
            present = [n for n in names if n in out]
            if present and len(present) != len(names):
                raise InputError(f"{', '.join(names)} are fused into one kernel by vLLM: quantize all of them or none "
                                 f"(only {', '.join(p.rsplit('.', 1)[-1] for p in present)} targeted)")
            if len({out[n] for n in present}) > 1:
                raise InputError(f"{', '.join(names)} are fused into one kernel by vLLM and must share one weight scheme; "
                                 "adjust the recipe's overrides")
    return out


def _layer_indices(targets: dict[str, torch.nn.Module], arch: ArchSpec) -> list[int]:
    """Sorted decoder-layer indices that hold at least one target."""
    prefix = arch.layers + "."
    return sorted({int(n[len(prefix):].split(".", 1)[0]) for n in targets})


def check_finite(model) -> None:
    """Raise :class:`InputError` naming the first parameter holding NaN or Inf."""
    for name, p in model.named_parameters():
        if not p.is_meta and not all_finite(p.detach()):  # meta: not loaded yet (streaming checks on load)
            raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")

@dataclass
class _Plan:
    """What the checks before the layer loop settled."""

    arch: ArchSpec
    algorithm: Algorithm
    kv: object  # the KV scheme's spec, or None
    layout: object  # the attention's KV layout, or None
    targets: dict
    schemes: dict
    group_size: int | None
    observe_kv: bool
    warnings: list


def _plan(model, recipe: Recipe, calib_ids) -> _Plan:
    """Every refusal before the expensive work; unfuses MoE experts in place."""
    arch = get_arch(model.config.model_type)
    algorithm = get_algorithm(recipe.algorithm)
    kv = recipe.kv_cache.spec() if recipe.kv_cache is not None else None
    layout = arch.kv_layout(model.config) if kv is not None else None
    if kv is not None:
        check_layout(kv, layout)
        resolve_kv_search(recipe.kv_cache, layout, model.config)  # refuses a search or rotation that cannot apply
    quantize_weights = algorithm.quantizes_weights
    if not quantize_weights and kv is None:
        raise InputError("the recipe quantizes nothing: algorithm none and no kv_cache scheme")
    unfuse_experts(model, arch)
    pattern_warnings = check_patterns(model, recipe, arch) if quantize_weights else []
    targets = target_modules(model, recipe, arch) if quantize_weights else {}
    if quantize_weights and not targets:
        raise InputError("the recipe's targets/ignore lists exclude every linear module; nothing to quantize")
    schemes = resolve_schemes(recipe, targets, arch, model)
    pattern_warnings += _kernel_warnings(schemes, targets, arch, model)
    base = [s for n, s in schemes.items() if not recipe.overrides or recipe.scheme_for(n) == recipe.weights]
    gs = (base[0][1] if base else next(iter(schemes.values()))[1]) if schemes else None
    check_finite(model)
    observe_kv = kv is not None and kv.static
    if (algorithm.needs_calibration or observe_kv or observes_inputs(recipe)) and calib_ids is None:
        what = (recipe.algorithm.upper() if algorithm.needs_calibration else f"static KV-cache scales ({kv.describe()})"
                if observe_kv else "NVFP4 activations (W4A4: each linear's input_global_scale)")
        raise InputError(f"{what} needs calibration data (--calib)")
    return _Plan(arch, algorithm, kv, layout, targets, schemes, gs, observe_kv, pattern_warnings)


def _kernel_warnings(schemes: dict, targets: dict, arch: ArchSpec, model) -> list[str]:
    """The warnings naming the linears vLLM's FP8 block or W4A8 kernels refuse
    (:func:`compressor.quant.fp8.kernel_warnings`)."""
    if not any(s.act for s in schemes.values()):
        return []
    layers = get_module(model, arch.layers)
    fused = [[(n, targets[n].out_features) for n in (f"{arch.layers}.{i}.{r}" for r in fs) if n in targets]
             for i in _layer_indices(targets, arch) for fs in layer_fused_sets(arch, layers[i])]
    return kernel_warnings(schemes, {n: (m.out_features, m.in_features) for n, m in targets.items()}, fused)


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
    matmul_precision: str = "auto",
) -> QuantizeResult:
    """Quantize ``model`` in place according to ``recipe`` (its registered algorithm:
    :mod:`compressor.quant.algorithms`).

    Args:
        model: a float decoder-only causal LM whose ``config.model_type`` is in the
            architecture table. Fused MoE experts are unfused in place into per-expert
            ``nn.Linear`` modules (:func:`compressor.moe.unfuse_experts`) and stay so.
        recipe: the effective recipe.
        calib_ids: int64 ``[n_samples, seqlen]`` calibration tokens (required for AWQ, GPTQ, static
            KV scales and NVFP4 activations; else ignored).
        device: ``cpu`` or ``cuda``: where each layer is processed.
        dtype: storage dtype of scales in the artifact (the in-memory model stays float32).
        on_layer: progress callback ``(layer_index, n_layers, layer_figures)``.
        hooks: per-layer load/write/release and resume state (:class:`LayerHooks`); with
            them the decoder layers may start on the ``meta`` device.
        matmul_precision: ``auto``, ``float32`` or ``bfloat16``: the CPU matmuls of the calibration
            pass (:func:`compressor.precision.calibration_matmuls`; GPTQ's solve stays float32);
            ``auto`` as ``kvq quantize`` resolves it (:func:`compressor.precision.resolve_matmul_precision`).

    Raises:
        InputError: unsupported architecture, group size that does not fit, non-finite
            source weights, missing calibration, fused linears with different schemes, a
            KV scheme the attention layout cannot hold (per-head scales on MLA), ``bfloat16``
            matmuls asked for on CUDA.
        QuantizationError: a non-finite scale or weight was produced (names the module).
    """
    t0 = time.perf_counter()
    plan = _plan(model, recipe, calib_ids)
    result = QuantizeResult(group_size=plan.group_size, warnings=plan.warnings)
    if hooks is not None:  # a resumed run: the finished layers' figures, and their seconds in result.seconds
        t0 -= sum(f.get("seconds", 0.0) for f in hooks.layers)
        result.layers.extend(hooks.layers)
        result.moe.extend(hooks.moe)
        result.moe_fallback.extend(hooks.moe_fallback)
        result.kv_absmax.update(getattr(hooks, "kv_absmax", {}))  # checkpointed again with the new layers'
    layers = get_module(model, plan.arch.layers)
    observer = kv_observer(len(layers)) if plan.observe_kv else None
    ctx = LayerContext(plan.arch, recipe, LinearQuantizer(plan.schemes, dtype), plan.targets, result.modules, observer,
                       min(recipe.awq.loss_samples, len(calib_ids) if calib_ids is not None else 1),
                       getattr(hooks, "memory_budget", None), getattr(hooks, "activation_budget", None))
    ctx.input_observer = InputObserver() if observes_inputs(recipe) else None  # W4A4: input_global_scale
    if hooks is not None and getattr(hooks, "activation_budget", None) is not None:
        ctx.spill = lambda tensors, tag: _spill(tensors, hooks, tag)
    if plan.observe_kv:
        ctx.kv_scale_search, ctx.kv_key_rotation = result.kv_scale_search, result.kv_key_rotation = \
            resolve_kv_search(recipe.kv_cache, plan.layout, model.config)
    with calibration_matmuls(resolve_matmul_precision(matmul_precision, device)):
        _layer_loop(model, layers, ctx, plan.algorithm, result, calib_ids, batch_size, device, on_layer, hooks)
    result.warnings += plan.algorithm.run_warnings(result.layers) + search_warnings(result.layers, recipe.kv_cache)
    if result.moe_fallback:
        n_layers_fb = len({f["layer"] for f in result.moe_fallback})
        result.warnings.append(
            f"{len(result.moe_fallback)} expert(s) in {n_layers_fb} MoE layer(s) were routed fewer than "
            f"{max(recipe.moe.min_tokens, 1)} calibration tokens and were quantized with RTN; see quality.moe.fallback"
        )
    if observer is not None:
        result.kv_absmax = observed_absmax(observer)
        missing = [i for i in range(len(layers)) if i not in result.kv_absmax]
        if missing:  # a static KV scheme without a layer's scales: serving engines would read 1.0 there
            raise QuantizationError(f"no KV-cache statistics for layer(s) {', '.join(map(str, missing[:8]))}"
                                    f"{' ...' if len(missing) > 8 else ''} of {len(layers)}; nothing was written")
        for i, (k, v) in result.kv_absmax.items():
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise QuantizationError(f"KV-cache statistics of layer {i} are not finite; nothing was written")
            ks, vs = layer_scales(k, v, plan.kv, plan.layout)
            result.kv_scales[i] = (ks.to(dtype), vs.to(dtype))
    result.seconds = time.perf_counter() - t0
    return result


def _layer_loop(model, layers, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult, calib_ids,
                batch_size: int, device: str, on_layer, hooks: LayerHooks | None) -> None:
    """The per-layer loop. With a calibration pass (the algorithm needs one, or static KV
    scales are observed) layer 0's inputs are captured first and each layer runs on
    ``device`` and is recomputed; otherwise each layer is quantized where it lies."""
    arch, observer = ctx.arch, ctx.observer
    n_layers = len(layers)
    start = hooks.start if hooks is not None else 0
    hidden = layer_kwargs = samples = None
    if algorithm.needs_calibration or observer is not None or ctx.input_observer is not None:
        resumed, ckpt = hooks is not None and hooks.hidden is not None, getattr(hooks, "ckpt", None)
        hidden, layer_kwargs = capture_layer_inputs(model, arch, calib_ids, batch_size, device, resumed, ckpt)
        if resumed:
            hidden, hooks.hidden = hooks.hidden, None  # taken: the loop's copy is the only one kept
            ctx.float_hidden, hooks.float_hidden = hooks.float_hidden, None  # GPTQ's float target (or None)
            for i, (k, v) in hooks.kv_absmax.items():
                if observer is not None:
                    observer.layers[i].k_absmax, observer.layers[i].v_absmax = k, v
        samples = Samples.of(hidden) if algorithm.divides_samples(ctx) else None  # several ranks: batches divided
        result.warnings += division_warnings(hidden, ctx, algorithm, samples)
        hidden = samples.own(hidden) if samples is not None else hidden
        ctx.float_hidden = samples.own(ctx.float_hidden) if samples is not None else ctx.float_hidden
        hidden = _spill(hidden, hooks, "in")  # layer 0's inputs too: above the budget one copy stays in memory
    # the objects alive now (modules, transformers' and torch's own) outlive the loop: frozen, the
    # garbage collection before each heap trim skips them (0.29 s a layer on SmolLM2; 0.4 s for the
    # release of the embedding and head). Tensors released later are still freed (by their count).
    with frozen_gc():
        if hooks is not None and getattr(hooks, "release_outer", None) is not None:
            hooks.release_outer()  # the embedding and head are not read again before the write
        for i, layer in enumerate(layers):
            if i < start:
                continue
            t1 = time.perf_counter()
            groups = (hooks.expert_groups(i, divides(algorithm)) if hooks is not None
                      and getattr(hooks, "expert_groups", None) is not None
                      and (algorithm.per_linear if hidden is None else algorithm.streams_experts) else None)
            divided = samples is not None and samples.divides(layer, ctx, algorithm, groups is not None)
            if samples is not None and not divided:  # this layer reads every batch (compressor.sample_ranks)
                hidden = samples.whole(hidden, ctx)
            ctx.samples = samples if divided else None
            if divided:
                samples.layers_divided += 1
            if groups is not None and hidden is None:
                fig = _quantize_layer_grouped(i, layer, ctx, algorithm, result, hooks, groups)
            elif groups is not None:
                hidden, fig = _quantize_streamed_moe(i, layer, hidden, layer_kwargs[i], ctx, algorithm, result, hooks,
                                                     groups, device)
                hidden = _spill(hidden, hooks, f"{i % 2}")
            elif hidden is None:
                if hooks is not None:
                    hooks.load(i, layer)
                fig = _quantize_layer(i, layer, ctx, algorithm, result)
            else:
                if hooks is not None:
                    hooks.load(i, layer)
                layer.to(device)
                hidden, fig = _quantize_and_recompute(i, layer, hidden, layer_kwargs[i], ctx, algorithm, result)
                layer.to("cpu")
                hidden = _spill(hidden, hooks, f"{i % 2}")
            if samples is not None and not divided:
                hidden = samples.split(hidden, ctx)
            ctx.samples = None
            fig["seconds"] = round(time.perf_counter() - t1, 3)
            result.layers.append(fig)
            if observer is not None and observer.layers[i].k_absmax is not None:
                result.kv_absmax[i] = (observer.layers[i].k_absmax, observer.layers[i].v_absmax)
            if hooks is not None:  # checkpointed by rank 0 with every batch, GPTQ's float target beside them
                to0 = samples.gather if samples is not None else lambda h, dst: h
                hooks.float_hidden = to0(ctx.float_hidden, dst=0)
                hooks.done(i, layer, result, to0(hidden, dst=0))
                hooks.float_hidden = None
            if on_layer:
                on_layer(i, n_layers, fig)
    result.samples = samples.figures() if samples is not None else None
    if hidden is not None and ctx.recipe.head is not None:  # the last layer's outputs feed the head (quant.head)
        result.head_hessian = head_hessian(model, arch, samples.gather(hidden) if samples is not None else hidden)


def _spill(hidden, hooks: LayerHooks | None, tag: str):
    """``hidden`` moved to memory-mapped files when it exceeds the hooks' activation budget."""
    if hooks is None or hooks.activation_budget is None:
        return hidden
    from .activations import spill

    return spill(hidden, hooks.spill_dir, tag, hooks.activation_budget)


def _quantize_layer(i, layer, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult) -> dict:
    """Layer ``i`` without a calibration pass (RTN, or float weights with dynamic KV scales)."""
    outcome = algorithm.quantize_layer(i, layer, None, None, ctx)
    _record_moe(i, layer, ctx, algorithm, result, None)
    return layer_figures(i, ctx.quantizer.schemes, f"{ctx.arch.layers}.{i}.", outcome.errs, None, 0.0)


def _quantize_layer_grouped(i, layer, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult, hooks,
                            groups: list[list[str]]) -> dict:
    """Layer ``i`` without a calibration pass, read in bounded groups of routed experts
    (``hooks.load_groups``; each group is written and released before the next is read), for
    handlers whose linears are quantized independently (``per_linear``: RTN, ``none``)."""
    errs: list[float] = []
    parts: list[list[float]] = []  # each expert group's errors (several ranks: this rank's groups)
    for k, modules in enumerate(hooks.load_groups(i, result, groups)):
        sub = dataclasses.replace(ctx, targets={n: ctx.targets[n] for n in modules if n in ctx.targets})
        (parts.append if k else errs.extend)(algorithm.quantize_layer(i, layer, None, None, sub).errs)
    parts, _, n_groups = ExpertShare.of(algorithm, num_experts(ctx.arch, layer)).merge(parts, 0.0, len(groups) - 1)
    _record_moe(i, layer, ctx, algorithm, result, None)
    return layer_figures(i, ctx.quantizer.schemes, f"{ctx.arch.layers}.{i}.", errs + [e for p in parts for e in p],
                         None, 0.0, weight_groups=1 + n_groups)


def _quantize_streamed_moe(i, layer, hidden, kw, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult,
                           hooks, groups: list[list[str]], device: str):
    """Layer ``i`` inside the calibration pass, its routed experts read in groups
    (:mod:`compressor.moe_stream`): the non-expert tensors are read and held, the step and the
    recompute run with the experts' module answered by a tap. Returns ``(new_hidden, figures)``."""
    from .moe_stream import ExpertTap, move_loaded, quantize_layer_streamed

    loads = hooks.load_groups(i, result, groups)
    next(loads)  # the non-expert tensors
    move_loaded(layer, device)
    tap = ExpertTap(ctx.experts(layer))
    with tap.active():
        if algorithm.folds_input_scales:  # AWQ's scale spans every expert: two more reads (moe_stream_awq)
            from .moe_stream_awq import quantize_layer_streamed_awq

            step = lambda i, layer, hidden, kw, ctx: quantize_layer_streamed_awq(  # noqa: E731
                i, layer, hidden, kw, ctx, algorithm, loads, tap, device, hooks.read_groups, hooks.rebalance)
        else:
            step = lambda i, layer, hidden, kw, ctx: quantize_layer_streamed(  # noqa: E731
                i, layer, hidden, kw, ctx, algorithm, loads, tap, device, hooks.rebalance)
        out = _quantize_and_recompute(i, layer, hidden, kw, ctx, algorithm, result, step)
    move_loaded(layer, "cpu")
    return out


def _quantize_and_recompute(i, layer, hidden, kw, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult,
                            step=None):
    """Layer ``i`` inside the calibration pass: the algorithm's step (``step``, when given, in its
    place: same call), then the layer's outputs recomputed with its quantized weights (the next
    layer's inputs; the KV observers run here). Returns ``(new_hidden, figures)``."""
    rotation = rotate_layer(i, layer, hidden, kw, ctx)  # kv_cache.key_rotation: pairs (float rows turned)
    outcome = (step or algorithm.quantize_layer)(i, layer, hidden, kw, ctx)
    experts = ctx.experts(layer)
    counts = outcome.counts
    recount = experts is not None and counts is None  # the step did not count routing: count it on the recompute
    if recount:
        experts.counts.zero_()
    tp = time.perf_counter()
    peak: list = []
    # the KV observers must see the attention run: no replay with them
    recorder = layer_recorder(layer, ctx)  # kv_cache.scale_search: attention (several ranks: rank 0's first batch)
    recorder = recorder if ctx.samples is None or ctx.samples.rank == 0 else None
    replay = outcome.replay if ctx.observer is None and ctx.input_observer is None else None  # observers see it run
    with recorder.active() if recorder is not None else nullcontext(), observed_inputs(i, layer, ctx):
        new_hidden = recompute_layer(i, layer, hidden, kw, ctx.observer, peak, replay)
    outcome.replay = None
    peak[0] = max(peak[0], outcome.linear_peak)
    search = lambda: apply_layer_search(i, recorder, ctx, rotation) if recorder is not None else {}  # noqa: E731
    if ctx.samples is not None:  # this rank's batches: the maxima over every rank's, rank 0's search
        kv_multipliers = ctx.samples.reduce_layer(i, peak, ctx.observer, search, ctx.kv_scale_search == "attention")
    else:
        kv_multipliers = search()
    counts = experts.counts.tolist() if recount else counts
    _record_moe(i, layer, ctx, algorithm, result, counts)
    out_err = None
    if outcome.float_out is not None:
        out_err = out_error(first_rows(new_hidden, outcome.float_out.shape[0]), outcome.float_out)
    fig = layer_figures(i, ctx.quantizer.schemes, f"{ctx.arch.layers}.{i}.", outcome.errs, out_err, 0.0,
                        **outcome.figures)
    if out_err is not None:  # how many calibration sequences the figure compares (GPTQ: 2; AWQ: awq.loss_samples)
        fig["output_error_sequences"] = int(outcome.float_out.shape[0])
    fig["max_abs_activation"] = float(f"{peak[0]:.6g}")
    fig.update({"kv_scale_multipliers": kv_multipliers} if kv_multipliers else {})
    if outcome.phases is not None:
        phases = {**outcome.phases, "recompute": time.perf_counter() - tp}
        fig["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    return new_hidden, fig


def _record_moe(i, layer, ctx: LayerContext, algorithm: Algorithm, result: QuantizeResult, counts: list[int] | None) -> None:
    """Per-layer routing figures (and the RTN fallbacks they caused) for the manifest.

    Algorithms that need calibration quantize experts with too few routed tokens with RTN;
    those experts are listed in ``result.moe_fallback``."""
    n = num_experts(ctx.arch, layer)
    if not n:
        return
    cold = sorted(ctx.cold(counts))
    result.moe.append({"layer": i, "experts": n, "expert_tokens": counts, "below_min_tokens": cold})
    prefix = f"{ctx.arch.layers}.{i}."
    limit = max(ctx.recipe.moe.min_tokens, 1)
    for e in cold if algorithm.needs_calibration else []:
        mods = [checkpoint_name(ctx.arch, prefix + r) for r in layer_linears(ctx.arch, layer)
                if expert_index(ctx.arch, r) == e and prefix + r in ctx.targets]
        if mods:
            result.moe_fallback.append({
                "layer": i, "expert": e, "tokens": counts[e], "modules": mods, "method": "rtn",
                "reason": f"{counts[e]} routed calibration tokens < moe.min_tokens {limit}"})
