"""The calibration batches divided across ``torchrun`` ranks (:mod:`compressor.distributed`).

With several ranks, each holds and runs only its share of the calibration batches through a decoder
layer whose step divides them (:meth:`compressor.quant.algorithms.Algorithm.divides_samples`: GPTQ and
GPTAQ without the refinement, AWQ and AWQ+GPTQ, RTN, ``none`` with static KV scales; a layer without
routed experts held whole, without a key rotation): batch ``j`` of ``n`` belongs to rank ``j %
world_size``, so the layer's forward passes (the Hessian passes, the GPTAQ float stream, AWQ's observe,
the recompute that makes the next layer's inputs) and the activations held divide by the number of
ranks. AWQ's statistics travel the same way (:mod:`compressor.quant.awq_observe`): every batch's
per-call ``|x|`` sums, in batch order, and the loss sequences' inputs and outputs.

Exactness. GPTQ's Hessians (:class:`compressor.quant.gptq.HessianAccumulator`) are float64 sums of one
float32 product per batch, so a sum of per-rank partial sums would differ from one process's in the last
bits. Instead the *inputs* travel: in round ``m`` every rank runs its batch ``m * world_size + rank``,
keeping the inputs of the watched linears, then each rank's batch is broadcast from it in rank order
(:meth:`Samples.rounds`), and every rank adds every batch to the Hessian blocks it sums, in batch order:
the same calls with the same tensors as one process. A batch's inputs (``tokens x in``) are smaller than a
Hessian (``in x in``) at calibration batch sizes, and only one batch per rank is held at a time. What
else the layer gathers over the batches is exact under any order: the KV observers' absmax and the
largest activation (all-reduced with ``MAX``). The output-error figure reads the first batch, rank 0's,
and so does the KV scale search by attention (``kv_cache.scale_search_samples`` sequences, when batch 0
holds them): rank 0 searches on the maxima and sends every rank its ranges. So the artifact is one
process's, bit for bit, for any number of ranks.

A layer whose step does not divide the batches (routed experts held whole, a key rotation, a KV scale
search or AWQ's loss on more sequences than a batch, the refinement) gets them all back first (:meth:`Samples.gather`)
and runs as every rank did before; its outputs are divided again after it. The resume checkpoint (rank
0) and the head's Hessian take every batch (:meth:`Samples.gather` to rank 0).
"""

from __future__ import annotations

from typing import Callable

import torch

from .distributed import all_max, broadcast, recv, send, share, world

__all__ = ["Samples", "division_warnings"]


