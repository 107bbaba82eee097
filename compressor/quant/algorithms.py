"""Weight-quantization algorithms as registered per-layer handlers.

One :class:`Algorithm` subclass per recipe ``algorithm`` value, registered by name with
:func:`register_algorithm` (the habit of torchao's ``quant_api.py``: one handler per
config, no ``if mode == ...`` chains). A handler carries everything that depends on the
algorithm:

========================  ==================================================================
``quantize_layer``        the per-layer step: quantize one decoder layer's targeted linears
``needs_calibration``     whether the step needs captured layer inputs (``--calib``)
``quantizes_weights``     ``False`` for ``none`` (float weights; a KV-only artifact)
``per_linear``            each linear is quantized from its own weight alone (RTN, ``none``): a
                          large layer may be read and written in groups of routed experts
``streams_experts``       with a calibration pass, a streamed MoE layer above the memory budget
                          runs with its routed experts read in groups, each quantized from its
                          own routed tokens (``quantize_expert``; :mod:`compressor.moe_stream`;
                          AWQ, its scale spanning every expert: :mod:`compressor.moe_stream_awq`)
``experts_per_rank``      ``quantize_expert`` needs nothing but the expert's own tokens, and every
                          sum over experts the step needs is combined across ranks: under
                          several ``torchrun`` ranks each owns a share of the experts
                          (:mod:`compressor.moe_ranks`; AWQ's scale search too:
                          :mod:`compressor.moe_stream_awq`)
``folds_input_scales``    the artifact's weights carry folded input scales that weight
                          statistics must undo (AWQ; :func:`compressor.quality.weight_report`);
                          a streamed MoE layer then takes :mod:`compressor.moe_stream_awq`
``fp8_grid``              it quantizes FP8 e4m3 weights (``weights.type: float``; RTN)
``fp8_fallback``          in a recipe with overrides, its step quantizes the FP8 modules with RTN
                          (GPTQ; :mod:`compressor.recipe_mixed`)
``summary_fields``        the algorithm's part of the manifest's ``quantization`` block
``flag_warnings``         command-line flags the effective recipe makes meaningless
``run_warnings``          warnings drawn from all layers' figures after the run
========================  ==================================================================

Handlers: ``rtn`` and ``none`` here, ``awq`` in :mod:`compressor.quant.awq_layer`, ``gptq``
in :mod:`compressor.quant.gptq_layer` (each beside its math module), ``awq-gptq`` (AWQ's
scaling, then GPTQ) in :mod:`compressor.quant.awq_gptq_layer`. This module is their base: they
import it, it imports none of them; the registry (:data:`compressor.registry.ALGORITHMS`) finds
them by importing every module of :mod:`compressor.quant` on its first lookup, so a new
algorithm is one new module there.
"""

from __future__ import annotations

from typing import ClassVar

from ..arch import EXPERT, layer_linears
from ..errors import InputError
from ..recipe import AWQOptions, GPTQOptions
from ..registry import ALGORITHMS
from .layer import LayerContext, LayerOutcome

