"""One streamed forward for a mixture-of-experts decoder layer larger than ``--memory-budget-gib``.

A Kimi K2 MoE layer holds 384 routed experts of 3 x 7168 x 2048 weights: 68 GB in float32. A
streamed quantize (:class:`compressor.staging.LayerWriter`) never holds it whole; with a
calibration pass (GPTQ, GPTAQ, RTN or float weights beside static KV scales; AWQ: below) the layer runs as:

1. the non-expert tensors (attention, norms, router, shared experts, the layer's other
   parts) are read and held; the routed experts stay on ``meta``, and their module's call is
   answered by an :class:`ExpertTap` (zeros, the call's arguments recorded, or outputs
   replayed);
2. the algorithm's step runs on the non-expert linears alone (the tap answers zeros: nothing
   upstream of the routed experts, nor beside them, reads their output inside the layer);
3. one recording forward with those linears quantized gives, per calibration batch, the
   routed experts' input ``x [N, H]`` (the post-attention hidden states), the router's
   ``top_k_index`` / ``top_k_weights``: routing is computed once, by the held router, and
   gives the routed (token, slot) counts and the cold experts (``moe.min_tokens``);
4. the routed experts are read in groups (:meth:`compressor.staging.LayerWriter.load_groups`):
   each expert of a group is quantized from the tokens routed to it
   (:meth:`compressor.quant.algorithms.Algorithm.quantize_expert`: GPTQ's Hessians and
   solves, stage by stage, on the expert's own tokens), its output with the quantized
   weights is weighted by the router and added into the routed output of each batch, and
   the group is packed, written and released before the next is read (under several
   ``torchrun`` ranks, each rank reads and quantizes only the experts it owns, and the
   routed output is summed across the ranks in this same order: :mod:`compressor.moe_ranks`);
5. the driver's recompute (:func:`compressor.pipeline._quantize_and_recompute`) runs the
   layer once more with the tap replaying the accumulated routed output: the next layer's
   input is the layer's own sum of shared and routed outputs, the KV observers run there.

Exactness: an expert's hooks see the same tensors as in the whole layer's passes (``x`` with
the same rows gathered, in batch order), the experts are added into each batch's routed
output in ascending index order as :class:`compressor.moe.UnfusedExperts` adds them, and
the layer's own code combines that output with the residual and shared experts: the
artifact's tensors and the next layer's inputs equal the whole-layer path's, bit for bit,
for every grouping (``tests/test_moe_stream.py``). Two figures are computed another way:
the float reference of ``output_rel_error`` and GPTAQ's float stream (``gptq.gptaq_alpha``)
are the float layer's output without its routed part plus the routed part
(``residual + shared`` then ``+ routed``, where the layer adds ``residual + (routed +
shared)``), equal to the whole layer's to float32 rounding (a relative 1e-7 of the
activations); the float stream then feeds GPTAQ's target of the next layers, whose integers
may differ from the whole-layer path's where a weight sits on a rounding boundary.

AWQ and ``awq-gptq`` run through :mod:`compressor.moe_stream_awq`: kvq's AWQ folds one scale
``s`` into the ``post_attention_layernorm`` that feeds every routed expert, the shared experts and
the router (:func:`compressor.arch._mlp_groups`), searched on the whole MoE block's output, so
the experts are read at least twice before this step (their ``weight_mean`` terms and float
reference, then the grid's candidates) and this step's read folds and quantizes them: the same
tensors as the whole layer's, bit for bit.

``kvq verify --stream`` runs an MoE layer of the reference and of the artifact the same way
(:func:`forward_grouped`, from :mod:`compressor.streamed_eval`): the tap records, the groups
of experts are added in, the tap replays; nothing is quantized there.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext

import torch

from .arch import expert_index, is_expert
from .moe_ranks import ExpertShare, expert_costs
from .quant.layer import LayerOutcome, layer_forward
from .quant.primitives import abs_max

__all__ = ["ExpertTap", "move_loaded", "add_expert", "forward_grouped", "quantize_layer_streamed"]


def move_loaded(module: torch.nn.Module, device) -> None:
    """Move ``module``'s materialized parameters and buffers to ``device``; ``meta`` ones stay
    (``Module.to`` refuses a module holding any)."""
    dev = torch.device(device)
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for k, t in list(store.items()):
                if t is None or t.is_meta or t.device == dev:
                    continue
                moved = t.detach().to(dev)
                is_param = isinstance(t, torch.nn.Parameter)
                store[k] = torch.nn.Parameter(moved, requires_grad=False) if is_param else moved


class ExpertTap:
    """Stands in for a decoder layer's routed experts (:class:`compressor.moe.UnfusedExperts`)
    while their weights are on ``meta``. The experts' call ``(hidden [N, H] float32,
    top_k_index int64 [N, k], top_k_weights [N, k])`` is answered, by :attr:`mode`:

    * ``zero``: with zeros ``[N, H]``;
    * ``record``: with zeros, its three arguments appended to :attr:`calls`;
    * ``replay``: with :attr:`outputs` ``[c]`` for the ``c``-th call since the mode was set.
    """

    def __init__(self, experts: torch.nn.Module):
        self.experts = experts
        self.mode = "zero"
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.outputs: list[torch.Tensor] = []
        self._c = 0

    def set(self, mode: str, outputs: list[torch.Tensor] | None = None) -> list:
        """Switch to ``mode`` (``record`` starts a new :attr:`calls`, which is returned)."""
        self.mode, self._c = mode, 0
        if mode == "record":
            self.calls = []
        if outputs is not None:
            self.outputs = outputs
        return self.calls

    @contextmanager
    def active(self):
        """Within the block the experts' module calls the tap instead of its experts."""
        self.experts.forward = self._forward
        try:
            yield self
        finally:
            del self.experts.forward  # the class's forward again

    def _forward(self, hidden_states, top_k_index, top_k_weights):
        if self.mode == "replay":
            out = self.outputs[self._c]
            self._c += 1
            return out
        if self.mode == "record":
            self.calls.append((hidden_states.detach(), top_k_index.detach(), top_k_weights.detach()))
        return torch.zeros_like(hidden_states)


