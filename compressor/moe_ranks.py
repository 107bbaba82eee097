"""Routed experts owned per rank: several ``torchrun`` ranks divide a MoE layer's experts.

Under several ranks (:mod:`compressor.distributed`) every rank runs the same layer-by-layer
pass, so each already holds the layer's non-expert part, its calibration tokens and their
routing (:mod:`compressor.moe_stream` computes the routing once, from the held router). What
grows with the model -- the routed experts' weights, their Hessians, their solves -- is
divided: rank ``r`` of ``W`` owns a contiguous block of experts (:func:`bounds`: ``[n r / W, n (r + 1) / W)``,
or, where the routing is known before the first expert is read -- GPTQ and GPTAQ, AWQ and ``awq-gptq``
after their observe -- blocks of about equal work, the experts below ``moe.min_tokens`` costing a
fraction of the others: :func:`expert_costs`, :func:`solve_costs`) of every streamed MoE layer and alone reads them
from the source (in groups within ``--memory-budget-gib``), calibrates, solves and packs them
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

Lent experts (GPTQ and GPTAQ). One solved expert is about 11 s at Kimi K2's width and a rounded one
under 1 s, so contiguous blocks end up to a solved expert apart. Cut with rank 0's block at or below
its share, a heavier later rank lends experts of its block (:func:`lend`) to the lightest rank, which
reads, solves and packs them as its own and sends their weighted rows back to the block's owner at
the layer's end (:meth:`ExpertShare.combine`); the owner adds them among its own in expert order, so
the routed output is still one process's, bit for bit. Rank 0 never lends: it adds its block
straight into the accumulators.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .distributed import alone, broadcast, post, receive, share, wait, world
from .source.lazy import ROUTED_EXPERT, layer_names

__all__ = ["bounds", "budget_groups", "divides", "expert_costs", "lend", "solve_costs", "ExpertShare", "GroupMail",
           "Sink", "Stash"]


#: the work of a routed expert under GPTQ/GPTAQ on the rank that owns it, in seconds (Kimi K2's width, 7168 x
#: 2048, one thread, both cores busy): ``READ_SECONDS`` every expert (its read from block-FP8, its pack, its
#: write or post), ``TOKEN_SECONDS`` per routed (token, slot) pair (its rows of the routed output), and either
#: ``ROUNDED_SECONDS`` (below ``moe.min_tokens``: RTN) or ``SOLVED_SECONDS`` plus ``SOLVED_TOKEN_SECONDS`` per
#: pair (the Hessian's forward); fitted to py-spy of both ranks of a 2-rank run on a 2-core Xeon (no AMX),
#: 2026-12-08: contiguous blocks cut on a count of solved and rounded experts left rank 0 waiting 28.8 s
#: for rank 1 over two MoE layers, which this model predicts (24.6 s) from the layers' routed counts
READ_SECONDS, TOKEN_SECONDS, ROUNDED_SECONDS, SOLVED_SECONDS, SOLVED_TOKEN_SECONDS = 0.4, 0.001, 0.27, 11.4, 0.0024


def bounds(n: int, rank: int, size: int, costs: list[float] | None = None, below: bool = False) -> tuple[int, int]:
    """The experts ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` owns: contiguous blocks in
    rank order, sizes differing by at most one; with ``costs`` (each expert's work, the same list
    on every rank) blocks of about equal work instead, each cut where the running sum comes
    closest to its share of the total (with ``below``: the last cut at or below it, so that
    rank 0's block is never above its share: :func:`lend` evens out the rest), at least one
    expert a rank."""
    if costs is None or n < size:
        return n * rank // size, n * (rank + 1) // size
    total, run, cuts = sum(costs), [0.0], [0]
    for c in costs:
        run.append(run[-1] + c)
    for r in range(1, size):
        target, allowed = total * r / size, range(cuts[-1] + 1, n - size + r + 1)
        if below:
            cuts.append(max([c for c in allowed if run[c] <= target * (1 + 1e-12)], default=allowed[0]))
        else:
            cuts.append(min(allowed, key=lambda c: (abs(run[c] - target), c)))
    cuts.append(n)
    return cuts[rank], cuts[rank + 1]


def lend(costs: list[float], blocks: list[int], size: int) -> list[int]:
    """Which rank solves each expert, from ``blocks`` (each expert's block owner, :func:`bounds` with
    ``below``) and ``costs``: while it lowers the larger of the two loads, the heaviest rank other than
    rank 0 that can (an expert of its block costing less than the difference) lends one to the lightest
    rank (the one whose cost comes closest to half their difference, from below if one does; the highest
    index on a tie). The borrower solves and packs it and sends its rows of the routed output back to
    the block's owner, which adds them in expert order
    (:meth:`ExpertShare.combine`): contiguous blocks keep the one-process order of that sum, and
    lending evens out what one solved expert's granularity leaves (about 11 s here). Rank 0, which
    adds its block straight into the accumulators, never lends. The same on every rank."""
    solver, load = list(blocks), [0.0] * size
    for e, c in enumerate(costs):
        load[blocks[e]] += c
    for _ in range(len(costs)):
        lo = min(range(size), key=lambda r: (load[r], r))
        for h in sorted(range(1, size), key=lambda r: (-load[r], r)):
            gap = load[h] - load[lo]
            movable = [e for e in range(len(costs)) if solver[e] == h and blocks[e] == h and 0 < costs[e] < gap]
            if movable:
                e = min(movable, key=lambda e: (costs[e] > gap / 2, abs(costs[e] - gap / 2), -e))
                solver[e] = lo
                load[h] -= costs[e]
                load[lo] += costs[e]
                break
        else:
            break
    return solver


def expert_costs(counts: list[int], cold: set[int]) -> list[float]:
    """Each routed expert's expected work (seconds, :data:`READ_SECONDS` ...) from its routed (token,
    slot) ``counts`` and whether it is ``cold`` (below ``moe.min_tokens``: rounded, not solved)."""
    return [READ_SECONDS + TOKEN_SECONDS * t + (ROUNDED_SECONDS if e in cold else SOLVED_SECONDS
                                                + SOLVED_TOKEN_SECONDS * t) for e, t in enumerate(counts)]


#: the relative work of a routed expert under AWQ and ``awq-gptq`` (``compressor.moe_stream_awq``: split once the
#: observe has routed the tokens; contiguous blocks, nothing lent):
#: every expert's gate/up is fake-quantized for each grid candidate and its rows of each candidate's routed part
#: computed (about 6 s an expert at Kimi K2's width), and one at or above ``moe.min_tokens`` adds its own
#: ``up -> down`` scale search and its clip searches (about 13 s); py-spy of a 2-rank run, 2026-12-06
AWQ_SEARCHED_COST, AWQ_ROUNDED_COST = 10, 3


def solve_costs(n: int, cold: set[int], solved: int = AWQ_SEARCHED_COST, rounded: int = AWQ_ROUNDED_COST) -> list[int]:
    """Each of ``n`` experts' relative work under AWQ: ``solved`` (:data:`AWQ_SEARCHED_COST`), ``rounded``
    (:data:`AWQ_ROUNDED_COST`) for the ``cold`` ones."""
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
    expert's weighted rows) is kept, ``rows`` copied into :attr:`rows` ``[pairs, H]`` (its expected
    pairs, preallocated), with the expert :attr:`expert` names (set by :meth:`ExpertShare.target`),
    for :meth:`fold_into`; rows another rank computed for an expert of its block arrive by
    :meth:`insert`."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.dtype, self._at, self.expert = rows, rows.dtype, 0, -1
        self._adds: list[tuple[int, torch.Tensor, int, int]] = []

    def index_add_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
        self.insert(self.expert, index, source)

    def insert(self, e: int, index: torch.Tensor, source: torch.Tensor) -> None:
        """Keep expert ``e``'s rows ``source [n, H]`` for the tokens ``index [n]``."""
        n = index.numel()
        self.rows[self._at:self._at + n].copy_(source)
        self._adds.append((e, index, self._at, n))
        self._at += n

    def kept(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(expert, index, rows)`` of every call kept, in the order made (rows: views of :attr:`rows`)."""
        return [(e, index, self.rows[at:at + n]) for e, index, at, n in self._adds]

    def fold_into(self, out: torch.Tensor) -> None:
        """Add the kept rows into ``out`` as the calls would have, in ascending expert order (a
        stable sort: an expert's calls in the order made): the same operations as one process."""
        for _e, index, at, n in sorted(self._adds, key=lambda a: a[0]):
            out.index_add_(0, index, self.rows[at:at + n])


class Sink(list):
    """What a rank adds its experts' weighted outputs into for one accumulator (:meth:`ExpertShare.sink`):
    itself a list, one target per batch for the experts of the rank's block (rank 0: the
    accumulators themselves; a later rank: a :class:`Stash` each); :attr:`lent` one :class:`Stash` per
    batch for the experts it solves for another rank (:func:`lend`; empty when it borrows none)."""

    def __init__(self, own: list, lent: list):
        super().__init__(own)
        self.lent = lent


class ExpertShare:
    """This rank's share of a MoE layer's ``n`` routed experts: a contiguous block (:func:`bounds`) whose
    routed output it adds, and the experts it reads, solves and packs (:attr:`solver`: its block, or with
    ``lending`` that block less the experts it lends plus those it borrows: :func:`lend`); the whole
    layer for a single process or a handler that does not divide them (``divided`` False)."""

    def __init__(self, n: int, divided: bool = True, costs: list[float] | None = None, lending: bool = False):
        self.rank, self.size = world() if divided else (0, 1)
        self.n = n
        lending = lending and costs is not None and self.size > 1
        cuts = [bounds(n, r, self.size, costs, lending) for r in range(self.size)]
        self.blocks = [r for r, (lo, hi) in enumerate(cuts) for _ in range(lo, hi)]  # each expert's block owner
        self.lo, self.hi = cuts[self.rank]
        self.solver = lend(costs, self.blocks, self.size) if lending else self.blocks  # each expert's solver
        self.lending = self.solver != self.blocks

    @classmethod
    def of(cls, algorithm, n: int, costs: list[float] | None = None, lending: bool = False) -> "ExpertShare":
        """The share for ``algorithm`` in this run (:func:`divides`); ``costs``: see :func:`bounds`; ``lending``:
        see :func:`lend`."""
        return cls(n, divides(algorithm), costs, lending)

    def owns(self, e: int) -> bool:
        """Whether this rank reads, solves and packs expert ``e``."""
        return self.solver[e] == self.rank

    def of_rank(self, r: int) -> list[int]:
        """The experts rank ``r`` reads, solves and packs, ascending."""
        return [e for e in range(self.n) if self.solver[e] == r]

    def groups(self, experts: dict[int, list[str]], sizes: dict[str, int], budget: int) -> tuple[list, list[int]]:
        """``(this rank's experts in groups, how many groups each rank has)``: each rank's experts
        (``experts``: index -> tensor names; ``sizes``: name -> bytes held), in index order, in groups
        of at most ``budget`` bytes (at least one expert each)."""
        by_rank = [budget_groups([experts[e] for e in self.of_rank(r) if e in experts], sizes, budget)
                   for r in range(self.size)]
        return by_rank[self.rank], [len(g) for g in by_rank]

    def solo(self):
        """Around an owned expert's step: no collective inside (:func:`compressor.distributed.alone`)."""
        return alone() if self.size > 1 else nullcontext()

    def sink(self, calls: list, outs: list[torch.Tensor], spill=None, tag: str = "") -> Sink:
        """Where this rank adds its experts' weighted outputs for ``calls`` (``(x [N, H], top_k_index
        [N, k], top_k_weights)`` per batch): ``outs`` itself on the first rank, else a :class:`Stash`
        per batch sized for the batch's (token, slot) pairs routed to this rank's block; and for the
        experts it borrows (:func:`lend`) a :class:`Stash` per batch sized for theirs (through
        ``spill``, tagged ``tag``, when given)."""
        def stashes(mask, name):
            rows = [torch.zeros(int(mask(idx).sum()), x.shape[-1], dtype=o.dtype, device=o.device)
                    for (x, idx, _), o in zip(calls, outs)]
            return [Stash(r) for r in (spill(rows, name) if spill is not None and rows else rows)]

        borrowed = [e for e in self.of_rank(self.rank) if self.blocks[e] != self.rank]
        lent = stashes(lambda idx: torch.isin(idx, torch.tensor(borrowed, device=idx.device)),
                       f"moe-lent-{tag}") if borrowed else []
        if self.rank == 0:
            return Sink(outs, lent)
        return Sink(stashes(lambda idx: (idx >= self.lo) & (idx < self.hi), f"moe-stash-{tag}"), lent)

    def target(self, e: int, sink: Sink) -> list:
        """The per-batch targets expert ``e``'s weighted outputs go to: ``sink``'s own (its block's), or
        its :attr:`Sink.lent` stashes for an expert of another rank's block; stashes learn ``e``."""
        out = list(sink) if self.blocks[e] == self.rank else sink.lent
        for t in out:
            if isinstance(t, Stash):
                t.expert = e
        return out

    def combine(self, outs: list[torch.Tensor], sinks: Sink) -> None:
        """Make ``outs`` (every rank's accumulators for one set of calls, ``sinks`` from :meth:`sink`)
        the routed output of every expert, added in ascending expert order: the rows of lent experts
        first go back to their block's owner (each borrower's to every rank, in rank order); then rank
        ``r`` receives the sum of the ranks before it, adds its :class:`Stash` rows and passes it on;
        the last rank's sum is broadcast to all."""
        if self.size == 1:
            return
        if self.lending:
            for src in range(self.size):
                got = share([st.kept() for st in sinks.lent] if src == self.rank else None, src)
                for j, batch in enumerate(got or []):
                    for e, index, rows in batch:
                        if self.blocks[e] == self.rank:
                            sinks[j].insert(e, index, rows)
        for r in range(self.size):
            if r and self.rank == r:
                for out, stash in zip(outs, sinks):
                    stash.fold_into(out)
            for out in outs:
                broadcast(out, r)

    def merge(self, parts: list, peak: float, groups: int) -> tuple[list, float, int]:
        """Every rank's per-expert ``parts`` (in its experts' order) on every rank, in expert order
        (with lending, ``parts`` holds one entry per expert this rank solves); the largest ``peak``
        and the sum of ``groups`` over the ranks (flat tensors: :func:`share`)."""
        if self.size == 1:
            return parts, peak, groups
        got = [share((parts, peak, groups) if src == self.rank else None, src) for src in range(self.size)]
        if self.lending:
            by_expert = {e: p for r, g in enumerate(got) for e, p in zip(self.of_rank(r), g[0])}
            merged = [by_expert[e] for e in sorted(by_expert)]
        else:
            merged = [p for g in got for p in g[0]]
        return merged, max(g[1] for g in got), sum(g[2] for g in got)


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
