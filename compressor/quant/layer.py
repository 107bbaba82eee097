"""What a per-layer algorithm step works with (:mod:`compressor.quant.algorithms`).

The sequential driver (:mod:`compressor.pipeline`) hands each registered algorithm one
decoder layer at a time together with a :class:`LayerContext`; the step quantizes the
layer's targeted linears in place through :class:`LinearQuantizer` (which stores a
:class:`QuantizedLinear` per module and writes the dequantized weight back) and returns
a :class:`LayerOutcome`. The driver then recomputes the layer's outputs, runs the KV
observers and turns the outcome into the layer's figures.

Shapes: hidden states ``[b, T, H]`` float32; a linear's weight ``[out, in]``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..arch import ArchSpec
from ..errors import QuantizationError
from ..moe import UnfusedExperts, cold_experts, routed_experts
from ..recipe import Recipe
from .inplace_linalg import all_finite
from .kv import cache_kwarg
from . import fp4, mxfp4
from .fp8 import dequantize_weight as dequantize_fp8_weight, quantize_weight as quantize_fp8_weight
from .primitives import Scheme, abs_max, check_scale_range, clip_groups, dequantize
from .rtn import rtn_linear_inplace, rtn_quantize


#: the largest difference buffer :class:`LinearQuantizer` keeps between linears for the fused RTN
#: (:func:`compressor.quant.rtn.rtn_linear_inplace`): a routed expert of Kimi K2 (2,048 x 7,168 float32) fits
SCRATCH_BYTES = 64 * 2**20


@dataclass
class QuantizedLinear:
    """One quantized Linear in the internal (compressed-tensors, signed) convention.

    ``q`` int8 ``[out, in]``; ``scale`` ``[out, G]`` in the storage dtype; ``zero_point``
    int8 ``[out, G]`` or ``None`` (symmetric); ``g_idx`` int32 ``[in]`` or ``None`` (groups
    are contiguous, ``c // group_size``). FP8 (``type "float"``): ``q`` float8_e4m3fn
    ``[out, in]``, ``scale`` float32 ``[ceil(out / rows), G]`` (:mod:`compressor.quant.fp8`),
    ``act`` the input's dynamic quantization. NVFP4 (:mod:`compressor.quant.fp4`): ``q`` uint8 e2m1 codes
    ``[out, in]``, ``scale`` float8_e4m3fn ``[out, in / 16]``, ``global_scale`` float32 ``[1]``. MXFP4
    (:mod:`compressor.quant.mxfp4`): ``q`` uint8 e2m1 codes ``[out, in]``, ``scale`` uint8 biased E8M0
    exponents ``[out, in / 32]``, no global scale. Format writers (``compressor.formats``) pack it.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: Scheme
    global_scale: torch.Tensor | None = None
    #: NVFP4 activations (W4A4): float32 ``[1]`` from the calibration inputs' absmax (:mod:`.fp4_inputs`)
    input_global_scale: torch.Tensor | None = None

    def __getattr__(self, name: str):
        """``num_bits``, ``group_size``, ``symmetric``, ``type``, ``rows``, ``act``: the scheme's."""
        if name.startswith("__") or name == "scheme":
            raise AttributeError(name)
        return getattr(self.scheme, name)


def stored_dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int,
                      dtype: torch.dtype, name: str, g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales as the artifact stores them and the weight loaders dequantize from them.

    ``scale [out, G]`` is checked against ``dtype``'s range and rounded to it; ``q [out, in]``
    is dequantized with the rounded scales (``zero_point`` ``None`` when symmetric).
    Returns ``(scale in dtype, float32 [out, in])``.

    Raises:
        InputError: a scale ``dtype`` cannot hold (float16 above 65,504; names the module).
        QuantizationError: a non-finite scale or dequantized weight (names the module).
    """
    check_scale_range(scale.float(), dtype, name)
    scale = scale.to(dtype)
    deq = dequantize(q, scale, zero_point, group_size, dtype=torch.float32, g_idx=g_idx)
    if not (torch.isfinite(scale.float()).all() and all_finite(deq)):
        raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
    return scale, deq


class LinearQuantizer:
    """Per-module schemes plus the storage dtype; turns a Linear into a :class:`QuantizedLinear`.

    ``schemes``: full module name -> :class:`~compressor.quant.primitives.Scheme` (group sizes
    resolved); ``dtype``: the storage dtype of integer scales in the artifact (FP8 scales are float32).
    """

    def __init__(self, schemes: dict[str, Scheme], dtype: torch.dtype):
        self.schemes, self.dtype = schemes, dtype
        self._scratch: torch.Tensor | None = None  # the fused RTN's difference buffer, reused (SCRATCH_BYTES at most)
        #: NVFP4: module name -> the absmax its global scale is taken from (shared by a fused set)
        self.fp4_absmax: dict[str, float] = {}

    def share_fp4_absmax(self, linears: dict) -> None:
        """Record one absmax for a set of NVFP4 linears vLLM fuses (``name -> Linear``, still float): the
        largest of their weights', so they share one global scale (:mod:`compressor.quant.fp4`). A set
        one of whose members already has an absmax is left as it is (it was recorded with the set)."""
        if not linears or any(n in self.fp4_absmax for n in linears):
            return
        amax = max(float(lin.weight.detach().abs().max()) for lin in linears.values())
        self.fp4_absmax.update({n: amax for n in linears})

    def _scratch_for(self, w: torch.Tensor) -> torch.Tensor | None:
        """A float32 buffer of ``w.numel()`` values or more on ``w``'s device, kept for the next linear when
        it holds :data:`SCRATCH_BYTES` or less (a routed expert's weight); ``None`` for a larger weight."""
        if w.numel() * 4 > SCRATCH_BYTES:
            return None
        s = self._scratch
        if s is None or s.numel() < w.numel() or s.device != w.device:
            s = self._scratch = torch.empty(w.numel(), dtype=torch.float32, device=w.device)
        return s

    def finish(self, name, lin, q, scale, zp, g_idx, col_scale=None, original=None, row_scale=None):
        """Store ``(q, scale, zp, g_idx)``, write the dequantized weight into ``lin``; returns (record, rel. error).

        ``col_scale [in]`` / ``row_scale [out]``: AWQ scales folded into this linear's input
        columns / output rows, undone for the error (measured against ``original``, the
        weight before folding, or the linear's current weight).

        Raises:
            QuantizationError: a non-finite scale or dequantized weight (names the module).
        """
        folds = (col_scale, original, row_scale)
        if self.schemes[name].is_fp4:  # GPTQ on the e2m1 grid (e2m1_grid): zp holds the global scale per row
            return self.finish_fp4(name, lin, q.to(torch.uint8), scale, zp[:1].float(), folds)
        if self.schemes[name].is_mxfp4:
            return self.finish_mxfp4(name, lin, q.to(torch.uint8), scale, folds)
        bits, gs, sym = self.schemes[name][:3]
        scale, deq = stored_dequantize(q, scale, None if sym else zp, gs, self.dtype, name, g_idx)
        rel = _folded_error(deq, lin, *folds)
        lin.weight.data.copy_(deq.to(lin.weight.dtype))
        record = QuantizedLinear(
            q=q.cpu(), scale=scale.cpu().contiguous(), zero_point=None if sym else zp.cpu(),
            g_idx=None if g_idx is None else g_idx.cpu().to(torch.int32), scheme=Scheme(*self.schemes[name]),
        )
        return record, rel

    def e2m1_grid(self, name: str, w: torch.Tensor) -> tuple | None:
        """For an NVFP4 or MXFP4 linear ``name`` whose weight (or rows of it) GPTQ rounds, ``w [rows, in]``:
        ``(steps float32 [rows, G], stored scales [rows, G], per-row values [rows] float32)``, the last the NVFP4
        global scale repeated (MXFP4: zeros), so row slices join as the integer grid's zero points do and
        :meth:`finish` takes the codes; ``None`` for an integer scheme.

        Raises:
            InputError: a width that is not a multiple of the group (16, 32).
        """
        scheme = self.schemes[name]
        if scheme.is_fp4:
            steps, s, g = fp4.group_steps(w, self.fp4_absmax.get(name))
            return steps, s, g.float().expand(w.shape[0]).clone()
        if scheme.is_mxfp4:
            steps, e = mxfp4.group_steps(w)
            return steps, e, torch.zeros(w.shape[0])
        return None

    def quantize_linear(self, name, lin, clip_max=None, col_scale=None, original=None, row_scale=None):
        """Round-to-nearest (optionally clipped, ``clip_max [out, G]``) quantization of one Linear, in place."""
        scheme = self.schemes[name]
        if scheme.is_fp4 or scheme.is_mxfp4:  # AWQ's clip lowers a group's scale: the clipped weight, rounded
            w = lin.weight.detach()
            w = w if clip_max is None else clip_groups(w, clip_max, scheme.group_size)
            folds = (col_scale, original, row_scale)
            if scheme.is_fp4:
                return self.finish_fp4(name, lin, *fp4.quantize_weight(w, self.fp4_absmax.get(name)), folds)
            return self.finish_mxfp4(name, lin, *mxfp4.quantize_weight(w), folds)
        if scheme.is_float:
            return self.finish_float(name, lin, *quantize_fp8_weight(lin.weight.detach(), scheme.group_size,
                                                                     scheme.rows))
        bits, gs, sym = scheme[:3]
        w = lin.weight.detach()
        if clip_max is None and col_scale is None and original is None and row_scale is None \
                and w.dtype == torch.float32 and w.is_contiguous() and w.ndim == 2:
            # finish()'s values, fused
            q, scale, zp, rel = rtn_linear_inplace(w, bits, gs, sym, self.dtype, name, self._scratch_for(w))
            return QuantizedLinear(q=q.cpu(), scale=scale.cpu(), zero_point=None if sym else zp.cpu(), g_idx=None,
                                   scheme=Scheme(*scheme)), rel
        q, scale, zp = rtn_quantize(w, bits, gs, sym, clip_max)
        return self.finish(name, lin, q, scale, zp, None, col_scale, original, row_scale)

    def finish_fp4(self, name, lin, q, scale, g, folds=(None, None, None)):
        """Store NVFP4 ``(q uint8 [out, in], scale float8_e4m3fn [out, in/16], g float32 [1])``, write the
        dequantized weight into ``lin``; returns (record, relative error; ``folds``: :meth:`finish`'s ``(col_scale,
        original, row_scale)``).

        Raises:
            QuantizationError: a non-finite dequantized weight (names the module).
        """
        record = QuantizedLinear(q=q.cpu(), scale=scale.cpu().contiguous(), zero_point=None, g_idx=None,
                                 scheme=self.schemes[name], global_scale=g.cpu())
        return self._store_fp4(name, lin, fp4.dequantize_weight(q, scale, g), record, folds)

    def finish_mxfp4(self, name, lin, q, e, folds=(None, None, None)):
        """Store MXFP4 ``(q uint8 [out, in], e uint8 [out, in/32])`` (e2m1 codes, biased E8M0 exponents), write the
        dequantized weight into ``lin``; returns (record, relative error; ``folds`` as :meth:`finish_fp4`'s).

        Raises:
            QuantizationError: a non-finite dequantized weight (a non-finite input; names the module).
        """
        record = QuantizedLinear(q=q.cpu(), scale=e.cpu().contiguous(), zero_point=None, g_idx=None,
                                 scheme=self.schemes[name])
        return self._store_fp4(name, lin, mxfp4.dequantize_weight(q, e), record, folds)

    @staticmethod
    def _store_fp4(name, lin, deq: torch.Tensor, record: "QuantizedLinear", folds=(None, None, None)):
        """Write an e2m1 weight's dequantized ``deq [out, in]`` (float32) into ``lin``; returns ``(record, relative
        error)``, the error in the weights' space before AWQ's ``folds`` (:func:`_folded_error`).

        Raises:
            QuantizationError: ``deq`` has a NaN or Inf (names the module).
        """
        if not all_finite(deq):
            raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
        rel = _folded_error(deq, lin, *folds)
        lin.weight.data.copy_(deq.to(lin.weight.dtype))
        return record, rel

    def finish_float(self, name, lin, q, scale):
        """Store FP8 ``(q float8_e4m3fn [out, in], scale float32 [ceil(out/rows), G])``, write the
        dequantized weight into ``lin``; returns (record, relative error).

        Raises:
            QuantizationError: a non-finite scale or dequantized weight (names the module).
        """
        scheme = self.schemes[name]
        deq = dequantize_fp8_weight(q, scale, scheme.group_size, scheme.rows)
        if not (torch.isfinite(scale).all() and all_finite(deq)):
            raise QuantizationError(f"quantizing {name} produced NaN or Inf; nothing was written")
        ref = lin.weight.detach().float()
        rel = float((deq - ref.to(deq.device)).norm() / ref.norm().clamp(min=1e-12))
        lin.weight.data.copy_(deq.to(lin.weight.dtype))
        record = QuantizedLinear(q=q.cpu(), scale=scale.cpu().contiguous(), zero_point=None, g_idx=None, scheme=scheme)
        return record, rel


def _folded_error(deq: torch.Tensor, lin, col_scale=None, original=None, row_scale=None) -> float:
    """``|W_eff - W| / |W|`` of a linear whose dequantized weight is ``deq [out, in]`` (float32), in the original's
    space: AWQ's folded input scales (``col_scale [in]``) and, when the linear feeds another scaling group, its
    divided output rows (``row_scale [out]``) undone, ``W`` the weight before folding (``original``, default the
    linear's current weight)."""
    ref = (original if original is not None else lin.weight.detach()).float()
    eff = deq / col_scale if col_scale is not None else deq
    if row_scale is not None:
        eff = eff * row_scale.view(-1, 1).to(eff)
    return float((eff - ref.to(eff.device)).norm() / ref.norm().clamp(min=1e-12))


@dataclass
class LayerContext:
    """What every per-layer step reads: the architecture row, recipe, schemes, targets.

    ``targets``: full module name -> Linear the recipe quantizes; ``modules``: where steps
    store full module name -> :class:`QuantizedLinear`; ``observer``: the KV observers
    (``None`` without static KV scales); ``loss_n``: how many calibration sequences the
    output-error figures (and AWQ's losses) use; ``hessian_budget``: see the field.
    """

    arch: ArchSpec
    recipe: Recipe
    quantizer: LinearQuantizer
    targets: dict
    modules: dict
    observer: object
    loss_n: int
    #: bytes of calibration statistics (GPTQ's Hessians) a step may hold at once for a layer's
    #: routed experts; ``None``: unbounded (see :func:`compressor.quant.gptq_layer.hessian_chunks`)
    hessian_budget: int | None = None
    #: bytes of decoder-layer children's outputs a step may keep to replay them in its later
    #: passes and the recompute (:class:`compressor.quant.replay.ModuleReplay`); ``None``:
    #: unbounded, 0: none kept
    replay_budget: int | None = None
    #: the float model's activations at the current layer, per batch (``gptq.gptaq_alpha``;
    #: :func:`compressor.quant.gptq_layer.float_stream`), ``None`` before the first layer
    float_hidden: list | None = None
    #: ``spill(tensors, tag) -> tensors``: the driver's ``--activation-budget-gib`` rule for a
    #: step's own activation lists (moved to memory-mapped files above the budget); ``None``: kept in memory
    spill: Callable[[list, str], list] | None = None
    #: how the static KV scales are chosen: ``absmax`` or ``attention``
    #: (:func:`compressor.quant.kv_search.resolve_scale_search`)
    kv_scale_search: str = "absmax"
    #: ``none`` or ``pairs``: the key basis changed per RoPE pair (:mod:`compressor.quant.kv_rotation`)
    kv_key_rotation: str = "none"
    #: while a GPTQ layer is refined (:mod:`compressor.quant.refine`): full module name -> ``(target, original,
    #: error)`` of each linear GPTQ solved: the weights as it rounded them, the float weights before, the relative
    #: error it recorded; ``None``: not kept
    bases: dict | None = None
    #: under several ranks, while the layer runs on this rank's share of the calibration batches
    #: (:class:`compressor.sample_ranks.Samples`; ``hidden`` holds only those): ``None`` otherwise
    samples: object = None
    #: NVFP4 activations (W4A4): the :class:`~compressor.quant.fp4_inputs.InputObserver` of the recompute's
    #: linear inputs; ``None``: no input is observed
    input_observer: object = None

    def experts(self, layer) -> UnfusedExperts | None:
        """The layer's unfused routed experts (``None`` for a dense layer)."""
        return routed_experts(layer, self.arch)

    def cold(self, counts: list[int] | None) -> set[int]:
        """Experts routed fewer than ``max(moe.min_tokens, 1)`` (token, slot) pairs."""
        return cold_experts(counts, self.recipe.moe.min_tokens)


@dataclass
class LayerOutcome:
    """What a per-layer step reports back to the driver.

    ``errs``: relative weight error per quantized linear, in quantization order.
    ``float_out``: the float layer's output on the first calibration rows ``[n, T, H]``
    (the driver compares the recomputed output's first ``n`` rows with it), or ``None``.
    ``counts``: routed (token, slot) pairs per expert seen by the step, or ``None`` (the
    driver counts them on the recompute pass). ``figures``: algorithm-specific entries of
    the layer's figures (e.g. ``awq_ratios``, ``gptq``). ``phases``: seconds per named
    phase (the driver adds ``recompute``), or ``None`` for no ``phase_seconds``.
    ``replay``: the step's :class:`~compressor.quant.replay.ModuleReplay` (outputs of the
    layer's final children), which the driver's recompute reuses; or ``None``.
    ``linear_peak``: the largest ``|output|`` of linears the recompute does not run (a streamed
    MoE layer's routed experts, :mod:`compressor.moe_stream`), for ``max_abs_activation``.
    """

    errs: list[float]
    float_out: torch.Tensor | None = None
    counts: list[int] | None = None
    figures: dict = field(default_factory=dict)
    phases: dict | None = None
    replay: object = None
    linear_peak: float = 0.0


class StopForward(Exception):
    """Raised by a hook once the inputs it needs are captured (skips the rest of the layer)."""


def layer_forward(layer, h, kw, observer=None):
    """One decoder layer on ``h [b, T, H]`` with its captured keyword arguments; returns ``[b, T, H]``.

    With ``observer`` (KV observers) the layer runs with that cache, so the observers see
    its post-RoPE keys and values.
    """
    extra = {cache_kwarg(layer): observer, "use_cache": True} if observer is not None else {}
    out = layer(h, **kw, **extra)
    return out[0] if isinstance(out, tuple) else out


def inspect_forward(module, x, kw, is_attention):
    """The output of an AWQ group's inspected module (attention with the layer's mask/RoPE, or an MLP)."""
    if is_attention:
        out = module(hidden_states=x, position_embeddings=kw.get("position_embeddings"),
                     attention_mask=kw.get("attention_mask"))
    else:
        out = module(x)
    return out[0] if isinstance(out, tuple) else out


def recompute_layer(i, layer, hidden, kw, observer=None, peak: list | None = None, replay=None):
    """The layer's outputs with its quantized weights (the next layer's inputs); KV statistics on the way.

    ``peak``: when given, ``peak[0]`` becomes the largest absolute value among the layer's
    outputs and every linear's output inside it (float32, over all calibration tokens): what
    a float16 deployment must hold below 65,504 (``compressor.commands.quantize`` checks it).
    ``replay``: the step's :class:`~compressor.quant.replay.ModuleReplay`; its final children
    return their kept outputs (their linears' peak comes from when they were kept).
    """
    handles = []
    if peak is not None:
        peak[:] = [0.0]

        def track(_m, _inp, out):
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                peak[0] = max(peak[0], abs_max(out))

        handles = [m.register_forward_hook(track) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    new_hidden = []
    try:
        with replay.active(record=False) if replay is not None else nullcontext():
            for j, h in enumerate(hidden):
                if replay is not None:
                    replay.start_batch(j)
                new_hidden.append(layer_forward(layer, h, kw, observer))
    finally:
        for hd in handles:
            hd.remove()
    if replay is not None and peak is not None:
        peak[0] = max(peak[0], replay.peak)
    for j, h in enumerate(new_hidden):
        if not all_finite(h):
            raise QuantizationError(f"decoder layer {i} produced NaN/Inf after quantization (batch {j}); nothing was written")
        if peak is not None:
            peak[0] = max(peak[0], abs_max(h))
    return new_hidden