def add_expert(expert: torch.nn.Module, e: int, calls: list, outs: list[torch.Tensor],
               peak: list | None = None) -> None:
    """Add routed expert ``e``'s weighted output to ``outs`` (``[N, H]`` per recorded call of
    ``calls``), as :class:`compressor.moe.UnfusedExperts` computes it; with ``peak``,
    ``peak[0]`` becomes the largest ``|output|`` of the expert's linears on the way."""
    handles = []
    if peak is not None:
        def track(_m, _inp, out):
            if out.numel():
                peak[0] = max(peak[0], abs_max(out))
        handles = [m.register_forward_hook(track) for m in expert.modules() if isinstance(m, torch.nn.Linear)]
    try:
        for (x, idx, w), out in zip(calls, outs):
            token_idx, slot = torch.where(idx == e)
            if token_idx.numel():
                y = expert(x[token_idx]) * w[token_idx, slot, None]
                out.index_add_(0, token_idx, y.to(out.dtype))
    finally:
        for h in handles:
            h.remove()


def forward_grouped(passes: list, groups) -> None:
    """Run decoder layers whose routed experts are read in groups, as their whole-layer forward
    would: a streamed verify's step for one MoE layer of each model (:mod:`compressor.streamed_eval`).

    Args:
        passes: ``(tap, forward)`` pairs: ``tap`` an :class:`ExpertTap` active on the routed
            experts of a layer whose non-expert tensors are read; ``forward(keep)`` runs every
            input of one configuration through that layer, storing the outputs (its next
            inputs) when ``keep`` is true. Several passes may share a tap (one layer).
        groups: an iterator yielding the expert indices of each group once they are read into
            every tapped layer, and releasing them when resumed (one group materialized at a time).

    Each pass runs once with its tap recording (the layer's routing computed by its own
    router; outputs dropped), then every group's experts add their weighted outputs into each
    recorded call's routed output (:func:`add_expert`: experts in ascending index order, as
    :class:`compressor.moe.UnfusedExperts` adds them), and each pass runs again with its tap
    replaying those outputs: the layer's own code adds them to its residual and shared experts,
    so the outputs equal the whole layer's (same tensors, same order of additions). Memory
    beyond the layer: the experts' inputs and routed outputs of every call (two copies of the
    configurations' hidden states, the first released before the replay).
    """
    calls, routed = [], []
    for tap, forward in passes:
        calls.append(tap.set("record"))
        forward(False)
        tap.set("zero")
        tap.calls = []  # held in ``calls`` only: released with it
        routed.append(_zeros(calls[-1], None, ""))
    for experts in groups:
        for e in experts:
            for (tap, _), c, r in zip(passes, calls, routed):
                add_expert(tap.experts[e], e, c, r)
    calls.clear()  # the experts' inputs: not needed by the replay
    for (tap, forward), r in zip(passes, routed):
        tap.set("replay", r)
        forward(True)
        tap.set("zero")
        r.clear()