class Samples:
    """This rank's share of ``n`` calibration batches (the module docstring): batch ``j`` on rank
    ``j % size``; ``shapes``: every batch's ``[b, T, H]`` (float32 on ``device``), known to every rank."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device, rank: int, size: int):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.rank, self.size, self.n = rank, size, len(shapes)
        #: the global indices of this rank's batches, in order
        self.mine = list(range(rank, self.n, size))
        #: the decoder layers that ran divided, and the forwards of a batch this rank ran in their passes
        self.layers_divided = self.forwards = 0

    @classmethod
    def of(cls, hidden: list[torch.Tensor]) -> "Samples | None":
        """The division of ``hidden`` (every batch, as every rank captured it) under the current
        process group; ``None`` for one process, or when there are fewer batches than ranks."""
        rank, size = world()
        if size == 1 or len(hidden) < size:
            return None
        return cls([tuple(h.shape) for h in hidden], hidden[0].dtype, hidden[0].device, rank, size)

    def own(self, whole: list | None) -> list | None:
        """This rank's batches of ``whole`` (every batch, in order); ``None`` stays ``None``."""
        return None if whole is None else [whole[j] for j in self.mine]

    def gather(self, own: list | None, dst: int | None = None) -> list | None:
        """Every batch, in order, from this rank's ``own``: on every rank (``dst`` None, one broadcast
        a batch from its rank), or on rank ``dst`` alone (point to point; the others get ``None``).
        ``None`` stays ``None`` (on every rank alike)."""
        if own is None:
            return None
        out = []
        for j in range(self.n):
            src, m = j % self.size, j // self.size
            if dst is None:
                t = own[m] if self.rank == src else torch.empty(self.shapes[j], dtype=self.dtype, device=self.device)
                broadcast(t, src)
            elif self.rank == src:
                t = own[m]
                if src != dst:
                    send(t.contiguous(), dst)
            elif self.rank == dst:
                t = torch.empty(self.shapes[j], dtype=self.dtype, device=self.device)
                recv(t, src)
            else:
                t = None
            out.append(t)
        return out if dst is None or self.rank == dst else None

    def rounds(self, own: list, run: Callable[[int, torch.Tensor], list[tuple[str, torch.Tensor]]],
               consume: Callable[[int, str, torch.Tensor], None]) -> None:
        """Every batch's kept tensors on every rank, in batch order: in round ``m`` this rank calls
        ``run(m, own[m])`` on its ``m``-th batch (``[(key, tensor), ...]``: what that batch's forward
        kept, in order), then for each rank in order its batch's keys, shapes and dtypes are shared
        and its tensors broadcast, and ``consume(j, key, tensor)`` is called with the global batch
        index ``j`` on every rank. ``consume`` may keep the tensors (the source rank's own, or a new
        buffer) but must not change them."""
        for m in range(-(-self.n // self.size)):
            kept = run(m, own[m]) if m < len(own) else []
            self.forwards += m < len(own)
            for src in range(self.size):
                j = m * self.size + src
                if j >= self.n:
                    break
                meta = share([(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in kept]
                             if self.rank == src else None, src)
                for n, (key, shape, dtype) in enumerate(meta):
                    t = kept[n][1].contiguous() if self.rank == src else torch.empty(
                        shape, dtype=getattr(torch, dtype), device=self.device)
                    broadcast(t, src)
                    consume(j, key, t)
            del kept

    def gather_calls(self, own: list) -> list:
        """Every batch's routed-expert call ``(x [N, H], index [N, k], weights [N, k])``, in batch order, on
        every rank, from this rank's ``own`` (one per batch: :class:`compressor.moe_stream.ExpertTap`'s record
        of its batches), one batch per rank broadcast at a time (:meth:`rounds`). The experts' owners
        (:mod:`compressor.moe_ranks`) then see every token, as with undivided batches."""
        got: dict[int, dict] = {}
        self.rounds(own, lambda _m, c: list(zip("xiw", c)), lambda j, k, t: got.setdefault(j, {}).__setitem__(k, t))
        return [(got[j]["x"], got[j]["i"], got[j]["w"]) for j in range(self.n)]

    def from_rank0(self, calls: list) -> list:
        """Rank 0's ``calls`` (a few small tensors: the float reference's expert call) on every rank."""
        return share(calls if self.rank == 0 else None, 0)

    def amax(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (float, the same shape on every rank) replaced in place by its elementwise maximum over
        the ranks (:func:`compressor.distributed.all_max`: exact in any order)."""
        all_max(t)
        return t

    def figures(self) -> dict:
        """This rank's part of the run (``kvq quantize --json``'s ``ranks``): its batches of all, the layers
        that ran divided, and the batch forwards it ran in their Hessian passes and AWQ observes
        (:meth:`rounds`)."""
        return {"calibration_batches": len(self.mine), "of_batches": self.n, "layers_divided": self.layers_divided,
                "hessian_pass_forwards": self.forwards}

    def divides(self, layer, ctx, algorithm, streamed: bool) -> bool:
        """Whether decoder ``layer`` runs on the ranks' shares (the module docstring): the algorithm
        divides them (:meth:`~compressor.quant.algorithms.Algorithm.divides_samples`), the layer has no
        routed experts or is streamed, the key basis is left alone (``kv_cache.key_rotation``),
        and the KV scale search by attention (if any) and AWQ's loss (``awq.loss_samples``, whose output-error
        figure rank 0 computes) read no more sequences than the first batch holds."""
        searched = ctx.observer is not None and ctx.kv_scale_search == "attention"
        if algorithm.folds_input_scales and ctx.loss_n > self.shapes[0][0]:
            return False  # AWQ: loss sequences beyond rank 0's first batch
        return (algorithm.divides_samples(ctx) and (streamed or ctx.experts(layer) is None)
                and ctx.kv_key_rotation == "none"
                and (not searched or ctx.recipe.kv_cache.scale_search_samples <= self.shapes[0][0]))

    def whole(self, hidden: list, ctx) -> list:
        """Every batch back on every rank, for a layer that does not divide them: ``hidden``'s and
        ``ctx.float_hidden``'s (GPTAQ's float stream, replaced in ``ctx``)."""
        ctx.float_hidden = self.gather(ctx.float_hidden)
        return self.gather(hidden)

    def split(self, hidden: list, ctx) -> list:
        """This rank's share again after such a layer (the inverse of :meth:`whole`)."""
        ctx.float_hidden = self.own(ctx.float_hidden)
        return self.own(hidden)

    def reduce_layer(self, i: int, peak: list, observer, search: Callable[[], dict], searched: bool) -> dict:
        """After a divided layer's recompute on every rank: ``peak[0]`` (the largest activation) and
        layer ``i``'s KV observer absmax (``[kv_heads]`` each) become the maxima over every batch; with
        ``searched`` (``kv_cache.scale_search: attention``) rank 0 runs ``search()`` (its recorder saw the
        first sequences, batch 0's: :meth:`divides`) on those maxima and its ranges and figure go to every
        rank. Returns the search's figure (``{}`` without one)."""
        t = torch.tensor([peak[0]], dtype=torch.float64)
        peak[0] = float(self.amax(t)[0])
        obs = observer.layers[i] if observer is not None else None
        if obs is None or obs.k_absmax is None:
            return {}
        self.amax(obs.k_absmax)
        self.amax(obs.v_absmax)
        if not searched:
            return {}
        figure = search() if self.rank == 0 else None
        figure, obs.k_absmax, obs.v_absmax = share((figure, obs.k_absmax, obs.v_absmax) if self.rank == 0 else None)
        return figure


def division_warnings(hidden: list, ctx, algorithm, samples: "Samples | None") -> list[str]:
    """What the run's warnings say when several ranks do not divide the batches as the user may expect
    (``hidden``: every calibration batch, ``[b, T, H]`` each; ``samples``: :meth:`Samples.of`'s division or
    ``None``): fewer batches than ranks (nothing divided), AWQ's loss sequences beyond the first batch (every
    layer takes every batch)."""
    out, size = [], world()[1]
    b = hidden[0].shape[0] if hidden else 0
    if size > 1 and samples is None and algorithm.divides_samples(ctx):
        out.append(f"{len(hidden)} calibration batch(es) of {b} sequences for {size} ranks: the batches are not "
                   f"divided, every rank runs every one (more than {b * (size - 1)} calibration sequences divide them)")
    if samples is not None and algorithm.folds_input_scales and ctx.loss_n > b:
        out.append(f"awq.loss_samples {ctx.loss_n} exceeds the first calibration batch ({b} sequences): under "
                   f"{size} ranks every layer takes every batch back (not divided)")
    return out
