"""Routed experts owned per rank: several ``torchrun`` ranks divide a MoE layer's experts.

Under several ranks (:mod:`compressor.distributed`) every rank runs the same layer-by-layer
pass, so each already holds the layer's non-expert part, its calibration tokens and their
routing (:mod:`compressor.moe_stream` computes the routing once, from the held router). What
grows with the model -- the routed experts' weights, their Hessians, their solves -- is
divided: rank ``r`` of ``W`` owns a contiguous block of experts (:func:`bounds`: ``[n r / W, n (r + 1) / W)``,
or, where the routing is known before the first expert is read -- GPTQ and GPTAQ, AWQ and ``awq-gptq``
after their observe -- blocks of about equal work, the experts below ``moe.min_tokens`` costing a
fraction of the others: :func:`solve_costs`) of every streamed MoE layer and alone reads them from the source (in groups
within ``--memory-budget-gib``), calibrates, solves and packs them
(:meth:`compressor.quant.algorithms.Algorithm.quantize_expert`, inside
:func:`compressor.distributed.alone`: no collective). It applies to handlers with
``experts_per_rank`` (GPTQ, GPTAQ, RTN, float weights, AWQ, ``awq-gptq``) on a streamed source,
whether or not the layer fits the budget. AWQ reads the experts three times
(:mod:`compressor.moe_stream_awq`), each rank its own block each time, and every sum over
experts its scale search needs is made as below: the float routed parts of the loss sequences
and each grid candidate's routed part (:meth:`ExpertShare.combine`), the block group's
``weight_mean`` terms (every rank's to every rank in expert order, :meth:`ExpertShare.merge`,
added in the group's order as one process adds them): every rank picks the single process's scale.

The routed output. A token's routed output is the sum of its ``top_k`` experts' weighted
outputs, added in ascending expert order (:class:`compressor.moe.UnfusedExperts`, and a
single process's streamed layer). Float addition is not associative, so partial sums added
afterwards would differ from that in the last bits, and the next layers' integers with them.
Ranks own ascending blocks, so the single-process order is rank 0's experts, then rank 1's,
...: rank 0 adds its experts into the accumulator as a single process does; a later rank
keeps its experts' weighted rows (:class:`Stash`, ``[its routed (token, slot) pairs, H]``,
through ``--activation-budget-gib``'s spill) and, once it receives the sum of the ranks
before it (a broadcast), adds them in the same order (:meth:`ExpertShare.combine`). Every
rank ends with the routed output a single process computes, bit for bit, and so does
every later layer: the artifact's tensors equal the single-process ones for any number of
ranks. What it costs: ``W`` broadcasts of the layer's activations ``[tokens, H]`` per
accumulator (the quantized stream; the reference sequences; GPTAQ's float stream; AWQ's loss
sequences, its search's reference and each grid candidate's loss chunks), and on each rank
after the first its pairs' rows, about ``top_k / W`` times the activations.

The packed experts. Rank 0 writes the staging folder and the artifact, as before: every
other rank posts each of its groups' packed tensors, schemes and tensor names to rank 0 alone
as flat tensors as soon as the group is packed (never pickled; :class:`GroupMail`) and goes on
with its next group, and rank 0, its own groups written, receives them and writes them as
parts named by the group's first expert. No rank waits for another between groups. No shared
file system is needed between machines, and the resume checkpoint stays rank 0's alone
(``--resume`` with any number of ranks).
Per-expert figures (errors, damping, the largest activation) reach every rank in expert
order (:meth:`ExpertShare.merge`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .distributed import alone, broadcast, post, receive, share, wait, world
from .source.lazy import ROUTED_EXPERT, layer_names

__all__ = ["bounds", "budget_groups", "divides", "solve_costs", "writer_cost", "ExpertShare", "GroupMail", "Stash"]


#: the relative work of a routed expert: solved from its tokens (GPTQ at Kimi K2's width, 7168 x 2048, one
#: thread: about 10.5 s with its read from block-FP8 and its Hessian's share of the pass) against one below
#: ``moe.min_tokens`` (rounded: about 0.5 s, mostly the read); py-spy of one process on a 2-core Xeon (no AMX),
#: 2026-12-07 (7 : 1 before, from a 2-core AMD EPYC, cut the blocks one solved expert off the best in one of
#: two MoE layers, and the other rank waited 19.5 s)
SOLVED_COST, ROUNDED_COST = 21, 1


def bounds(n: int, rank: int, size: int, costs: list[int] | None = None, first_extra: float = 0.0) -> tuple[int, int]:
    """The experts ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` owns: contiguous blocks in
    rank order, sizes differing by at most one; with ``costs`` (each expert's work, the same list
    on every rank) blocks of about equal work instead, each cut where the running sum comes
    closest to its share of the total, at least one expert a rank. ``first_extra``: work (in the
    costs' units) rank 0 does besides its experts' (receiving and writing the other ranks' groups:
    :func:`writer_cost`), so that its block is that much lighter."""
    if costs is None or n < size:
        return n * rank // size, n * (rank + 1) // size
    total, run, cuts = sum(costs), [0], [0]
    for c in costs:
        run.append(run[-1] + c)
    for r in range(1, size):
        target = (total + first_extra) * r / size - first_extra
        cuts.append(min(range(cuts[-1] + 1, n - size + r + 1), key=lambda c: (abs(run[c] - target), c)))
    cuts.append(n)
    return cuts[rank], cuts[rank + 1]


#: the same for AWQ and ``awq-gptq`` (``compressor.moe_stream_awq``: split once the observe has routed the tokens):
#: every expert's gate/up is fake-quantized for each grid candidate and its rows of each candidate's routed part
#: computed (about 6 s an expert at Kimi K2's width), and one at or above ``moe.min_tokens`` adds its own
#: ``up -> down`` scale search and its clip searches (about 13 s); py-spy of a 2-rank run, 2026-12-06
AWQ_SEARCHED_COST, AWQ_ROUNDED_COST = 10, 3


#: rank 0's work for each routed expert another rank owns (receiving its packed group and writing it), in
#: :data:`SOLVED_COST`'s units: about 0.2 s an expert, from rank 0's receives and writes in py-spy of two ranks
#: on a 2-core Xeon (no AMX), GPTQ at Kimi K2's width, 64 experts, 2026-12-07
WRITER_COST = 0.4


def writer_cost(n: int, size: int, per_expert: float = WRITER_COST) -> float:
    """Rank 0's extra work in a MoE layer of ``n`` routed experts under ``size`` ranks: ``per_expert``
    (:data:`WRITER_COST`) for each expert the other ranks own, taken as ``n * (size - 1) / size``."""
    return per_expert * n * (size - 1) / size if size > 1 else 0.0


def solve_costs(n: int, cold: set[int], solved: int = SOLVED_COST, rounded: int = ROUNDED_COST) -> list[int]:
    """Each of ``n`` experts' relative work: ``solved`` (:data:`SOLVED_COST`), ``rounded``
    (:data:`ROUNDED_COST`) for the ``cold`` ones."""
    return [rounded if e in cold else solved for e in range(n)]


def divides(algorithm) -> bool:
    """Whether ranks own routed experts for ``algorithm`` in this run: several ranks and a
    handler whose :meth:`quantize_expert` needs nothing beyond the expert's own tokens
    (``experts_per_rank``)."""
    return world()[1] > 1 and getattr(algorithm, "experts_per_rank", False)


def budget_groups(experts: list[list[str]], sizes: dict[str, int], budget: int) -> list[list[str]]:
    """``experts`` (each expert's tensor names, in order) joined into groups of at most ``budget``
    bytes (``sizes``: name -> bytes held; at least one expert a group)."""
    groups, cur, cur_bytes = [], [], 0
    for names in experts:
        b = sum(sizes[n] for n in names)
        if cur and cur_bytes + b > budget:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur += names
        cur_bytes += b
    return groups + [cur] if cur else groups


def split_layer(model, arch, i: int, bytes_per_weight: int) -> tuple[list[str], dict[int, list[str]], dict[str, int]]:
    """Decoder layer ``i``'s tensor names split into the non-expert ones and routed experts'
    (``{expert index: names}``), with each name's bytes held (``bytes_per_weight`` per weight)."""
    prefix = f"{arch.layers}.{i}."
    names = layer_names(model, arch, i)
    params = dict(model.get_submodule(prefix[:-1]).named_parameters(prefix=prefix[:-1]))
    sizes = {n: params[n].numel() * bytes_per_weight if n in params else 0 for n in names}
    experts: dict[int, list[str]] = {}
    rest = []
    for n in names:
        m = ROUTED_EXPERT.search(n[len(prefix):])
        (experts.setdefault(int(m.group(1)), []) if m else rest).append(n)
    return rest, experts, sizes


def expert_groups(model, arch, i: int, limit: int, bytes_per_weight: int) -> list[list[str]] | None:
    """Decoder layer ``i``'s tensor names (:func:`compressor.source.lazy.layer_names`) in groups:
    the non-expert tensors first, then routed experts (whole experts, in index order) in groups
    of at most ``limit`` bytes held (``bytes_per_weight`` per weight; at least one expert each).
    ``None`` for a layer without routed experts. Used by a streamed verify
    (:mod:`compressor.streamed_eval`); a streamed quantize takes :meth:`compressor.staging.LayerWriter.expert_groups`
    (the same groups in one process, :class:`compressor.moe_ranks.ExpertShare`'s under ranks).
    """
    rest, experts, sizes = split_layer(model, arch, i, bytes_per_weight)
    if not experts:
        return None
    return [rest] + budget_groups([experts[e] for e in sorted(experts)], sizes, limit)


class Stash:
    """Stands in, on a rank after the first, for one batch's routed-output accumulator ``[N, H]``
    in :func:`compressor.moe_stream.add_expert`: each ``index_add_(0, index, rows)`` call (one
    expert's weighted rows, experts in ascending order) is kept, ``rows`` copied into
    :attr:`rows` ``[pairs, H]`` (its expected pairs, preallocated), for :meth:`fold_into`."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.dtype, self._at = rows, rows.dtype, 0
        self._adds: list[tuple[torch.Tensor, int, int]] = []

    def index_add_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
        n = index.numel()
        self.rows[self._at:self._at + n].copy_(source)
        self._adds.append((index, self._at, n))
        self._at += n

    def fold_into(self, out: torch.Tensor) -> None:
        """Add the kept rows into ``out`` as the calls would have: same order, same operation."""
        for index, at, n in self._adds:
            out.index_add_(0, index, self.rows[at:at + n])


class ExpertShare:
    """This rank's share of a MoE layer's ``n`` routed experts (:func:`bounds`); the whole
    layer for a single process or a handler that does not divide them (``divided`` False)."""

    def __init__(self, n: int, divided: bool = True, costs: list[int] | None = None, writer: float = 0.0):
        self.rank, self.size = world() if divided else (0, 1)
        self.n, self.costs = n, costs
        self.extra = writer_cost(n, self.size, writer) if costs is not None else 0.0  # rank 0's: bounds' first_extra
        self.lo, self.hi = bounds(n, self.rank, self.size, costs, self.extra)

    @classmethod
    def of(cls, algorithm, n: int, costs: list[int] | None = None, writer: float = 0.0) -> "ExpertShare":
        """The share for ``algorithm`` in this run (:func:`divides`); ``costs``: see :func:`bounds`; ``writer``:
        rank 0's work per expert another rank owns, in the costs' units (:func:`writer_cost`)."""
        return cls(n, divides(algorithm), costs, writer)

    def owns(self, e: int) -> bool:
        return self.lo <= e < self.hi

    def of_rank(self, r: int) -> range:
        """The experts rank ``r`` owns."""
        return range(*bounds(self.n, r, self.size, self.costs, self.extra))

    def groups(self, experts: dict[int, list[str]], sizes: dict[str, int], budget: int) -> tuple[list, list[int]]:
        """``(this rank's experts in groups, how many groups each rank has)``: each rank's experts
        (``experts``: index -> tensor names; ``sizes``: name -> bytes held), in index order, in groups
        of at most ``budget`` bytes (at least one expert each)."""
        by_rank = [budget_groups([experts[e] for e in sorted(experts) if e in self.of_rank(r)], sizes, budget)
                   for r in range(self.size)]
        return by_rank[self.rank], [len(g) for g in by_rank]

    def solo(self):
        """Around an owned expert's step: no collective inside (:func:`compressor.distributed.alone`)."""
        return alone() if self.size > 1 else nullcontext()

    def sink(self, calls: list, outs: list[torch.Tensor], spill=None, tag: str = "") -> list:
        """Where this rank adds its experts' weighted outputs for ``calls`` (``(x [N, H], top_k_index
        [N, k], top_k_weights)`` per batch): ``outs`` itself on the first rank, else a :class:`Stash`
        per batch sized for the batch's (token, slot) pairs routed to this rank's experts
        (through ``spill``, tagged ``tag``, when given)."""
        if self.rank == 0:
            return outs
        rows = [torch.zeros(int(((idx >= self.lo) & (idx < self.hi)).sum()), x.shape[-1], dtype=o.dtype,
                            device=o.device) for (x, idx, _), o in zip(calls, outs)]
        if spill is not None and rows:
            rows = spill(rows, f"moe-stash-{tag}")
        return [Stash(r) for r in rows]

    def combine(self, outs: list[torch.Tensor], sinks: list) -> None:
        """Make ``outs`` (every rank's accumulators for one set of calls, ``sinks`` from :meth:`sink`)
        the routed output of every expert, added in ascending expert order: rank ``r`` receives
        the sum of the ranks before it, adds its :class:`Stash` rows and passes it on; the last
        rank's sum is broadcast to all."""
        if self.size == 1:
            return
        for r in range(self.size):
            if r and self.rank == r:
                for out, stash in zip(outs, sinks):
                    stash.fold_into(out)
            for out in outs:
                broadcast(out, r)

    def merge(self, parts: list, peak: float, groups: int) -> tuple[list, float, int]:
        """Every rank's per-expert ``parts`` (in its experts' order) on every rank, in expert order;
        the largest ``peak`` and the sum of ``groups`` over the ranks (flat tensors: :func:`share`)."""
        if self.size == 1:
            return parts, peak, groups
        got = [share((parts, peak, groups) if src == self.rank else None, src) for src in range(self.size)]
        return [p for g in got for p in g[0]], max(g[1] for g in got), sum(g[2] for g in got)


class GroupMail:
    """A MoE layer's packed expert groups on their way to rank 0, which writes the artifact.

    A later rank posts each group as soon as it is packed (:func:`compressor.distributed.post`)
    and goes on with its next group; rank 0 writes its own groups as it makes them and takes
    the others' (:meth:`collect`) once its own are done. No rank waits for another between
    groups, so a layer lasts as long as its slowest rank's experts, not the sum over groups of
    the slowest rank's group. A later rank holds the groups still under way, at most ``limit``
    bytes of them (waiting for the oldest beyond that, and always keeping one): with rank 0
    slower than it, up to its whole share of the layer's packed experts (about one eighth of
    the float32 weights for 4-bit codes)."""

    def __init__(self, counts: list[int], limit: int):
        self.rank, self.size = world()
        self.counts, self.limit = counts, limit  # counts[r]: how many groups rank r sends
        self._pending: list[tuple[list, int]] = []  # (pending sends, bytes)

    def send(self, group) -> list:
        """``[group]`` on rank 0 (to write now); elsewhere ``[]``, the group posted to rank 0."""
        if self.rank == 0:
            return [group]
        posted = post(group, 0)
        self._pending.append((posted, sum(t.numel() * t.element_size() for _, t in posted)))
        while len(self._pending) > 1 and sum(n for _, n in self._pending) > self.limit:
            wait(self._pending.pop(0)[0])
        return []

    def collect(self) -> list:
        """At the end of this rank's groups: on rank 0 every other rank's groups, received in rank
        order and each rank's in its order (a generator: one group held at a time); elsewhere,
        once every posted group has arrived, nothing."""
        if self.rank == 0:
            return (receive(r) for r in range(1, self.size) for _ in range(self.counts[r]))
        while self._pending:
            wait(self._pending.pop(0)[0])
        return []
