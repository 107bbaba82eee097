"""GPTQ (Frantar et al., 2022, arXiv:2210.17323) as a per-layer handler of the sequential driver.

The Hessian and the column-by-column solve are in :mod:`compressor.quant.gptq`; this
module owns the hooks: one Hessian per set of linears reading the same input (fused
sets), stage by stage (``true_sequential``: later stages see the earlier stages'
quantized outputs) or all at once. The solves of a pass are dealt to the ranks
(:func:`compressor.distributed.deal`). Cold MoE experts (too few routed tokens) and sets
that saw no token fall back to RTN. A pass over routed experts whose Hessians exceed the
memory budget is taken in chunks (:func:`hessian_chunks`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from ..arch import EXPERT, expand, expert_index, get_module, is_expert, layer_fused_sets, layer_linears, num_experts
from ..distributed import deal, recv, send, world
from ..registry import FORMATS
from .algorithms import Algorithm, odd_bits_warnings, register_algorithm, share_fp4_absmax, unread_warnings
from .gptq import CrossAccumulator, HessianAccumulator, float_target, gptq_quantize
from .layer import LayerContext, LayerOutcome, StopForward, layer_forward
from .refine import refined_layer
from .replay import ModuleReplay


def reader_sets(stage: list[str], fused_sets: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
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


def _passes(i, layer, ctx: LayerContext) -> list[list[str]]:
    """The targeted linears of layer ``i`` (relative names) per Hessian pass."""
    arch = ctx.arch
    prefix = f"{arch.layers}.{i}."
    n_exp = num_experts(arch, layer)
    present = set(layer_linears(arch, layer))
    stages = [[r for pat in st for r in expand(pat, n_exp) if r in present and prefix + r in ctx.targets]
              for st in arch.sequential]
    stages = [st for st in stages if st]
    return stages if ctx.recipe.gptq.true_sequential else [[r for st in stages for r in st]]


#: bytes held per input feature squared for one reader set between its accumulation and its
#: solve: the float64 running sum (8) and the float32 Hessian built from it (4)
HESSIAN_BYTES = 12


def hessian_chunks(layer, sets: list[tuple[str, ...]], budget: int | None) -> list[list[tuple[str, ...]]]:
    """Split a pass's reader sets into chunks whose Hessians (:data:`HESSIAN_BYTES` x
    ``in_features``\ :sup:`2` each) fit in ``budget`` bytes (at least one set a chunk; one
    chunk when ``budget`` is ``None`` or everything fits).

    Each chunk is accumulated in a calibration pass of its own and solved before the next is
    accumulated. Used for routed experts, whose Hessians are independent of each other: an
    expert's gate/up read the MoE block's input (which no expert's weights change) and its
    down_proj reads its own gate/up's output, so the chunks give the same Hessians, and the
    same artifact, as one pass over all the sets (``tests/test_moe_gptq_chunks``); only the
    layer's forward runs once more per chunk. At Kimi K2's hidden size (7168) one gate/up set
    holds 0.6 GB, so 384 experts in one pass would hold 237 GB.
    """
    if budget is None:
        return [sets]
    sizes = [HESSIAN_BYTES * get_module(layer, st[0]).in_features ** 2 for st in sets]
    if sum(sizes) <= budget:
        return [sets]
    chunks: list[list[tuple[str, ...]]] = [[]]
    held = 0
    for st, b in zip(sets, sizes):
        if chunks[-1] and held + b > budget:
            chunks.append([])
            held = 0
        chunks[-1].append(st)
        held += b
    return chunks


def accumulate_hessians(layer, hidden, kw, sets, conditional: bool, replay: ModuleReplay | None = None,
                        float_inputs: dict | None = None, samples=None):
    """One calibration pass with input hooks: a :class:`HessianAccumulator` per reader set
    (keyed by its first linear). Without ``conditional`` (routed experts fire only for their
    tokens) a batch stops once every set has its input. ``replay``: the layer's final parts
    return their kept outputs instead of running. ``float_inputs``: set key -> the float
    model's input of that set per batch; each such set also gets a :class:`CrossAccumulator`
    (``accs[key].cross``) for :func:`~compressor.quant.gptq.float_target`. Under several ranks
    each rank sums its share of each Hessian's row blocks (:func:`share_hessians` completes them).
    ``samples`` (:class:`compressor.sample_ranks.Samples`): ``hidden`` (and ``float_inputs``) are this
    rank's batches; each batch's set inputs are broadcast from its rank and added on every rank in
    batch order (:meth:`~compressor.sample_ranks.Samples.rounds`), the one-process sums bit for bit."""
    ranks = world()  # every rank runs this pass on the same tokens: the Hessians' blocks are divided
    accs = {st[0]: HessianAccumulator(get_module(layer, st[0]).in_features, hidden[0].device, ranks) for st in sets}
    float_inputs = float_inputs or {}
    for key in float_inputs.keys() & accs.keys():
        accs[key].cross = CrossAccumulator(accs[key].in_features, hidden[0].device)
    fired: set[str] = set()
    kept: list = []  # with samples: the batch's set inputs, after each set's float input (key "\0" + set)
    j = 0

    def add(rel: str, x: torch.Tensor, fx: torch.Tensor | None) -> None:
        accs[rel].add(x)
        if accs[rel].cross is not None:
            accs[rel].cross.add(fx, x)

    def make_hook(rel):
        def hook(_mod, args):
            fx = float_inputs[rel][j] if accs[rel].cross is not None else None
            if samples is None:
                add(rel, args[0], fx)
            else:
                kept.extend([("\0" + rel, fx)] if fx is not None else [])
                kept.append((rel, args[0].detach()))
            fired.add(rel)
            if not conditional and len(fired) == len(accs):
                raise StopForward
        return hook

    def run(k: int, h: torch.Tensor) -> list:
        """Batch ``k`` of ``hidden`` through the layer, its hooks firing; returns what they kept."""
        nonlocal j
        j = k
        if replay is not None:
            replay.start_batch(k)
        fired.clear()
        kept.clear()
        try:
            layer_forward(layer, h, kw)
        except StopForward:
            pass
        return list(kept)

    floats: dict = {}

    def consume(_j: int, key: str, x: torch.Tensor) -> None:  # every rank's batches, in batch order
        if key.startswith("\0"):
            floats[key[1:]] = x
        else:
            add(key, x, floats.pop(key, None))

    handles = [get_module(layer, key).register_forward_pre_hook(make_hook(key)) for key in accs]
    try:
        with replay.active() if replay is not None else nullcontext():
            if samples is not None:
                samples.rounds(hidden, run, consume)
            for k, h in enumerate(hidden if samples is None else []):
                run(k, h)
    finally:
        for hd in handles:
            hd.remove()
    return accs


#: calibration sequences GPTQ's output-error figure is taken on (fewer when the first batch has fewer; the
#: recipe's ``awq.loss_samples`` is AWQ's and not read here): the float layer's output on them is one more
#: forward of those sequences alone (2 of 16 at 16 x 512)
REF_SEQUENCES = 2


#: the linears of one reader set that share a scheme are solved as one matrix (their rows
#: stacked: GPTQ treats every row alone given ``H``, so the integers and scales are the same)
#: while the stacked float32 rows stay under this many bytes; larger ones (a Kimi K2 routed
#: expert's gate/up: 2 x 2048 x 7168) are solved one by one, holding one copy at a time
BATCH_BYTES = 64 << 20


def _batches(layer, st: tuple[str, ...], schemes: dict, prefix: str) -> list[tuple[str, ...]]:
    """Split reader set ``st`` into runs of linears solved together (same scheme, stacked rows
    under :data:`BATCH_BYTES`), in the set's order. Under several ranks every linear is a task
    of its own: dealing them to the ranks is the faster way there."""
    if world()[1] > 1:
        return [(rel,) for rel in st]
    out: list[list[str]] = []
    held = 0
    for rel in st:
        lin = get_module(layer, rel)
        size = 4 * lin.out_features * lin.in_features
        e2m1 = schemes[prefix + rel].is_fp4 or schemes[prefix + rel].is_mxfp4  # NVFP4: its own global scale
        if out and not e2m1 and schemes[prefix + rel] == schemes[prefix + out[-1][0]] and held + size <= BATCH_BYTES:
            out[-1].append(rel)
            held += size
        else:
            out.append([rel])
            held = size
    return [tuple(b) for b in out]


def solve_pass(i, layer, sets, accs, cold, ctx: LayerContext, folds=None):
    """Quantize one pass's reader sets: RTN for cold experts, sets without tokens and FP8 sets (a mixed
    recipe's: :mod:`compressor.recipe_mixed`), GPTQ (dealt to the ranks) for the rest, the linears of a set
    that share a scheme solved as one stacked matrix (:func:`_batches`). ``folds``: ``(col_scale, row_scale,
    originals)`` of an AWQ-scaled layer (``awq-gptq``), so each weight error is measured against the weight
    before folding. Returns ``(errs, damps, retries, dead_channels)``."""
    col_scale, row_scale, originals = folds or ({}, {}, {})
    arch, quantizer, opts = ctx.arch, ctx.quantizer, ctx.recipe.gptq
    prefix = f"{arch.layers}.{i}."
    errs, damps, retries, dead = [], [], 0, 0
    tasks = []  # (linears solved together, their set's key): the solves of this pass, dealt to the ranks
    share_fp4_absmax(i, [r for st in sets for r in st], ctx)  # NVFP4: global scales before any set is solved
    for st in sets:
        e = expert_index(arch, st[0])
        sch = quantizer.schemes[prefix + st[0]]
        fp8 = sch.is_float and sch.num_bits == 8  # the e4m3 grid: RTN (GPTQ on it is not implemented)
        if (e is not None and e in cold) or accs[st[0]].n == 0 or fp8:
            for rel in st:  # RTN fallback: too few routed tokens for a Hessian, or FP8
                name = prefix + rel
                ctx.modules[name], err = quantizer.quantize_linear(name, get_module(layer, rel), None, col_scale.get(rel),
                                                                   originals.get(rel), row_scale.get(rel))
                errs.append(err)
            continue
        tasks += [(b, st[0]) for b in _batches(layer, st, quantizer.schemes, prefix)]
    # each set's Hessian is built when its first batch is solved and handed, to be worked on
    # in place, to its last: one Hessian alive at a time besides the float64 sums not reached yet
    rank, size = world()
    pieces = row_slices(tasks, size, lambda rel: get_module(layer, rel).out_features,
                        lambda rel: expert_index(arch, rel) is not None)
    left: dict[str, int] = {}
    for j, (_rels, key, _rows) in enumerate(pieces):
        if j % size == rank:
            left[key] = left.get(key, 0) + 1
    share_hessians(accs, pieces, size)
    built: dict = {}
    factors: dict = {}  # per set: its Hessian's factor, reused by the set's other linears (HessianFactor)

    def solve(piece):
        rels, key, rows = piece
        bits, gs, sym = quantizer.schemes[prefix + rels[0]][:3]
        if key not in built:
            acc = accs.pop(key)
            built[key] = (acc.hessian(consume=True), None if acc.cross is None else acc.cross.matrix())
            del acc
        left[key] -= 1
        last = left[key] == 0
        H, cross = built.pop(key) if last else built[key]
        weights = [get_module(layer, rel).weight.detach() for rel in rels]
        w = weights[0] if len(weights) == 1 else torch.cat(weights)
        del weights
        if rows is not None:
            w = w[rows[0]:rows[1]]
        if cross is not None:  # asymmetric calibration: the float model's output is the target
            w = float_target(w, H, cross, opts.gptaq_alpha, opts.damp)
        del cross
        e2m1 = quantizer.e2m1_grid(prefix + rels[0], w)  # NVFP4 / MXFP4: the steps, fixed before any column
        r = gptq_quantize(
            w, H, bits, gs, sym, block_size=opts.block_size, damp=opts.damp,
            damp_increment=opts.damp_increment, act_order=opts.act_order,
            static_groups=opts.static_groups, scale_dtype=quantizer.dtype, name=" + ".join(prefix + x for x in rels),
            consume_hessian=last, clip_grid=opts.clip_grid if opts.clip else None, clip_max_shrink=opts.clip_max_shrink,
            keep_target=ctx.bases is not None, factors=factors.pop(key, None) if last else factors.setdefault(key, {}),
            collective=rows is not None,  # every rank holds a slice of this linear: they factor H together
            e2m1_steps=None if e2m1 is None else e2m1[0],
        )
        if e2m1 is not None:  # the format's stored scales in place of the steps (Quantizer.finish)
            r.scale, r.zero_point = e2m1[1], e2m1[2]
        del H, w
        if rows is not None:  # one linear's slice of rows: joined with the other slices below
            return [(r.q, r.scale, r.zero_point, r.g_idx, r.target)], r.damp, r.retries, r.dead_channels
        out, r0 = [], 0
        for rel in rels:  # each linear's rows of the stacked result
            r1 = r0 + get_module(layer, rel).out_features
            part = (r.q[r0:r1], r.scale[r0:r1], r.zero_point[r0:r1])
            out.append((*(t.clone() if len(rels) > 1 else t for t in part), r.g_idx,  # no storage shared between records
                        None if r.target is None else r.target[r0:r1]))
            r0 = r1
        return out, r.damp, r.retries, r.dead_channels

    for (rels, _key), (parts, damp, r_retries, r_dead) in zip(tasks, join_slices(pieces, deal(pieces, solve))):
        for rel, (q, scale, zp, g_idx, target) in zip(rels, parts):
            name = prefix + rel
            lin = get_module(layer, rel)
            original = lin.weight.detach().float().clone() if target is not None else None
            ctx.modules[name], err = quantizer.finish(name, lin, q, scale, zp, g_idx,
                                                      col_scale.get(rel), originals.get(rel), row_scale.get(rel))
            errs.append(err)
            if target is not None:  # kept for the layer's refinement (compressor.quant.refine)
                ctx.bases[name] = (target, original, err)
            damps.append(damp)
            retries += r_retries
            dead += r_dead
    del tasks
    return errs, damps, retries, dead


def share_hessians(accs: dict, pieces: list[tuple], size: int) -> None:
    """Complete the Hessians whose row blocks the ranks summed apart (:func:`accumulate_hessians`):
    each block goes from the rank that summed it to every other rank that solves a piece of its
    set (piece ``j`` on rank ``j % size``, as :func:`~compressor.distributed.deal` deals them),
    point to point, float64, in the pieces' order of sets and block order on every rank. A
    block is the same sum whichever rank made it, so the Hessians are one process's bit for
    bit. A rank keeps only the sets it solves (the others' blocks are released)."""
    need: dict[str, set[int]] = {}
    for j, (_rels, key, _rows) in enumerate(pieces):
        need.setdefault(key, set()).add(j % size)
    for key, solvers in need.items():
        acc = accs[key]
        if acc.complete:
            continue
        rank = acc.ranks[0]
        for i, block in enumerate(acc.blocks):
            owner = i % size
            for dst in sorted(solvers - {owner}):
                if rank == owner:
                    send(block, dst)
                elif rank == dst:
                    recv(block, owner)
        acc.complete = rank in solvers
        if not acc.complete:
            acc.blocks = None


def row_slices(tasks: list, size: int, rows_of, whole=lambda rel: False) -> list[tuple]:
    """The pieces a pass's GPTQ solves are dealt in under ``size`` ranks: each task's rows in
    ``size`` contiguous slices ``(rels, key, (r0, r1))``, one per rank, or ``(rels, key, None)``
    for a task solved whole on one rank (round-robin, :func:`~compressor.distributed.deal`).
    GPTQ quantizes every row on its own given ``H`` (the column loop, static groups, act_order's
    permutation and the damping retries depend on ``H`` alone), so a slice's integers and scales
    are those rows of the whole solve, bit for bit (``tests/test_gptq.py``); every rank holds
    ``H``, and the ranks divide its inverse Cholesky factor's blocks
    (:func:`~compressor.quant.inplace_linalg.upper_cholesky_of_inverse_`, once per set: the
    set's other linears reuse it) and the column loop. Slicing every linear of a set, rather
    than dealing the set's linears whole, keeps one rank from factoring the same ``H`` as
    another (a DeepSeek-V3 layer's ``q_a_proj`` and ``kv_a_proj_with_mqa``: 7168 wide, 1536 and
    576 rows; dealt whole, both ranks factored it and one had 2.7x the other's column loop).
    ``whole(rel)``: a linear kept whole unless the pass has fewer tasks than ranks (routed
    experts of a layer loaded whole: each expert its own ``H``, dealt as tasks); a linear of
    fewer than ``2 * size`` rows is kept whole. ``rows_of(rel)``: a linear's output rows. Under
    several ranks every task is one linear."""
    if size < 2:
        return [(rels, key, None) for rels, key in tasks]
    out = []
    for rels, key in tasks:
        n = rows_of(rels[0])
        if len(rels) != 1 or n < 2 * size or (whole(rels[0]) and len(tasks) >= size):
            out.append((rels, key, None))
            continue
        out += [(rels, key, (n * k // size, n * (k + 1) // size)) for k in range(size)]
    return out


def join_slices(pieces: list[tuple], results: list) -> list:
    """The per-task results of :func:`solve_pass` from its pieces' (:func:`row_slices`): a task's
    slices joined along the rows (``g_idx``, the damping figures: the first slice's, the same
    ``H`` giving the same on every slice)."""
    out: list = []
    for (rels, key, rows), res in zip(pieces, results):
        if rows is None or rows[0] == 0:
            out.append(res)
            continue
        (q, scale, zp, g_idx, target), = out[-1][0]
        (q2, scale2, zp2, _, target2), = res[0]
        joined = (torch.cat([q, q2]), torch.cat([scale, scale2]), torch.cat([zp, zp2]), g_idx,
                  None if target is None else torch.cat([target, target2]))
        out[-1] = ([joined], *out[-1][1:])
    return out


def layer_replay(layer, passes: list[list[str]], ctx: LayerContext) -> tuple[ModuleReplay | None, dict[str, int]]:
    """The layer's :class:`~compressor.quant.replay.ModuleReplay` and the pass from which each
    replayed part is final (relative path -> pass index; ``len(passes)``: the recompute).

    The passes follow the layer's forward order (the architecture row's ``sequential``
    stages), so once the last pass holding one of a direct child's linears is solved, the
    child's weights and inputs are final: it is kept from the next pass on, when that pass
    exists (the attention, for the MLP passes and the recompute). A linear is kept from the
    pass after its own when a later forward runs it again: a pass that still runs its child
    in full (q/k/v while the attention is computed for the MLP's first pass), or the
    recompute when its child is never kept (gate/up). ``(None, {})`` with one pass (nothing
    is final before the recompute) or when ``ctx.replay_budget`` is 0."""
    n = len(passes)
    if n < 2 or ctx.replay_budget == 0:
        return None, {}
    pass_of = {rel: p for p, group in enumerate(passes) for rel in group}
    last: dict[str, int] = {}
    for rel, p in pass_of.items():
        child = rel.split(".")[0]
        last[child] = max(last.get(child, -1), p)
    final_from = {child: p + 1 for child, p in last.items() if p + 1 < n}
    for rel, p in pass_of.items():
        child = rel.split(".")[0]
        if rel != child and p + 1 < n and (p + 2 <= last[child] + 1 or last[child] + 1 >= n):
            final_from[rel] = p + 1
    return ModuleReplay(layer, ctx.replay_budget), final_from


def _settle(replay: ModuleReplay | None, final_from: dict[str, int], p_i: int, n_batches: int) -> None:
    """Before pass ``p_i`` (``len(passes)``: the recompute): mark the parts final from it, and
    release the linears whose child is kept for every batch (nothing runs them any more)."""
    if replay is None:
        return
    replay.finalize([part for part, p in final_from.items() if p <= p_i])
    replay.release([part for part in list(replay.final) if "." in part
                    and replay.complete(part.split(".")[0], n_batches)])


def gptq_layer(i: int, layer, hidden: list, kw: dict, ctx: LayerContext, folds=None, float_out=None) -> LayerOutcome:
    """GPTQ for decoder layer ``i``: the float layer's output on the first :data:`REF_SEQUENCES`
    calibration sequences (the output-error figure), then per pass, accumulate the Hessians
    and solve (``folds``: see :func:`solve_pass`; ``float_out``: the float layer's output when
    the caller has it already, as ``awq-gptq`` does from AWQ's observe pass)."""
    arch = ctx.arch
    t_r = time.perf_counter()
    samples = ctx.samples  # this rank's share of the batches (compressor.sample_ranks): the figure is rank 0's
    if float_out is None and (samples is None or samples.rank == 0):  # the output-error figure's reference,
        float_out = layer_forward(layer, hidden[0][:REF_SEQUENCES], kw)  # before anything is quantized
    ref_t = time.perf_counter() - t_r
    fused_sets = layer_fused_sets(arch, layer)
    experts = ctx.experts(layer)
    counts: list[int] | None = None
    errs, damps, retries, dead = [], [], 0, 0
    hess_t = quant_t = 0.0
    n_chunks = 0
    passes = _passes(i, layer, ctx)
    t_f = time.perf_counter()
    float_inputs = float_stream(layer, hidden, kw, ctx, [st[0] for g in passes for st in reader_sets(g, fused_sets)])
    float_t = time.perf_counter() - t_f
    replay, final_from = layer_replay(layer, passes, ctx)
    for p_i, group in enumerate(passes):
        _settle(replay, final_from, p_i, len(hidden))
        sets = reader_sets(group, fused_sets)
        conditional = any(is_expert(arch, r) for r in group)  # experts fire only for routed tokens: no early stop
        chunks = hessian_chunks(layer, sets, ctx.hessian_budget) if conditional else [sets]
        n_chunks += len(chunks) - 1
        for c_i, chunk in enumerate(chunks):
            t_h = time.perf_counter()
            if experts is not None:
                experts.counts.zero_()
            accs = accumulate_hessians(layer, hidden, kw, chunk, conditional, replay, float_inputs, samples)
            if conditional and counts is None and experts is not None:
                counts = experts.counts.tolist()  # routing is upstream of the experts: the same in every chunk
            cold = ctx.cold(counts)
            hess_t += time.perf_counter() - t_h
            t_q = time.perf_counter()
            p_errs, p_damps, p_retries, p_dead = solve_pass(i, layer, chunk, accs, cold, ctx, folds)
            del accs  # before the next chunk's pass builds its own
            for st in chunk if float_inputs is not None else ():
                float_inputs.pop(st[0], None)  # the set's float inputs are not read again
            errs += p_errs
            damps += p_damps
            retries += p_retries
            dead += p_dead
            quant_t += time.perf_counter() - t_q
    _settle(replay, final_from, len(passes), len(hidden))  # what the recompute reads
    figures = {"gptq": {"max_damp": max(damps) if damps else None, "damp_retries": retries, "dead_channels": dead}}
    if n_chunks:
        figures["gptq"]["extra_hessian_passes"] = n_chunks  # routed experts' Hessians taken in bounded chunks
    phases = {"reference": ref_t, "hessian": hess_t, "gptq": quant_t}
    if float_inputs is not None:
        phases["float_stream"] = float_t
    return LayerOutcome(errs, float_out, counts, figures, phases, replay)


def gptq_expert(i: int, layer, rels: list[str], inputs: list, cold: bool, ctx: LayerContext,
                folds=None) -> LayerOutcome:
    """GPTQ of one routed expert of decoder layer ``i`` (its linears ``rels``) from ``inputs``, the
    hidden states routed to it (``[n_j, H]`` per calibration batch), for a streamed MoE layer
    (:mod:`compressor.moe_stream`). Per pass of :func:`_passes` restricted to the expert (its
    gate/up, then its down_proj with gate/up quantized; one pass without ``true_sequential``), the
    expert runs on each batch's tokens with input hooks on its reader sets and the pass is solved
    (:func:`solve_pass`): the hooks see the tensors the whole layer's passes give them, in the same
    order, so the Hessians and the integers are the same. ``cold``: RTN fallback; ``folds``: see
    :func:`solve_pass` (``awq-gptq``: the expert's AWQ scales, :mod:`compressor.moe_stream_awq`). Figures as
    :func:`gptq_layer`'s ``gptq`` entry (merged by :meth:`GPTQ.merge_expert_figures`)."""
    arch = ctx.arch
    prefix = f"{arch.layers}.{i}."
    e = expert_index(arch, rels[0])
    mine = {r for r in rels if prefix + r in ctx.targets}
    stages = [[r for pat in st for r in [pat.replace(EXPERT, str(e))] if r in mine] for st in arch.sequential]
    stages = [st for st in stages if st]
    passes = stages if ctx.recipe.gptq.true_sequential else [[r for st in stages for r in st]]
    fused = [tuple(r for r in (f.replace(EXPERT, str(e)) for f in fs) if r in mine)
             for fs in arch.fused if any(EXPERT in f for f in fs)]
    module = get_module(layer, rels[0].rsplit(".", 1)[0])
    errs, damps, retries, dead = [], [], 0, 0
    for group in passes:
        sets = reader_sets(group, [f for f in fused if f])
        device = inputs[0].device if inputs else "cpu"
        accs = {st[0]: HessianAccumulator(get_module(layer, st[0]).in_features, device=device) for st in sets}
        handles = [get_module(layer, key).register_forward_pre_hook(lambda _m, args, key=key: accs[key].add(args[0]))
                   for key in accs] if not cold else []
        try:
            for x in inputs if not cold else ():
                module(x)
        finally:
            for hd in handles:
                hd.remove()
        p_errs, p_damps, p_retries, p_dead = solve_pass(i, layer, sets, accs, {e} if cold else set(), ctx, folds)
        errs += p_errs
        damps += p_damps
        retries += p_retries
        dead += p_dead
    return LayerOutcome(errs, figures={"gptq": {"max_damp": max(damps) if damps else None, "damp_retries": retries,
                                                "dead_channels": dead}})


def float_stream(layer, hidden: list, kw: dict, ctx: LayerContext, keys: list[str]) -> dict | None:
    """With ``gptq.gptaq_alpha > 0``: run the layer, still float, on the float model's
    activations (``ctx.float_hidden``; the quantized stream's at the first layer, where the two
    are the same), keep the inputs of the reader sets ``keys`` per batch (routed experts
    excluded: their tokens differ between the streams) and advance ``ctx.float_hidden`` to the
    layer's float output. Returns set key -> ``[batch inputs]``, or None when off. Both go
    through ``ctx.spill`` (``--activation-budget-gib``): above the budget they are memory-mapped
    files, as the quantized stream is."""
    if ctx.recipe.gptq.gptaq_alpha == 0.0:
        return None
    keys = [k for k in keys if not is_expert(ctx.arch, k)]
    source = ctx.float_hidden if ctx.float_hidden is not None else hidden
    kept: dict[str, list] = {k: [] for k in keys}

    def make_hook(rel):
        def hook(_mod, args):
            kept[rel].append(args[0].detach().clone())
        return hook

    handles = [get_module(layer, k).register_forward_pre_hook(make_hook(k)) for k in keys]
    try:
        with torch.no_grad():
            ctx.float_hidden = [layer_forward(layer, h, kw) for h in source]
    finally:
        for hd in handles:
            hd.remove()
    if ctx.spill is not None:
        ctx.float_hidden = ctx.spill(ctx.float_hidden, "float")
        kept = {k: ctx.spill(v, f"float-in{n}") for n, (k, v) in enumerate(kept.items())}
    return kept


@register_algorithm
class GPTQ(Algorithm):
    """GPTQ with a streamed Hessian per reader set; needs calibration."""

    name = "gptq"
    reads = ("gptq", "refine")
    needs_calibration = True
    act_order = True
    fp4_grid = True  # NVFP4 and MXFP4: each column rounded onto the format's fixed steps (Quantizer.e2m1_grid)
    fp8_fallback = True  # FP8 modules of a mixed recipe: RTN (solve_pass)
    streams_experts = experts_per_rank = True

    def divides_samples(self, ctx):
        return ctx.recipe.refine is None  # the refinement reads every batch (AWQ+GPTQ's observe divides)

    def quantize_layer(self, i, layer, hidden, kw, ctx):
        if ctx.recipe.refine is not None:  # the layer's GPTQ result refined on its output (compressor.quant.refine)
            return refined_layer(i, layer, hidden, kw, ctx, gptq_layer)
        return gptq_layer(i, layer, hidden, kw, ctx)

    def quantize_expert(self, i, layer, rels, inputs, cold, ctx):
        return gptq_expert(i, layer, rels, inputs, cold, ctx)

    def merge_expert_figures(self, figures, parts):
        g = dict(figures.get("gptq", {}))
        damps = [d for d in [g.get("max_damp")] + [p["gptq"]["max_damp"] for p in parts] if d is not None]
        g.update(max_damp=max(damps) if damps else None,
                 damp_retries=g.get("damp_retries", 0) + sum(p["gptq"]["damp_retries"] for p in parts),
                 dead_channels=g.get("dead_channels", 0) + sum(p["gptq"]["dead_channels"] for p in parts))
        return {**figures, "gptq": g}

    def reference_sequences(self, ctx):
        return REF_SEQUENCES

    def experts_read_float_layer(self, ctx):
        return not ctx.recipe.gptq.true_sequential

    def keeps_float_stream(self, ctx):
        return ctx.recipe.gptq.gptaq_alpha != 0.0

    def summary_fields(self, recipe, fmt):
        out = {"act_order": recipe.gptq.act_order, "static_groups": recipe.gptq.static_groups}
        if recipe.gptq.clip:  # the range search; left out while off (earlier manifests keep their bytes)
            out.update(clip=True, clip_grid=recipe.gptq.clip_grid, clip_max_shrink=recipe.gptq.clip_max_shrink)
        if recipe.gptq.gptaq_alpha:  # the float target; left out while off, as the range search
            out["gptaq_alpha"] = recipe.gptq.gptaq_alpha
        if recipe.refine is not None and "refine" in self.reads:  # the block-wise refinement; left out while off
            out["refine"] = recipe.refine.model_dump()
        return {**out, **FORMATS.get(fmt).summary_fields(recipe)}

    def flag_warnings(self, flags, recipe, fmt):
        return odd_bits_warnings(recipe, fmt) + unread_warnings(self, recipe)

    def run_warnings(self, layers):
        raised = [f for f in layers if f.get("gptq", {}).get("damp_retries")]
        if not raised:
            return []
        worst = max(f["gptq"]["max_damp"] for f in raised)
        return [f"GPTQ raised the damping in {len(raised)} layer(s) (Hessian not positive definite; largest damp {worst:.4g}); "
                "see quality.layers[].gptq in the manifest"]