def _routed_counts(calls: list, n: int) -> list[int]:
    """Routed (token, slot) pairs per expert over ``calls`` (indices outside ``[0, n)`` dropped)."""
    counts = torch.zeros(n, dtype=torch.int64)
    for _x, idx, _w in calls:
        flat = idx.reshape(-1)
        counts += torch.bincount(flat[(flat >= 0) & (flat < n)], minlength=n)[:n].cpu()
    return counts.tolist()


def _record(layer, tap: ExpertTap, hidden: list, kw: dict, replay=None) -> tuple[list, list]:
    """One forward over ``hidden`` with the tap recording: ``(the tap's calls, the layer's
    outputs without the routed part)``; ``replay``: a ModuleReplay whose kept outputs stand in."""
    calls = tap.set("record")
    outs = []
    with replay.active(record=False) if replay is not None else nullcontext():
        for j, h in enumerate(hidden):
            if replay is not None:
                replay.start_batch(j)
            outs.append(layer_forward(layer, h, kw))
    tap.set("zero")
    return calls, outs


def _spilled(calls: list, spill, tag: str) -> list:
    """``calls`` with their expert inputs through ``spill`` (``LayerContext.spill``, tagged ``tag``) when given."""
    if spill is None or not calls:
        return calls
    xs = spill([x for x, _, _ in calls], f"moe-{tag}")
    return [(x, idx, w) for x, (_, idx, w) in zip(xs, calls)]


def _zeros(calls: list, spill, tag: str) -> list[torch.Tensor]:
    """One zero ``[N, H]`` accumulator per recorded call (through ``spill`` when given)."""
    out = [torch.zeros_like(x) for x, _, _ in calls]
    return spill(out, f"moe-{tag}") if spill is not None and out else out


