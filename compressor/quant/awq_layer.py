"""AWQ (Lin et al., 2023, arXiv:2306.00978) as a per-layer handler of the sequential driver.

The math (scale and clip searches) is in :mod:`compressor.quant.awq`; this module owns the
hooks and the layer's state, in named steps:

1. :func:`~compressor.quant.awq_observe.observe` -- mean ``|x|`` per input channel over every calibration token a module
   sees, the full inputs of the first ``loss_n`` sequences, the float layer's output;
2. :func:`search_group_scales` -- one scaling group's scales (grid search on the inspected
   module's output error);
3. :func:`fold_group` / :func:`fold_scales` -- the scales folded into the preceding op and
   the group's linears (the float function is unchanged);
4. :func:`clip_and_quantize` -- clip search and RTN with the clipped range;
5. the driver recomputes the layer's outputs with the quantized weights.

Cold MoE experts (too few routed tokens) get no scaling group of their own and no
clipping: RTN, still sharing the layer's input scaling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..arch import expert_index, get_module, layer_groups, layer_linears
from ..distributed import deal, world
from .algorithms import Algorithm, fused_peers, register_algorithm, share_fp4_absmax
from .awq import MXFP4, NVFP4, pick_scale, search_clip, search_scale_range, tie_kv_heads
from .awq_observe import observe
from .layer import LayerContext, LayerOutcome, inspect_forward, layer_forward


def fold_scales(prev, s: torch.Tensor, prev_rows, norm_offset: float,
                storage: torch.dtype | None = None) -> torch.Tensor | None:
    """Divide ``prev``'s output by ``s [C]`` in its weights (exactly); returns the per-row
    scale ``[out]`` of a linear ``prev`` (``None`` for a norm).

    ``prev_rows``: ``(k, n)`` when only chunk ``k`` of ``n`` of a linear's output rows
    feeds the group (GLM-4's fused ``gate_up_proj``), else ``None``; ``norm_offset``: 1 for
    ``(1 + weight)`` norms (Gemma), else 0; ``storage``: the artifact's dtype: a folded
    norm weight is rounded to it in place, so the recomputed layer outputs (and the
    output error quantize reports) are those of the stored model (a ``(1 + w)`` norm
    folded next to ``w = -1`` keeps few bits in bfloat16).
    """
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
    folded = (w.float() + norm_offset) / s.to(w.device) - norm_offset
    w.copy_((folded if storage is None else folded.to(storage)).to(w.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.data.div_(s.to(prev.bias))
    return None


#: apply the v_proj -> o_proj group under GQA (scales tied per KV head, :func:`kv_repeat`). Off:
#: measured on SmolLM2-135M (W4 g64, 8 x 512 calibration, 4 windows of wiki.test.raw) it cost
#: perplexity (29.03 vs 28.64) for a slightly lower KL (0.1458 vs 0.1479); the fold is exact
#: and tested, kept for the quality work of issue #18. The skip is not silent: each layer's
#: ``awq_skipped`` figure names the group and why, and the run warns (:meth:`AWQ.run_warnings`)
GQA_V_TO_O = False


def group_name(group) -> str:
    """A scaling group as the manifest names it: ``self_attn.v_proj -> self_attn.o_proj``."""
    shown = group.linears if len(group.linears) <= 4 else group.linears[:2] + (f"... ({len(group.linears)} linears)",)
    return f"{group.prev_op} -> {', '.join(shown)}"


def search_group_scales(layer, group, prefix, linears, x_loss, x_mean, cold, kw, ctx: LayerContext):
    """AWQ scales of one scaling group: ``(s [in] float32, best ratio, input key)``; ``None`` when
    there is nothing to scale (no linear of it targeted, a cold expert's own group: its RTN
    fallback is recorded in ``quality.moe``); or, when a targeted group is left unscaled, the
    reason (a ``str``: grouped-query attention with :data:`GQA_V_TO_O` off, shapes that do not
    chain, no token among the loss samples), which the layer's figures record."""
    search = prepare_group_search(layer, group, prefix, linears, x_loss, x_mean, cold, kw, ctx)
    if search is None or isinstance(search, str):
        return search
    s, ratio = pick_scale([search.run(range(ctx.recipe.awq.n_grid))], search.name)
    return s, ratio, search.key


@dataclass
class GroupSearch:
    """One scaling group's scale search, ready to try grid points (:func:`prepare_group_search`):
    the arguments of :func:`compressor.quant.awq.search_scale_range` but the points."""
    key: str
    name: str
    x_mean: torch.Tensor
    weights: list
    loss_fn: object
    schemes: tuple
    n_grid: int
    duo_scaling: bool
    tie: object
    e2m1: tuple | None = None  #: ``(grids, sets)`` of FP4 weights (:func:`e2m1_grids`)

    def run(self, points: range) -> tuple | None:
        """The pick of grid points ``points`` (:func:`compressor.quant.awq.search_scale_range`)."""
        return search_scale_range(self.x_mean, self.weights, self.loss_fn, *self.schemes, points, self.n_grid,
                                  self.duo_scaling, self.tie, self.e2m1)[1]


def e2m1_grid(scheme) -> str | None:
    """The e2m1 grid a weight scheme rounds on (:data:`~compressor.quant.awq.NVFP4`,
    :data:`~compressor.quant.awq.MXFP4`), ``None`` for an integer scheme."""
    return NVFP4 if scheme.is_fp4 else MXFP4 if scheme.is_mxfp4 else None


def e2m1_grids(arch, rels: list, specs: list, quantized: list) -> tuple[list, list] | None:
    """``(grids, sets)`` for :func:`compressor.quant.awq.candidate_weights` of linears ``rels`` (relative names) with
    weight schemes ``specs``: each one's e2m1 grid, and for a targeted NVFP4 linear its fused set
    (:func:`compressor.quant.algorithms.fused_peers`: its candidates' global scale is the set's, as the writer's);
    ``None`` when every scheme is an integer one. Every fused set of kvq's architecture rows lies inside one
    scaling group, so a set's members are scaled by the same candidate."""
    grids = [e2m1_grid(sp) for sp in specs]
    if not any(grids):
        return None
    return grids, [fused_peers(arch, r) if q and g == NVFP4 else None for r, g, q in zip(rels, grids, quantized)]


def prepare_group_search(layer, group, prefix, linears, x_loss, x_mean, cold, kw, ctx: LayerContext):
    """:func:`search_group_scales`'s search before any grid point is tried: a :class:`GroupSearch`
    (its float reference output computed, its weights copied), or what it returns instead (``None``,
    the reason a targeted group is left unscaled)."""
    arch, quantizer, opts, targets = ctx.arch, ctx.quantizer, ctx.recipe.awq, ctx.targets
    prev = get_module(layer, group.prev_op)
    lins = [linears[r] for r in group.linears]
    quantized = [prefix + r in targets for r in group.linears]
    if not any(quantized):
        return None
    tie = None
    if group.requires_square:
        kv = kv_repeat(layer, group)
        if kv is not None and GQA_V_TO_O:  # GQA/MQA: one scale per KV-head channel, repeated for the query heads reading it
            tie = lambda c, kv=kv: tie_kv_heads(c, *kv)  # noqa: E731
        elif kv is not None:
            return (f"grouped-query attention ({kv[1]} query heads read each of the {kv[0]} KV heads): AWQ's "
                    "v_proj -> o_proj scaling is off for it (it cost perplexity where measured)")
        elif (any(m.in_features != prev.weight.shape[0] for m in lins)
              or lins[0].weight.shape != prev.weight.shape):
            return (f"{group.prev_op}'s {prev.weight.shape[0]} output rows do not map one to one onto "
                    f"{group.linears[0]}'s {lins[0].in_features} input columns")
    if expert_index(arch, group.prev_op) in cold:
        return None  # a cold expert's own group (up -> down): RTN fallback, no scaling
    key = group.inputs_at or group.linears[0]
    x = x_loss[key]
    if x.numel() == 0 or x_mean[key] is None:
        return "no calibration token reached it among the loss samples"
    inspect = get_module(layer, group.inspect)
    weights = [m.weight.detach().clone() for m in lins]
    if gram_worthwhile(inspect, lins, x):
        loss_fn = gram_loss(x, weights[0], quantized[0])
    else:
        loss_fn = forward_loss(inspect, lins, weights, quantized, x, kw, group.inspect_is_attention)

    specs = [quantizer.schemes.get(prefix + r, quantizer.schemes[next(iter(quantizer.schemes))]) for r in group.linears]
    schemes = ([sp.num_bits for sp in specs], [sp.group_size for sp in specs], [sp.symmetric for sp in specs])
    return GroupSearch(key, prefix + group_name(group), x_mean[key], weights, loss_fn, schemes, opts.n_grid,
                       opts.duo_scaling, tie, e2m1_grids(arch, list(group.linears), specs, quantized))


#: tokens per chunk of the loss forwards of a non-attention inspected module (an MLP): its
#: intermediate activations (SiLU, product) then stay in cache instead of streaming through
#: memory (SmolLM2's MLP over 8 x 512 tokens: 150 -> 108 ms a candidate on this project's Xeon)
LOSS_CHUNK_TOKENS = 1024


def loss_step(x: torch.Tensor, is_attention: bool) -> int:
    """Rows of ``x`` (sequences, or routed tokens) per forward of :func:`forward_loss`'s loss."""
    per_row = x.shape[1] if x.ndim == 3 else 1
    return x.shape[0] if is_attention else max(1, LOSS_CHUNK_TOKENS // per_row)


def forward_loss(inspect, lins, weights, quantized, x, kw, is_attention: bool):
    """The scale search's loss for one scaling group: the mean squared difference between the
    inspected module's output with candidate weights and its float output on ``x``
    (``[b, T, in]``, or ``[n, in]`` routed tokens). Attention runs on all of ``x`` at once;
    any other module in chunks of about :data:`LOSS_CHUNK_TOKENS` tokens (whole sequences),
    the squares summed in float64."""
    ref = inspect_forward(inspect, x, kw, is_attention)
    step = loss_step(x, is_attention)

    def loss_fn(cands):
        for m, c, w, q in zip(lins, cands, weights, quantized):
            m.weight.data.copy_(c if q else w)
        try:
            total = torch.zeros((), dtype=torch.float64, device=x.device)
            for r0 in range(0, x.shape[0], step):
                d = inspect_forward(inspect, x[r0:r0 + step], kw, is_attention).float() - ref[r0:r0 + step]
                total += d.pow_(2).sum(dtype=torch.float64)
            return total / max(ref.numel(), 1)
        finally:
            for m, w in zip(lins, weights):
                m.weight.data.copy_(w)

    return loss_fn


def gram_worthwhile(inspect, lins, x) -> bool:
    """Whether a group's loss is better computed from its input second moments
    (:func:`gram_loss`): the group is one linear inspected on its own output (a
    ``up_proj -> down_proj`` group), and it has at most half as many input channels as loss
    tokens (a candidate then costs ``out * in²`` multiply-adds instead of ``tokens * in * out``)."""
    if len(lins) != 1 or inspect is not lins[0] or not isinstance(inspect, torch.nn.Linear):
        return False
    tokens = x.numel() // max(x.shape[-1], 1)
    return 2 * inspect.in_features <= tokens


def gram_loss(x, weight, quantized: bool):
    """The loss of :func:`forward_loss` for a lone linear inspected on its own output, from
    ``G = xᵀx`` (``[in, in]`` float32, once): ``mean((x (Ŵ - W)ᵀ)²) = tr(Δ G Δᵀ) / (tokens * out)``
    with ``Δ = Ŵ - W`` (the bias cancels). ``weight``: ``[out, in]`` float weight."""
    xf = x.reshape(-1, x.shape[-1]).float()
    gram = xf.t() @ xf
    n = max(xf.shape[0] * weight.shape[0], 1)
    w = weight.float()

    def loss_fn(cands):
        if not quantized:
            return torch.zeros((), dtype=torch.float64)
        d = cands[0].float() - w
        return (d @ gram).mul_(d).sum(dtype=torch.float64) / n

    return loss_fn


def kv_repeat(layer, group) -> tuple[int, int, int] | None:
    """``(kv_heads, groups, head_dim)`` of a ``v_proj -> o_proj`` group under grouped-query
    attention (o_proj reads ``groups`` > 1 query heads per v_proj KV head), else ``None``
    (MHA, or a layout kvq cannot prove: the group is then applied only when square)."""
    prev = get_module(layer, group.prev_op)
    lins = [get_module(layer, r) for r in group.linears]
    attn = get_module(layer, group.prev_op.rsplit(".", 1)[0]) if "." in group.prev_op else None
    head_dim = getattr(attn, "head_dim", None)
    rows, cols = prev.weight.shape[0], lins[0].in_features
    if (not isinstance(prev, torch.nn.Linear) or not isinstance(head_dim, int) or head_dim <= 0 or rows % head_dim
            or any(m.in_features != cols for m in lins) or cols % rows or cols == rows):
        return None
    groups = cols // rows
    if getattr(attn, "num_key_value_groups", groups) != groups:
        return None
    return rows // head_dim, groups, head_dim


def fold_group(layer, group, s, key, linears, x_loss, col_scale, row_scale, norm_offset: float,
               storage: torch.dtype | None = None) -> None:
    """Fold ``s``: the group's preceding op output ``/= s``, its linears' (and routers')
    input channels ``*= s`` (float function unchanged); the loss inputs follow. Under GQA
    (:func:`kv_repeat`) the preceding v_proj's rows take one query head's copy of ``s``."""
    kv = kv_repeat(layer, group) if group.requires_square and GQA_V_TO_O else None
    prev_s = s.view(kv[0], kv[1], kv[2])[:, 0].reshape(-1) if kv is not None else s
    rows = fold_scales(get_module(layer, group.prev_op), prev_s, group.prev_rows, norm_offset, storage)
    if group.prev_op in linears:
        row_scale[group.prev_op] = rows
    for r in group.linears:
        linears[r].weight.data.mul_(s)
        col_scale[r] = s
    for a in group.also_scale:
        get_module(layer, a).weight.data.mul_(s.to(get_module(layer, a).weight))
    for k in set(group.linears) | {key}:
        x_loss[k] = x_loss[k] / s


def clip_and_quantize(i, linears, x_loss, cold, col_scale, row_scale, originals, ctx: LayerContext) -> list[float]:
    """Clip search and quantization of every targeted linear (cold experts: RTN, no clipping);
    returns the relative weight errors (in the original weights' space). The clip searches are
    dealt to the ranks (each linear's on one rank, by its multiply-adds: :func:`compressor.distributed.deal`;
    every rank then holds every ``clip_max``, bit for bit); a rank's own experts, inside
    :func:`compressor.distributed.alone`, search theirs here."""
    arch, quantizer, opts, targets = ctx.arch, ctx.quantizer, ctx.recipe.awq, ctx.targets
    prefix = f"{arch.layers}.{i}."
    share_fp4_absmax(i, list(linears), ctx)  # NVFP4: each fused set's global scale from its folded weights
    searched = {}  # rel -> (weight, sampled inputs [k, in], bits, group_size, symmetric, e2m1 grid, NVFP4 absmax)
    for rel, lin in linears.items():
        e = expert_index(arch, rel)
        xs = x_loss[rel].reshape(-1, lin.in_features) if prefix + rel in targets else None
        if (xs is not None and opts.clip and rel not in arch.clip_skip and not (e is not None and e in cold)
                and xs.shape[0]):
            idx = torch.linspace(0, xs.shape[0] - 1, min(opts.clip_tokens, xs.shape[0])).long()
            scheme = quantizer.schemes[prefix + rel]
            searched[rel] = (lin.weight.detach(), xs[idx], *scheme[:3], e2m1_grid(scheme),
                             quantizer.fp4_absmax.get(prefix + rel))
    tasks = list(searched.values())
    found = deal(tasks, lambda t: search_clip(*t[:5], opts.clip_grid, opts.clip_max_shrink, grid=t[5], absmax=t[6]),
                 [t[0].numel() * t[1].shape[0] for t in tasks])
    clip = dict(zip(searched, found))
    errs = []
    for rel, lin in linears.items():
        name = prefix + rel
        if name not in targets:
            continue
        ctx.modules[name], err = quantizer.quantize_linear(
            name, lin, clip.get(rel), col_scale.get(rel), originals[rel], row_scale.get(rel)
        )
        errs.append(err)
    return errs


@dataclass
class ScaledLayer:
    """A decoder layer after AWQ's scale search and folding (steps 1-3), before any weight is quantized.

    ``linears``: relative name -> Linear (weights folded); ``x_loss``: the loss inputs per
    watched key (in the folded space); ``cold``: cold expert indices; ``col_scale`` /
    ``row_scale``: the scales folded into each linear's input columns / output rows;
    ``originals``: each linear's weight before folding; ``ratios``: the chosen grid ratio per
    scaling group; ``float_out``: the float layer's output on the loss sequences; ``counts``:
    routed tokens per expert; ``phases``: seconds per step; ``skipped``: targeted scaling
    groups left unscaled (:func:`group_name` -> why)."""

    linears: dict
    x_loss: dict
    cold: set
    col_scale: dict
    row_scale: dict
    originals: dict
    ratios: dict
    float_out: torch.Tensor
    counts: list | None
    phases: dict
    skipped: dict

    def figures(self) -> dict:
        """The layer's AWQ figures for the manifest: ``awq_ratios``, and ``awq_skipped`` when a
        targeted group was left unscaled."""
        return {"awq_ratios": self.ratios, **({"awq_skipped": self.skipped} if self.skipped else {})}


def watched_modules(layer, linears: dict, groups: list) -> dict:
    """What :func:`observe` hooks: ``linears`` and each group's ``inputs_at`` module (an MoE block)."""
    watched = dict(linears)
    for g in groups:
        if g.inputs_at:
            watched[g.inputs_at] = get_module(layer, g.inputs_at)
    return watched


def scale_group(layer, group, prefix: str, sl: ScaledLayer, x_mean: dict, kw: dict, ctx: LayerContext,
                found=False) -> None:
    """Search one scaling group's scales and fold them (:func:`search_group_scales`, :func:`fold_group`)
    on ``sl``'s linears and loss inputs, recording in ``sl`` the ratio and the scales folded, or why a
    targeted group was left unscaled. ``found``: the search's result when already made (:func:`scale_groups`)."""
    if found is False:
        found = search_group_scales(layer, group, prefix, sl.linears, sl.x_loss, x_mean, sl.cold, kw, ctx)
    if isinstance(found, str):
        sl.skipped[group_name(group)] = found
    if found is None or isinstance(found, str):
        return
    s, sl.ratios[group.prev_op], key = found
    fold_group(layer, group, s, key, sl.linears, sl.x_loss, sl.col_scale, sl.row_scale, ctx.arch.norm_offset,
               ctx.quantizer.dtype)


def _reads(group) -> tuple[set, set]:
    """What :func:`search_group_scales` reads of ``group``'s layer: ``(modules, loss-input keys)``
    (the inspected module and everything inside it, the group's linears; the prev op's shape only)."""
    return {group.inspect, *group.linears}, {group.inputs_at or group.linears[0]}


def _writes(group) -> tuple[set, set]:
    """What :func:`fold_group` changes: ``(modules, loss-input keys)``."""
    return ({group.prev_op, *group.linears, *group.also_scale},
            {*group.linears, group.inputs_at or group.linears[0]})


def _inside(a: str, b: str) -> bool:
    """Whether module ``a`` is ``b``, inside it, or holds it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def search_waves(groups: list) -> list[list]:
    """``groups`` (in the layer's order) cut into runs, each as long as no group's scale search reads
    what an earlier group of its run folds (:func:`_reads`, :func:`_writes`): the searches of a run
    see the layer as the one-at-a-time order shows it to them, so they can run at once (dealt to
    the ranks: :func:`scale_groups`) and their folds follow, in order, with the same result bit for bit."""
    waves: list[list] = []
    for g in groups:
        mods, keys = _reads(g)
        if waves and not any(any(_inside(w, m) for w in wm for m in mods) or wk & keys
                             for wm, wk in map(_writes, waves[-1])):
            waves[-1].append(g)
        else:
            waves.append([g])
    return waves


def _search_cost(linears: dict, group) -> int:
    """A scale search's expected work, for dealing: its linears' weights (each candidate fake-quantizes them)."""
    return sum(linears[r].weight.numel() for r in group.linears)


def scale_groups(layer, groups: list, prefix: str, sl: ScaledLayer, x_mean: dict, kw: dict, ctx: LayerContext) -> None:
    """:func:`scale_group` for each of ``groups`` in order, the searches of each of their
    :func:`search_waves` dealt to the ranks (:func:`compressor.distributed.deal`; every rank holds
    the layer and runs this call), then folded in order: the single process's scales bit for bit."""
    size = world()[1]
    for wave in search_waves(groups):
        if size == 1:
            found = [search_group_scales(layer, g, prefix, sl.linears, sl.x_loss, x_mean, sl.cold, kw, ctx)
                     for g in wave]
        else:
            found = _dealt_searches(layer, wave, prefix, sl, x_mean, kw, ctx, size)
        for g, f in zip(wave, found):
            scale_group(layer, g, prefix, sl, x_mean, kw, ctx, found=f)


def grid_ranges(n_grid: int, parts: int) -> list[range]:
    """``range(n_grid)`` cut into ``min(parts, n_grid)`` consecutive ranges, as even as can be."""
    k = max(1, min(parts, n_grid))
    return [range(n_grid * j // k, n_grid * (j + 1) // k) for j in range(k)]


def _dealt_searches(layer, wave: list, prefix: str, sl: ScaledLayer, x_mean: dict, kw: dict, ctx: LayerContext,
                    size: int) -> list:
    """:func:`search_group_scales` of each group of ``wave`` (what it returns, in order), every group's grid cut
    into ``size`` ranges (:func:`grid_ranges`) and the ranges dealt to the ranks by their work
    (:func:`compressor.distributed.deal`): one group's search is no longer one rank's alone (the dense MLP's is
    most of a layer's). Each rank prepares a group once, for the ranges it holds (its float reference output:
    one grid point's work), and every rank picks the same scales from the ranges' picks (:func:`pick_scale`)."""
    ranges = grid_ranges(ctx.recipe.awq.n_grid, size)
    tasks = [(j, points) for j in range(len(wave)) for points in ranges]
    held: dict = {}

    def solve(task) -> tuple:
        j, points = task
        if j not in held:  # a rank's tasks come in order: one group prepared at a time
            held.clear()
            held[j] = prepare_group_search(layer, wave[j], prefix, sl.linears, sl.x_loss, x_mean, sl.cold, kw, ctx)
        search = held[j]
        return ("skip", search) if search is None or isinstance(search, str) else ("pick", search.run(points))

    out = deal(tasks, solve, [_search_cost(sl.linears, wave[j]) * len(points) for j, points in tasks])
    held.clear()
    found = []
    for j, g in enumerate(wave):
        parts = out[j * len(ranges):(j + 1) * len(ranges)]
        if parts[0][0] == "skip":
            found.append(parts[0][1])
        else:
            s, ratio = pick_scale([p for _, p in parts], prefix + group_name(g))
            found.append((s, ratio, g.inputs_at or g.linears[0]))
    return found


def awq_scale_layer(i: int, layer, hidden: list, kw: dict, ctx: LayerContext) -> ScaledLayer:
    """AWQ's steps 1-3 for decoder layer ``i``: observe, then search and fold each scaling group's scales
    (the layer's float function is unchanged; no weight is quantized yet)."""
    arch, loss_n = ctx.arch, ctx.loss_n
    prefix = f"{arch.layers}.{i}."
    linears = {rel: get_module(layer, rel) for rel in layer_linears(arch, layer)}
    groups = layer_groups(arch, layer)
    phases = {}
    tp = time.perf_counter()
    experts = ctx.experts(layer)
    if experts is not None:
        experts.counts.zero_()
    stats, float_out = observe(layer, hidden, kw, watched_modules(layer, linears, groups), loss_n, ctx.samples)
    counts = experts.counts.tolist() if experts is not None else None
    figure = ctx.samples is None or ctx.samples.rank == 0  # several ranks: the output-error figure is rank 0's
    sl = ScaledLayer(linears, stats.loss_inputs(linears, hidden, loss_n), ctx.cold(counts), {}, {},
                     {rel: m.weight.detach().clone() for rel, m in linears.items()}, {},
                     torch.cat(float_out) if figure else None, counts, phases, {})
    x_mean = stats.x_mean()
    del stats
    phases["observe"], tp = time.perf_counter() - tp, time.perf_counter()
    scale_groups(layer, groups, prefix, sl, x_mean, kw, ctx)  # later groups see the earlier folds they read
    phases["scale_search"] = time.perf_counter() - tp
    return sl


def awq_layer(i: int, layer, hidden: list, kw: dict, ctx: LayerContext) -> LayerOutcome:
    """AWQ for decoder layer ``i``: observe, search and fold each scaling group's scales, clip and quantize."""
    sl = awq_scale_layer(i, layer, hidden, kw, ctx)
    tp = time.perf_counter()
    errs = clip_and_quantize(i, sl.linears, sl.x_loss, sl.cold, sl.col_scale, sl.row_scale, sl.originals, ctx)
    sl.phases["clip_and_quantize"] = time.perf_counter() - tp
    return LayerOutcome(errs, sl.float_out, sl.counts, sl.figures(), sl.phases)


def skipped_warnings(layers: list[dict]) -> list[str]:
    """One warning per scaling group AWQ left unscaled (``quality.layers[].awq_skipped``), with
    the layers it concerns and why: its linears are quantized without AWQ's scales."""
    seen: dict[tuple[str, str], list[int]] = {}
    for f in layers:
        for group, why in (f.get("awq_skipped") or {}).items():
            seen.setdefault((group, why), []).append(f["layer"])
    return [f"AWQ left the scaling group {group} unscaled in {len(ids)} of {len(layers)} layer(s) ({_ranges(ids)}): "
            f"{why}; its linears are quantized without AWQ's scales (quality.layers[].awq_skipped)"
            for (group, why), ids in seen.items()]


def _ranges(ids: list[int]) -> str:
    """``layers 0-3, 7`` for ``[0, 1, 2, 3, 7]``."""
    ids, parts, start = sorted(ids), [], None
    for k, i in enumerate(ids):
        start = i if start is None else start
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            parts.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ("layer " if len(ids) == 1 else "layers ") + ", ".join(parts)


@register_algorithm
class AWQ(Algorithm):
    """Activation-aware weight quantization; needs calibration; folds its scales into the weights."""

    name = "awq"
    reads = ("awq",)
    needs_calibration = True
    #: a streamed MoE layer's experts are read in groups, three times (compressor.moe_stream_awq), and under several
    #: ranks each reads only its own experts (every sum over experts combined across the ranks)
    streams_experts = experts_per_rank = True
    folds_input_scales = True
    #: NVFP4 and MXFP4: every scale and clip candidate rounded as the format's writer rounds it (compressor.quant.awq)
    fp4_grid = True

    def divides_samples(self, ctx):
        return True  # observe's records gathered in batch order (compressor.quant.awq_observe); the searches dealt

    def quantize_layer(self, i, layer, hidden, kw, ctx):
        return awq_layer(i, layer, hidden, kw, ctx)

    def run_warnings(self, layers):
        return skipped_warnings(layers)