class Algorithm:
    """One weight-quantization algorithm (subclass it and decorate with :func:`register_algorithm`)."""

    #: the recipe's ``algorithm`` value
    name: ClassVar[str] = ""
    #: the per-layer step needs the layer's captured inputs (AWQ, GPTQ)
    needs_calibration: ClassVar[bool] = False
    #: ``False``: weights stay float (only the KV cache is quantized)
    quantizes_weights: ClassVar[bool] = True
    #: each targeted linear is quantized from its own weight alone, whatever else is loaded
    per_linear: ClassVar[bool] = False
    #: with a calibration pass, a routed expert is quantized from its own routed tokens alone
    #: (:meth:`quantize_expert`; AWQ: :mod:`compressor.moe_stream_awq`): a streamed MoE layer's experts may be
    #: read in groups
    streams_experts: ClassVar[bool] = False
    #: :meth:`quantize_expert` reads nothing but the expert and its tokens (no collective, no other
    #: expert), and every sum over experts the step needs is combined across ranks (AWQ's scale search:
    #: :mod:`compressor.moe_stream_awq`): under several ranks each reads and quantizes only its own experts
    #: (:mod:`compressor.moe_ranks`)
    experts_per_rank: ClassVar[bool] = False
    #: the artifact's weights are ``diag(1/s_row) W diag(s_col)`` (AWQ's folded scales)
    folds_input_scales: ClassVar[bool] = False
    #: the recipe sections (``awq``, ``gptq``) its step reads; a changed one it does not read earns a warning
    reads: ClassVar[tuple[str, ...]] = ()
    #: GPTQ-style column order: ``gptq.act_order`` solves columns by decreasing Hessian diagonal, which a
    #: format records (compressed-tensors ``actorder: weight``, a stored ``g_idx`` without static groups)
    act_order: ClassVar[bool] = False
    #: quantizes FP8 e4m3 weights (recipe ``weights.type: float``, :mod:`compressor.quant.fp8`): RTN only so far
    fp8_grid: ClassVar[bool] = False
    #: in a recipe with overrides (mixed formats), FP8 modules are rounded by RTN inside its step
    #: (:func:`compressor.recipe_mixed.module_algorithm`)
    fp8_fallback: ClassVar[bool] = False
    #: quantizes FP4 e2m1 weights (NVFP4, MXFP4: :mod:`compressor.quant.fp4`, :mod:`compressor.quant.mxfp4`)
    fp4_grid: ClassVar[bool] = False

    def divides_samples(self, ctx: LayerContext) -> bool:
        """Under several ranks, whether a decoder layer without routed experts may run on each rank's
        share of the calibration batches (:mod:`compressor.sample_ranks`): the step reads the batches only
        through :func:`compressor.quant.gptq_layer.accumulate_hessians` or
        :func:`compressor.quant.awq_observe.observe` (each bringing every batch's part to every rank in batch
        order) and gathers nothing else over them. False unless the algorithm says so."""
        return False

    def quantize_layer(self, i: int, layer, hidden: list | None, kw: dict | None, ctx: LayerContext) -> LayerOutcome:
        """Quantize decoder layer ``i``'s targeted linears in place.

        Args:
            layer: the decoder layer (on the compute device when ``hidden`` is given).
            hidden: the layer's inputs, float32 ``[b, T, H]`` per batch; ``None`` when no
                calibration pass runs (only for handlers without ``needs_calibration``).
            kw: the layer's captured keyword arguments (mask, RoPE, positions), or ``None``.
            ctx: schemes, targets and where to store each :class:`~compressor.quant.layer.QuantizedLinear`.

        Returns:
            A :class:`~compressor.quant.layer.LayerOutcome`; the driver recomputes the
            layer's outputs afterwards.

        Raises:
            QuantizationError: a non-finite value was produced (names the module).
        """
        raise NotImplementedError

    def quantize_expert(self, i: int, layer, rels: list[str], inputs: list, cold: bool,
                        ctx: LayerContext) -> LayerOutcome:
        """Quantize routed expert ``rels`` (its linears, relative names) of decoder layer ``i`` in
        place, from ``inputs``: the hidden states routed to it, ``[n_j, H]`` float32 per
        calibration batch (batches without one left out), as its module receives them in the
        whole layer's forward. ``cold``: fewer than ``moe.min_tokens`` routings (RTN fallback).
        Only for handlers with :attr:`streams_experts`.

        Returns:
            A :class:`LayerOutcome` with ``errs`` and ``figures`` (merged by :meth:`merge_expert_figures`).
        """
        raise NotImplementedError

    def merge_expert_figures(self, figures: dict, parts: list[dict]) -> dict:
        """The layer's figures (from its non-expert step) with those of its experts' :meth:`quantize_expert` added."""
        return figures

    def reference_sequences(self, ctx: LayerContext) -> int:
        """How many leading calibration sequences the step's float reference (``LayerOutcome.float_out``) covers."""
        return 0

    def experts_read_float_layer(self, ctx: LayerContext) -> bool:
        """Whether :meth:`quantize_expert`'s inputs are those of the float layer (GPTQ without
        ``true_sequential``: one pass before any solve) rather than those after the non-expert linears are quantized."""
        return False

    def keeps_float_stream(self, ctx: LayerContext) -> bool:
        """Whether the step advances ``ctx.float_hidden`` (GPTAQ's float model activations)."""
        return False

    def summary_fields(self, recipe, fmt: str) -> dict:
        """The algorithm-specific entries of the manifest's ``quantization`` block.

        Apply with ``quant.update(...)`` after the common keys (``algorithm``, ``format``,
        ``num_bits``, ``group_size``, ``symmetric``, ``modules``, ``storage_dtype``) and
        ``schemes`` are in place: existing keys keep their position, new ones follow.
        ``fmt`` is the output format name (``compressed-tensors``, ``awq``, ``gptq``).
        """
        return {}

    def flag_warnings(self, flags: dict, recipe, fmt: str) -> list[str]:
        """Command-line flags the effective ``recipe`` makes meaningless, said aloud.

        ``flags``: ``{"bits", "group_size", "symmetric", "act_order"}``, each ``None`` when
        not given on the command line; ``fmt`` the output format name.
        """
        out = []
        if flags.get("act_order") is not None:
            out.append(f"--act-order/--no-act-order has no effect with algorithm {self.name} (GPTQ only)")
        unread = unread_warnings(self, recipe, skip=("act_order",) if flags.get("act_order") is not None else ())
        return out + unread + odd_bits_warnings(recipe, fmt)

    def run_warnings(self, layers: list[dict]) -> list[str]:
        """Warnings drawn from every layer's figures (``QuantizeResult.layers``) after the run."""
        return []


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` (:data:`compressor.registry.ALGORITHMS`).

    Raises:
        ValueError: the name is empty or already registered.
    """
    ALGORITHMS.add(cls.name, cls())
    return cls


def get_algorithm(name: str) -> Algorithm:
    """The handler registered for ``name``.

    Raises:
        InputError: no algorithm of that name (lists the registered ones).
    """
    return ALGORITHMS.get(name)


def find_algorithm(name: str) -> Algorithm | None:
    """The handler registered for ``name``, or ``None`` (e.g. ``"unknown"`` for a foreign artifact)."""
    return ALGORITHMS.find(name)


def algorithm_names() -> list[str]:
    """The registered algorithm names, sorted."""
    return ALGORITHMS.names()


#: the recipe sections one algorithm may read, with their defaults
_SECTIONS = {"awq": AWQOptions, "gptq": GPTQOptions}


def unread_warnings(algorithm: "Algorithm", recipe, skip: tuple[str, ...] = ()) -> list[str]:
    """An ``awq`` or ``gptq`` section other than its defaults (``--set gptq.clip=true`` under RTN,
    ``--recipe w4a16-awq-gptq --algorithm gptq``) under an algorithm that does not read it
    (:attr:`Algorithm.reads`): it is recorded in the manifest's recipe but changes nothing, so say
    so, one warning per section (``skip``: keys a flag warning names already)."""
    out = []
    for section, options in _SECTIONS.items():
        if section in algorithm.reads:
            continue
        default, given = options(), getattr(recipe, section)
        changed = [k for k in options.model_fields if k not in skip and getattr(given, k) != getattr(default, k)]
        if changed:
            out.append(f"the recipe's {section} settings ({', '.join(changed)}) have no effect with algorithm "
                       f"{algorithm.name} ({section} and awq-gptq read them)")
    if "refine" not in algorithm.reads and getattr(recipe, "refine", None) is not None:
        out.append(f"the recipe's refine section has no effect with algorithm {algorithm.name} (gptq reads it)")
    return out


def odd_bits_warnings(recipe, fmt: str) -> list[str]:
    """The warning for weight widths vLLM's compressed-tensors kernels do not serve (none when ``fmt`` is
    another format). It names only the readers kvq's tests load such an artifact with (``kvq verify``'s
    loader and the runtime of ``kvq serve`` / ``serve-smoke``: tests/test_pipeline.py); transformers is not
    one: its compressed-tensors loader refuses asymmetric zero points, and the odd-bit recipes are asymmetric."""
    bits = {recipe.weights.num_bits} | {o.weights.num_bits for o in recipe.overrides if o.weights.num_bits}
    odd = sorted(b for b in bits if b not in (4, 8))
    if odd and fmt == "compressed-tensors":
        return [f"{'/'.join(map(str, odd))}-bit weights: vLLM's compressed-tensors WNA16 kernels serve 4 and 8 bits only; "
                "kvq verify, kvq serve and kvq serve-smoke read this artifact"]
    return []


def rtn_layer(i: int, layer, ctx: LayerContext) -> list[float]:
    """Round-to-nearest quantization of decoder layer ``i``'s targeted linears; returns their relative errors."""
    return rtn_linears(i, layer, layer_linears(ctx.arch, layer), ctx)


def fused_peers(arch, rel: str) -> tuple[str, ...]:
    """The relative names of the ``arch.fused`` set ``rel`` (a relative linear name, an expert's with its
    index) belongs to, itself included; ``(rel,)`` when vLLM fuses it with nothing."""
    for fused in arch.fused:
        for member in fused:
            head, _, tail = member.partition(EXPERT)
            if member == rel:
                return fused
            e = rel[len(head):len(rel) - len(tail)]
            if EXPERT in member and rel.startswith(head) and rel.endswith(tail) and e.isdigit():
                return tuple(f.replace(EXPERT, e) for f in fused)
    return (rel,)


def share_fp4_absmax(i: int, rels, ctx: LayerContext) -> None:
    """NVFP4: the global scale of each fused set among ``rels`` (relative names in decoder layer ``i``) from its
    float weights, before any of them is rounded (:meth:`compressor.quant.layer.Quantizer.share_fp4_absmax`)."""
    prefix = f"{ctx.arch.layers}.{i}."
    for rel in rels:
        if prefix + rel in ctx.targets and ctx.quantizer.schemes[prefix + rel].is_fp4:
            ctx.quantizer.share_fp4_absmax({prefix + r: ctx.targets[prefix + r] for r in fused_peers(ctx.arch, rel)
                                            if prefix + r in ctx.targets})


def rtn_linears(i: int, layer, rels: list[str], ctx: LayerContext) -> list[float]:
    """Round-to-nearest quantization of those of ``rels`` (relative names) that decoder layer ``i``
    targets; returns their relative errors."""
    errs = []
    prefix = f"{ctx.arch.layers}.{i}."
    share_fp4_absmax(i, rels, ctx)
    for rel in rels:
        name = prefix + rel
        if name in ctx.targets:
            ctx.modules[name], e = ctx.quantizer.quantize_linear(name, ctx.targets[name])
            errs.append(e)
    return errs


@register_algorithm
class RTN(Algorithm):
    """Round-to-nearest with min-max qparams (:mod:`compressor.quant.rtn`); no calibration.

    Inside a calibration pass (static KV scales) the driver recomputes the layer after it,
    so the KV observers see the quantized layer.
    """

    name = "rtn"
    per_linear = True
    streams_experts = experts_per_rank = True
    fp8_grid = fp4_grid = True

    def divides_samples(self, ctx):
        return True  # no forward of its own: the recompute alone

    def quantize_layer(self, i, layer, hidden, kw, ctx):
        return LayerOutcome(rtn_layer(i, layer, ctx))

    def quantize_expert(self, i, layer, rels, inputs, cold, ctx):
        return LayerOutcome(rtn_linears(i, layer, rels, ctx))


@register_algorithm
class NoWeights(Algorithm):
    """``none``: weights stay float; only the KV cache is quantized."""

    name = "none"
    quantizes_weights = False
    per_linear = True
    streams_experts = experts_per_rank = True

    def divides_samples(self, ctx):
        return True  # no forward of its own: the recompute alone

    def quantize_layer(self, i, layer, hidden, kw, ctx):
        return LayerOutcome(rtn_layer(i, layer, ctx))  # no targets: nothing is quantized

    def quantize_expert(self, i, layer, rels, inputs, cold, ctx):
        return LayerOutcome([])

    def summary_fields(self, recipe, fmt):
        return {"num_bits": None, "group_size": None, "symmetric": None}

    def flag_warnings(self, flags, recipe, fmt):
        out = []
        if any(flags.get(k) is not None for k in ("bits", "group_size", "symmetric")):
            out.append("--bits/--group-size/--symmetric have no effect: the recipe keeps weights in float (algorithm none)")
        if flags.get("act_order") is not None:
            out.append(f"--act-order/--no-act-order has no effect with algorithm {self.name} (GPTQ only)")
        return out + unread_warnings(self, recipe, skip=("act_order",) if flags.get("act_order") is not None else ())