def quantize_layer_streamed(i: int, layer, hidden: list, kw: dict, ctx, algorithm, groups, tap: ExpertTap,
                            device, rebalance=None, share=None) -> LayerOutcome:
    """Decoder layer ``i``'s step with its routed experts streamed (the module docstring's steps
    1-4), for :func:`compressor.pipeline._quantize_and_recompute`. ``groups``: the generator of
    :meth:`compressor.staging.LayerWriter.load_groups`, its first group (the non-expert tensors)
    already read; ``tap``: active on the layer's experts; ``rebalance(share)``: makes ``groups`` read
    this rank's experts of ``share`` (:meth:`compressor.staging.LayerWriter.rebalance`); ``share``: the
    :class:`~compressor.moe_ranks.ExpertShare` already chosen and read (AWQ's steps). Leaves the
    tap replaying the routed output of each batch for the driver's recompute.

    Returns:
        The algorithm's :class:`LayerOutcome` over the whole layer (errors of every linear,
        routed counts, figures with ``weight_groups``, the float reference with its routed part).
    """
    arch, samples = ctx.arch, ctx.samples  # samples: this rank's batches (compressor.sample_ranks)

    def every(calls: list, tag: str) -> list:  # every batch's calls (each rank's sent to all), spilled
        return _spilled(samples.gather_calls(calls) if samples is not None else calls, ctx.spill, tag)

    ref_calls = ref_base = float_calls = None
    n_ref = algorithm.reference_sequences(ctx)
    if n_ref:  # the float layer on the step's first sequences (their batch shape too): output_rel_error's reference
        if samples is None or samples.rank == 0:  # batch 0 is rank 0's
            ref_calls, ref_base = _record(layer, tap, [hidden[0][:n_ref]], kw)
        ref_calls = samples.from_rank0(ref_calls) if samples is not None else ref_calls
    if algorithm.keeps_float_stream(ctx):  # GPTAQ: the float model's expert inputs, before anything is quantized
        float_calls = every(_record(layer, tap, ctx.float_hidden if ctx.float_hidden is not None else hidden, kw)[0],
                            "s")
    float_layer = None  # GPTQ without true_sequential: the experts read the float layer's hidden states
    if algorithm.experts_read_float_layer(ctx):
        float_layer = every(_record(layer, tap, hidden, kw)[0], "f")
    sub = dataclasses.replace(ctx, targets={n: m for n, m in ctx.targets.items()
                                            if not is_expert(arch, n[len(f"{arch.layers}.{i}."):])})
    outcome = algorithm.quantize_layer(i, layer, hidden, kw, sub)  # the non-expert linears; the tap answers zeros
    ctx.float_hidden = sub.float_hidden
    calls = every(_record(layer, tap, hidden, kw, outcome.replay)[0], "q")
    inputs_from = float_layer if float_layer is not None else calls  # what the expert's step reads
    del float_layer
    counts = _routed_counts(inputs_from, len(tap.experts))
    cold = ctx.cold(counts)
    routed = _zeros(calls, ctx.spill, "routed")
    ref_routed = _zeros(ref_calls or [], None, "")
    float_routed = _zeros(float_calls or [], ctx.spill, "float-routed")
    # torchrun: this rank's experts (compressor.moe_ranks); solved from their tokens and not yet read:
    # blocks of about equal work (AWQ's steps chose theirs after their observe: compressor.moe_stream_awq)
    weighed = share is None and rebalance is not None and not getattr(algorithm, "per_linear", False)
    if share is None:
        share = ExpertShare.of(algorithm, len(tap.experts), expert_costs(counts, cold) if weighed else None, weighed)
    if weighed and share.size > 1:
        rebalance(share)
    accs = ((calls, routed, ctx.spill), (ref_calls or [], ref_routed, None),
            (float_calls or [], float_routed, ctx.spill))
    sinks = [share.sink(c, out, sp, str(k)) for k, (c, out, sp) in enumerate(accs)]  # the accumulators, on rank 0
    parts, peak, n_groups = [], [0.0], 0
    for modules in groups:
        n_groups += 1
        for e in sorted({expert_index(arch, m[len(f"{arch.layers}.{i}."):]) for m in modules}):
            expert = tap.experts[e]
            move_loaded(expert, device)
            if hasattr(algorithm, "ready_expert"):  # AWQ: the expert's folds, just before its use (one held at a time)
                algorithm.ready_expert(e)
            add_expert(expert, e, ref_calls or [], share.target(e, sinks[1]))
            add_expert(expert, e, float_calls or [], share.target(e, sinks[2]))
            rels = [f"{arch.moe.experts}.{e}.{n}" for n, m in expert.named_modules() if isinstance(m, torch.nn.Linear)]
            inputs = [x[torch.where(idx == e)[0]] for x, idx, _ in inputs_from]
            with share.solo():
                part = algorithm.quantize_expert(i, layer, rels, [x for x in inputs if x.shape[0]], e in cold, ctx)
            parts.append((part.errs, part.figures))
            add_expert(expert, e, calls, share.target(e, sinks[0]), peak)
    for (_c, out, _sp), sink in zip(accs, sinks):
        share.combine(out, sink)
    parts, peak[0], n_groups = share.merge(parts, peak[0], n_groups)
    outcome.errs = list(outcome.errs) + [x for p in parts for x in p[0]]
    outcome.counts, outcome.linear_peak = counts, peak[0]
    outcome.figures = {**algorithm.merge_expert_figures(outcome.figures, [p[1] for p in parts]),
                       "weight_groups": 1 + n_groups}
    own = samples.own if samples is not None else lambda batches: batches  # this rank's batches of every batch's
    if outcome.float_out is not None:
        rows = outcome.float_out.shape[0]
        full = ref_base[0] + ref_routed[0].view_as(ref_base[0])
        outcome.float_out = full[:rows] if rows <= full.shape[0] else None
    if float_calls is not None:
        fh = [f + r.view_as(f) for f, r in zip(ctx.float_hidden, own(float_routed))]
        ctx.float_hidden = ctx.spill(fh, "float") if ctx.spill is not None else fh
    tap.set("replay", own(routed))
    return outcome

