"""AWQ and ``awq-gptq`` on a mixture-of-experts decoder layer larger than ``--memory-budget-gib``.

kvq's AWQ (:mod:`compressor.quant.awq_layer`) folds one scale ``s`` into the norm that feeds every
routed expert, the shared experts and the router (the MoE block's scaling group,
:func:`compressor.arch._mlp_groups`), chosen on the whole block's output error per grid
candidate. With the routed experts read in groups (:meth:`compressor.staging.LayerWriter.read_groups`,
then :mod:`compressor.moe_stream`'s quantizing read), the layer runs in three reads of its experts:

1. *observe*, the experts on ``meta`` and their module answered by an
   :class:`~compressor.moe_stream.ExpertTap`: the float layer runs over the calibration batches
   with AWQ's input hooks on the non-expert linears and the block, the tap recording each
   batch's expert inputs and routing (the routed counts and cold experts, as the whole layer's
   observe counts them); then the block runs on the loss sequences at once (the search's float
   reference) and in the search's chunks (:func:`compressor.quant.awq_layer.loss_step`), the tap
   recording the routing of each call.
2. *first read*: each expert's terms of the block group's ``weight_mean`` (its gate's and up's
   sums of group-normalized ``|w|`` rows, ``[H]`` float32 each, kept and added in the whole
   group's order afterwards), and its float output added into the reference's routed part and
   into that of the loss batches; the float layer's output on the loss sequences (the
   ``output_rel_error`` reference) is the layer's forward with that routed part replayed.
3. the scaling groups in order: the held part's searched and folded as in the whole layer; the
   block's with the *second read*: for each grid candidate, every expert's gate/up scaled,
   fake-quantized and unscaled runs on its tokens of each loss chunk and adds into that
   candidate's routed part (``n_grid x loss tokens x H`` float32; when that exceeds the memory
   budget the candidates take as many reads as it needs, ``awq_expert_reads`` counts them all);
   each candidate's loss is the search's own loss function on the block, its routed part
   replayed and its shared experts holding the candidate's weights. The chosen ``s`` is folded
   into the norm, the router and the shared experts.
4. the *third read*, :func:`compressor.moe_stream.quantize_layer_streamed`'s: the held part is
   quantized (AWQ's clip search and rounding; for ``awq-gptq`` GPTQ's passes, as the GPTQ path
   runs them), then as each group is read, expert by expert (one expert's weights before folding
   held at a time, not the group's), the expert is observed on its float routed tokens, ``s`` is
   folded into its gate/up, its own ``up -> down`` group is searched and folded, and it is
   quantized (clip search and rounding, or GPTQ on the folded expert), its error measured against
   its weights before folding.

Exactness: every hook, loss and fold sees the tensors of the whole layer's path (the same
routed rows, calls of the same shapes, experts added in ascending index order as
:class:`compressor.moe.UnfusedExperts` adds them, the ``weight_mean`` terms in the whole group's
order), so the ratios, the artifact's tensors and the next layer's inputs equal the whole-layer
path's bit for bit, for every grouping (``tests/test_moe_stream.py``); the float reference of
``output_rel_error`` is exact too. Held beyond the non-expert part and one group: the float
expert inputs of every batch (as the GPTQ path's), the candidates' routed parts, each expert's
``weight_mean`` terms (``2 x experts x H`` float32) and one expert's loss inputs at a time.

Under several ``torchrun`` ranks (:mod:`compressor.moe_ranks`) each rank reads only its own block of
experts in each read, and every sum over experts is made in the single process's order: the routed
parts (the loss sequences', the reference's, each candidate's) by
:meth:`~compressor.moe_ranks.ExpertShare.combine` after the read, the ``weight_mean`` terms sent to every
rank (:meth:`~compressor.moe_ranks.ExpertShare.merge`), each expert's own ratio with its figures. Every
rank computes the same losses and picks the same scale; the artifact is the single process's. The
calibration batches divide too (:mod:`compressor.sample_ranks`): the observe runs on each rank's own
batches, its statistics reach every rank in batch order (:func:`compressor.quant.awq_observe.observe`),
and so do the expert calls it records (:meth:`~compressor.sample_ranks.Samples.gather_calls`), so each
expert's owner sees every token routed to it; the float output on the loss sequences (the output-error
figure) is rank 0's, on its first batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from .arch import ScalingGroup, expert_index, get_module, is_expert, layer_groups, layer_linears
from .distributed import deal
from .moe_ranks import AWQ_ROUNDED_COST, AWQ_SEARCHED_COST, ExpertShare, solve_costs
from .moe_stream import ExpertTap, _routed_counts, _zeros, add_expert, move_loaded, quantize_layer_streamed
from .quant.awq import best_scale, candidate_weights, mean_of_rows, scale_grid, weight_row_sum
from .quant.awq_layer import (ScaledLayer, clip_and_quantize, e2m1_grids, fold_group, forward_loss, group_name,
                              loss_step, scale_group, scale_groups, watched_modules)
from .quant.awq_observe import InputStats, loss_batches, observe
from .quant.gptq_layer import GPTQ, gptq_expert, gptq_layer
from .quant.layer import LayerContext, LayerOutcome, inspect_forward, layer_forward

__all__ = ["quantize_layer_streamed_awq"]


def quantize_layer_streamed_awq(i: int, layer, hidden: list, kw: dict, ctx: LayerContext, algorithm, groups,
                                tap: ExpertTap, device, reread, rebalance=None) -> LayerOutcome:
    """Decoder layer ``i``'s AWQ or ``awq-gptq`` step with its routed experts read in groups (the
    module docstring), for :func:`compressor.pipeline._quantize_and_recompute`. ``groups``: the
    generator of :meth:`compressor.staging.LayerWriter.load_groups`, its non-expert group already
    read; ``reread()``: a new generator reading the expert groups once more without writing them
    (:meth:`~compressor.staging.LayerWriter.read_groups`); ``tap``: active on the layer's experts;
    ``rebalance(share)``: makes ``groups`` and ``reread`` read this rank's experts of ``share``
    (under several ranks: blocks of about equal work once the observe has routed the tokens,
    :data:`~compressor.moe_ranks.AWQ_SEARCHED_COST`).
    Leaves the tap replaying the quantized routed output of each batch for the driver's recompute.

    Returns:
        The :class:`LayerOutcome` of the whole-layer path: errors of every linear, routed counts
        (AWQ: the float layer's, as its observe counts them; ``awq-gptq``: GPTQ's), AWQ's figures
        (``awq_ratios`` in the layer's group order) with ``weight_groups`` and ``awq_expert_reads``.

    Raises:
        QuantizationError: a scale search produced no finite loss, or a non-finite weight.
    """
    share = ExpertShare.of(algorithm, len(tap.experts))  # torchrun: this rank's experts (compressor.moe_ranks)
    st = _Streamed(i, layer, hidden, kw, ctx, tap, device, reread, isinstance(algorithm, GPTQ), share, rebalance)
    st.scale()
    step = _Step(algorithm, st)
    outcome = quantize_layer_streamed(i, layer, hidden, kw, ctx, step, groups, tap, device, share=st.share)
    outcome.float_out = st.sl.float_out
    if not st.gptq:
        outcome.counts = st.sl.counts
    order = layer_groups(ctx.arch, layer)
    sl = st.sl
    sl.ratios = {g.prev_op: sl.ratios[g.prev_op] for g in order if g.prev_op in sl.ratios}
    sl.skipped = {group_name(g): sl.skipped[group_name(g)] for g in order if group_name(g) in sl.skipped}
    rest = {k: v for k, v in outcome.figures.items() if k not in ("awq_ratios", "awq_skipped", "weight_groups")}
    outcome.figures = {**rest, **sl.figures(), "weight_groups": outcome.figures["weight_groups"],
                       "awq_expert_reads": st.reads + 1}
    return outcome


def _experts_of(arch, prefix: str, modules: list[str]) -> list[int]:
    """The routed experts whose module names (full, ``...experts.<e>.gate_proj``) ``modules`` holds."""
    return sorted({expert_index(arch, m[len(prefix):]) for m in modules} - {None})


@dataclass
class _Streamed:
    """One streamed MoE layer's AWQ state between its reads (module docstring)."""

    i: int
    layer: torch.nn.Module
    hidden: list
    kw: dict
    ctx: LayerContext
    tap: ExpertTap
    device: object
    reread: object
    gptq: bool  #: ``awq-gptq``: GPTQ quantizes the folded layer
    share: ExpertShare  #: the experts this rank reads (all of them in one process) and the sums across ranks
    rebalance: object = None  #: ``rebalance(share)``: this rank's experts of ``share`` read instead
    sl: ScaledLayer | None = None  #: the held part's linears and loss inputs; every linear's scales and originals
    calls: list = field(default_factory=list)  #: the float layer's expert calls per batch ``(x [N, H], index, w)``
    keep: list = field(default_factory=list)  #: per batch: among the loss sequences
    block: ScalingGroup | None = None  #: the scaling group spanning the routed experts
    own: dict = field(default_factory=dict)  #: expert -> its ``up -> down`` scaling group
    s: torch.Tensor | None = None  #: the block group's scale, for the routed gate/up
    pending: dict = field(default_factory=dict)  #: expert -> (its linears, its loss inputs), folded, not quantized
    reads: int = 0  #: reads of the experts before the quantizing one

    @property
    def prefix(self) -> str:
        return f"{self.ctx.arch.layers}.{self.i}."

    def scale(self) -> None:
        """Steps 1-3: observe, the first read, the held groups and the block group searched and folded."""
        arch, ctx, layer, tap = self.ctx.arch, self.ctx, self.layer, self.tap
        tp = time.perf_counter()
        groups = layer_groups(arch, layer)
        linears = {r: get_module(layer, r) for r in layer_linears(arch, layer) if not is_expert(arch, r)}
        calls, samples = tap.set("record"), ctx.samples  # samples: this rank's batches (compressor.sample_ranks)
        stats, _ = observe(layer, self.hidden, self.kw, watched_modules(layer, linears, groups), ctx.loss_n, samples,
                           outputs=False)
        tap.set("zero")
        calls = samples.gather_calls(calls) if samples is not None else calls  # every batch's, on every rank
        if ctx.spill is not None and calls:
            xs = ctx.spill([x for x, _, _ in calls], "moe-awq")
            calls = [(x, idx, w) for x, (_, idx, w) in zip(xs, calls)]
        self.calls, self.keep = calls, loss_batches(samples.shapes if samples is not None else self.hidden, ctx.loss_n)
        counts = _routed_counts(calls, len(tap.experts))
        self.sl = ScaledLayer(linears, stats.loss_inputs(linears, self.hidden, ctx.loss_n), ctx.cold(counts), {}, {},
                              {r: m.weight.detach().clone() for r, m in linears.items()}, {}, None, counts, {}, {})
        if self.share.size > 1 and self.rebalance is not None:  # the routing known: blocks of about equal work
            n = len(tap.experts)
            self.share = ExpertShare(n, True, solve_costs(n, self.sl.cold, AWQ_SEARCHED_COST, AWQ_ROUNDED_COST))
            self.rebalance(self.share)
        x_mean = stats.x_mean()
        del stats
        self.block = next((g for g in groups if not is_expert(arch, g.prev_op)
                           and any(is_expert(arch, r) for r in g.linears)), None)
        self.own = {expert_index(arch, g.prev_op): g for g in groups if is_expert(arch, g.prev_op)}
        search = _BlockSearch(self, x_mean) if self.block is not None else None
        self._first_read(search)
        self.sl.phases["observe"], tp = time.perf_counter() - tp, time.perf_counter()
        run = []  # in order, as the whole layer: later groups see the earlier folds they read
        for g in [*groups, None]:
            if g is None or g is self.block:  # the held groups before it, their searches dealt to the ranks
                scale_groups(layer, run, self.prefix, self.sl, x_mean, self.kw, ctx)
                run = []
                if g is not None:
                    self._scale_block(search)
            elif not is_expert(arch, g.prev_op):  # the experts' own groups: at their quantizing read
                run.append(g)
        self.sl.phases["scale_search"] = time.perf_counter() - tp

    def _first_read(self, search: "_BlockSearch | None") -> None:
        """The first read: the block group's ``weight_mean`` terms and float reference, and the float
        layer's output on the loss sequences (``sl.float_out``)."""
        loss_calls = [c for c, k in zip(self.calls, self.keep) if k]
        routed = _zeros(loss_calls, None, "")
        sink = self.share.sink(loss_calls, routed)
        for modules in self.reread():
            for e in _experts_of(self.ctx.arch, self.prefix, modules):
                expert = self.tap.experts[e]
                move_loaded(expert, self.device)
                if search is not None:
                    search.read_float(e, expert)
                add_expert(expert, e, loss_calls, sink)
        self.reads += 1
        self.share.combine(routed, sink)  # every rank's experts, added in ascending order
        if search is not None:
            search.combine()
        self.tap.set("replay", routed)
        out, seen, samples = [], 0, self.ctx.samples
        mine = samples.mine if samples is not None else range(len(self.hidden))  # rank 0's first batch: the loss's
        for h, keep in zip(self.hidden, [self.keep[j] for j in mine]):
            if keep:
                out.append(layer_forward(self.layer, h, self.kw)[: self.ctx.loss_n - seen])
            seen += h.shape[0]
        self.tap.set("zero")
        self.sl.float_out = torch.cat(out) if out else None  # several ranks: the output-error figure is rank 0's

    def _scale_block(self, search: "_BlockSearch") -> None:
        """Search the block group's scale (the second read) and fold it into the held part."""
        found = search.search()
        if isinstance(found, str):
            self.sl.skipped[group_name(self.block)] = found
        if found is None or isinstance(found, str):
            return
        self.s, self.sl.ratios[self.block.prev_op] = found
        held = dataclasses.replace(self.block, linears=tuple(r for r in self.block.linears
                                                             if not is_expert(self.ctx.arch, r)))
        fold_group(self.layer, held, self.s, search.key, self.sl.linears, self.sl.x_loss, self.sl.col_scale,
                   self.sl.row_scale, self.ctx.arch.norm_offset, self.ctx.quantizer.dtype)

    def fold_expert(self, e: int) -> None:
        """Expert ``e``, read: observed on its float routed tokens (its linears' inputs as the whole
        layer's observe sees them), the block's scale folded into its gate/up, its own ``up -> down``
        group searched and folded; its weights before folding kept in ``sl.originals``."""
        ctx, sl = self.ctx, self.sl
        expert = self.tap.experts[e]
        lin = {f"{ctx.arch.moe.experts}.{e}.{n}": m for n, m in expert.named_modules()
               if isinstance(m, torch.nn.Linear)}
        sl.originals.update({r: m.weight.detach().clone() for r, m in lin.items()})
        stats = InputStats(lin)
        with stats.hooked():
            for (x, idx, _w), keep in zip(self.calls, self.keep):
                tokens = torch.where(idx == e)[0]
                if tokens.numel():
                    stats.keep = keep
                    expert(x[tokens])
        view = dataclasses.replace(sl, linears=lin, x_loss=stats.loss_inputs(lin, self.hidden, ctx.loss_n))
        x_mean = stats.x_mean()
        del stats
        if self.s is not None:
            for r in (r for r in lin if r in self.block.linears):  # the block group's fold, on this expert
                lin[r].weight.data.mul_(self.s)
                sl.col_scale[r] = self.s
                view.x_loss[r] = view.x_loss[r] / self.s
        if e in self.own:
            scale_group(self.layer, self.own[e], self.prefix, view, x_mean, self.kw, ctx)
        self.pending[e] = (lin, None if self.gptq else view.x_loss)


class _BlockSearch:
    """The block group's scale search over streamed experts (module docstring, steps 1-3)."""

    def __init__(self, st: _Streamed, x_mean: dict):
        ctx, group = st.ctx, st.block
        self.st, self.key = st, group.inputs_at or group.linears[0]
        self.x, self.x_mean = st.sl.x_loss[self.key], x_mean[self.key]
        self.module = get_module(st.layer, group.inspect)
        schemes = ctx.quantizer.schemes
        self.spec = {r: schemes.get(st.prefix + r, schemes[next(iter(schemes))]) for r in group.linears}
        self.quantized = {r: st.prefix + r in ctx.targets for r in group.linears}
        self.routed: dict[int, list[str]] = {}
        for r in group.linears:
            if is_expert(ctx.arch, r):
                self.routed.setdefault(expert_index(ctx.arch, r), []).append(r)
        self.terms: dict[str, torch.Tensor] = {}
        self.live = any(self.quantized.values()) and self.x.numel() > 0 and self.x_mean is not None
        self.ref_call, self.chunk_calls, self.ref_routed, self.ref_sink = None, [], [], []
        if self.live:  # the routing of the reference (the loss tokens at once) and of each loss chunk
            calls = st.tap.set("record")
            inspect_forward(self.module, self.x, st.kw, group.inspect_is_attention)
            step = loss_step(self.x, group.inspect_is_attention)
            for r0 in range(0, self.x.shape[0], step):
                inspect_forward(self.module, self.x[r0:r0 + step], st.kw, group.inspect_is_attention)
            st.tap.set("zero")
            self.ref_call, self.chunk_calls = calls[0], calls[1:]
            self.ref_routed = _zeros([self.ref_call], None, "")
            self.ref_sink = st.share.sink([self.ref_call], self.ref_routed)

    def read_float(self, e: int, expert) -> None:
        """The first read of expert ``e``: its ``weight_mean`` terms and its share of the float reference."""
        if not self.live:
            return
        if self.st.ctx.recipe.awq.duo_scaling:
            gs = self.spec[self.st.block.linears[0]][1]
            for r in self.routed.get(e, []):
                self.terms[r] = weight_row_sum(get_module(self.st.layer, r).weight.detach(), gs)
        add_expert(expert, e, [self.ref_call], self.ref_sink)

    def combine(self) -> None:
        """After the first read, on every rank: the float reference's routed part over every expert
        (:meth:`~compressor.moe_ranks.ExpertShare.combine`) and every expert's ``weight_mean`` terms
        (:meth:`~compressor.moe_ranks.ExpertShare.merge`; :meth:`search` adds them in the group's order)."""
        if not self.live:
            return
        share = self.st.share
        share.combine(self.ref_routed, self.ref_sink)
        self.ref_sink = []
        self.terms = dict(share.merge(list(self.terms.items()), 0.0, 0)[0])

    def search(self) -> tuple[torch.Tensor, float] | str | None:
        """``(s [H] float32, ratio)``; ``None`` when none of the group's linears is targeted; the reason
        when it is left unscaled (no loss token reached it), as :func:`search_group_scales` says them."""
        st, group = self.st, self.st.block
        if not any(self.quantized.values()):
            return None
        if not self.live:
            return "no calibration token reached it among the loss samples"
        layer, opts = st.layer, st.ctx.recipe.awq
        w_mean = None
        if opts.duo_scaling:
            gs = self.spec[group.linears[0]][1]
            w_mean = mean_of_rows((self.terms.pop(r) if r in self.terms else weight_row_sum(
                get_module(layer, r).weight.detach(), gs) for r in group.linears),
                sum(get_module(layer, r).out_features for r in group.linears))
        grid = scale_grid(self.x_mean, w_mean, opts.n_grid)
        held = [r for r in group.linears if not is_expert(st.ctx.arch, r)]
        held_w = [get_module(layer, r).weight.detach().clone() for r in held]
        st.tap.set("replay", self.ref_routed)  # the float reference: the block with its float routed part
        loss_fn = forward_loss(self.module, [get_module(layer, r) for r in held], held_w,
                               [self.quantized[r] for r in held], self.x, st.kw, group.inspect_is_attention)
        st.tap.set("zero")
        self.ref_routed = []
        per = 4 * sum(c[0].numel() for c in self.chunk_calls)  # bytes of one candidate's routed part
        budget = st.ctx.hessian_budget
        k = len(grid) if budget is None or per == 0 else max(1, min(len(grid), budget // per))
        losses = []
        for c0 in range(0, len(grid), k):
            part = grid[c0:c0 + k]
            outs = self._candidate_reads([s for _, s in part])

            def loss_of(j: int) -> float:  # every rank holds every candidate's routed part: the losses are dealt
                st.tap.set("replay", outs[j])
                return float(loss_fn(candidate_weights(held_w, part[j][1], *self._schemes(held))))

            losses += deal(list(range(len(part))), loss_of)
            st.tap.set("zero")
            del outs
        s, ratio = best_scale(grid, losses, st.prefix + group_name(group))
        return s, ratio

    def _schemes(self, rels: list[str]) -> tuple:
        """``(bits, group sizes, symmetric, e2m1 grids, fused sets)`` of ``rels``, one list each
        (:func:`candidate_weights`; the last two ``None`` for integer schemes, :func:`e2m1_grids`): an expert's
        gate/up, NVFP4's fused set, are tried in one call, so their candidates share the whole layer's global scale."""
        specs = [self.spec[r] for r in rels]
        grids = e2m1_grids(self.st.ctx.arch, rels, specs, [self.quantized[r] for r in rels]) or (None, None)
        return (*([sp[k] for sp in specs] for k in range(3)), *grids)

    def _candidate_reads(self, scales: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """One read of the experts: per candidate ``s``, the routed part of each loss chunk's block
        output with every expert's gate/up scaled, fake-quantized and unscaled by ``s``. An expert no
        loss chunk routes a token to adds nothing to any candidate: its candidates are not made."""
        st = self.st
        outs = [_zeros(self.chunk_calls, None, "") for _ in scales]
        sinks = [st.share.sink(self.chunk_calls, out) for out in outs]
        reached = set()  # experts a loss chunk routes a token to: the others add nothing to any candidate
        for _x, idx, _w in self.chunk_calls:
            reached.update(idx.unique().tolist())
        for modules in st.reread():
            for e in _experts_of(st.ctx.arch, st.prefix, modules):
                if e not in reached:
                    continue
                expert, rels = st.tap.experts[e], self.routed.get(e, [])
                move_loaded(expert, st.device)
                lins = [get_module(st.layer, r) for r in rels]
                ws = [m.weight.detach().clone() for m in lins]
                for s, sink in zip(scales, sinks):
                    for r, m, w, c in zip(rels, lins, ws, candidate_weights(ws, s, *self._schemes(rels))):
                        m.weight.data.copy_(c if self.quantized[r] else w)
                    add_expert(expert, e, self.chunk_calls, sink)
        st.reads += 1
        for out, sink in zip(outs, sinks):  # each candidate's routed part over every rank's experts
            st.share.combine(out, sink)
        return outs


class _Step:
    """The layer's algorithm as :func:`compressor.moe_stream.quantize_layer_streamed` calls it once the
    scales are searched: the held part and each expert quantized with their folds (AWQ's clip search
    and rounding, or GPTQ for ``awq-gptq``); no float reference of its own (AWQ's is exact). An
    expert's own ``up -> down`` ratio (or why it was left unscaled) travels with its figures, which
    reach every rank in expert order (:meth:`compressor.moe_ranks.ExpertShare.merge`)."""

    def __init__(self, algorithm, st: _Streamed):
        self.algorithm, self.st = algorithm, st
        self.experts_per_rank = algorithm.experts_per_rank  # the experts' share: st.share's

    def reference_sequences(self, ctx) -> int:
        return 0

    def keeps_float_stream(self, ctx) -> bool:
        return self.algorithm.keeps_float_stream(ctx)

    def experts_read_float_layer(self, ctx) -> bool:
        return self.algorithm.experts_read_float_layer(ctx)

    def merge_expert_figures(self, figures: dict, parts: list[dict]) -> dict:
        sl = self.st.sl
        for p in parts:  # every expert's, on every rank
            sl.ratios.update(p.pop("awq_ratios", {}))
            sl.skipped.update(p.pop("awq_skipped", {}))
        return self.algorithm.merge_expert_figures(figures, parts)

    def _folds(self) -> tuple[dict, dict, dict]:
        return self.st.sl.col_scale, self.st.sl.row_scale, self.st.sl.originals

    def quantize_layer(self, i, layer, hidden, kw, ctx) -> LayerOutcome:
        sl = self.st.sl
        tp = time.perf_counter()
        if self.st.gptq:
            sl.x_loss = None  # AWQ's loss inputs: only its clip search would read them
            out = gptq_layer(i, layer, hidden, kw, ctx, folds=self._folds(), float_out=sl.float_out)
            out.figures = {**out.figures, **sl.figures()}
            out.phases = {**sl.phases, **out.phases, "gptq_total": time.perf_counter() - tp}
        else:
            errs = clip_and_quantize(i, sl.linears, sl.x_loss, sl.cold, *self._folds(), ctx)
            sl.x_loss = None
            phases = {**sl.phases, "clip_and_quantize": time.perf_counter() - tp}
            out = LayerOutcome(errs, None, None, sl.figures(), phases)
        out.float_out = None
        return out

    def ready_expert(self, e: int) -> None:
        """Expert ``e``, just read: its folds (:meth:`_Streamed.fold_expert`), before its float stream and
        its quantizing. One expert's weights before folding are held at a time, not a whole group's."""
        self.st.fold_expert(e)

    def quantize_expert(self, i, layer, rels, inputs, cold, ctx) -> LayerOutcome:
        e = expert_index(ctx.arch, rels[0])
        lin, x_loss = self.st.pending.pop(e)
        if self.st.gptq:
            out = gptq_expert(i, layer, rels, inputs, cold, ctx, folds=self._folds())
        else:
            out = LayerOutcome(clip_and_quantize(i, lin, x_loss, self.st.sl.cold, *self._folds(), ctx))
        for d in self._folds():  # the expert's scales and weights before folding: not read again
            for r in lin:
                d.pop(r, None)
        own, sl = self.st.own.get(e), self.st.sl
        if own is not None and own.prev_op in sl.ratios:
            out.figures["awq_ratios"] = {own.prev_op: sl.ratios.pop(own.prev_op)}
        if own is not None and group_name(own) in sl.skipped:
            out.figures["awq_skipped"] = {group_name(own): sl.skipped.pop(group_name(own))}
        return out
