"""``kvq verify`` under ``torchrun`` (issue #44): the evaluation windows dealt to the ranks, one
report from rank 0.

Launch it as ``kvq quantize`` is launched (docs/distributed.md)::

    torchrun --nproc-per-node 2 .venv/bin/kvq verify ART --max-windows 8

Rank ``r`` of ``W`` evaluates the contiguous block of windows ``[n*r/W, n*(r+1)/W)``
(:meth:`Share.block`, the split :func:`compressor.moe_ranks.bounds` gives routed experts: the same
for the same window count and rank count). Each rank keeps each window's figures as plain tensors
and numbers (:func:`compressor.evaluate.window_record`: NLL sums, per-position NLL and top-1,
per-token KL; per-layer hidden-state error sums); :meth:`Share.gather` sends them to rank 0 as flat
tensors (:func:`compressor.distributed.gather`, never pickled), where they are added in window
order exactly as one process adds them (:func:`compressor.evaluate.fold`): the report's figures
are the one-process figures, bit for bit.

What one rank does alone is wrapped in :func:`agree`: rank 0 works, and its outcome -- a value,
or the error it raised -- reaches every rank, so every rank exits with the same code (0, 1 for a
failed check or gate, 2 for bad input) and only rank 0 prints. A rank that dies stops the others
in one line (:class:`compressor.distributed.Watch`, joined by :func:`join`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import CheckFailed, InputError, KvqError, QuantizationError

#: the errors :func:`agree` raises again on the other ranks, by name
_ERRORS = {cls.__name__: cls for cls in (InputError, CheckFailed, QuantizationError, KvqError)}


@dataclass(frozen=True)
class Share:
    """This rank's place among ``world`` ranks (``world >= 2``)."""

    rank: int
    world: int

    def block(self, n: int) -> tuple[int, int]:
        """``[lo, hi)``: the contiguous block of ``n`` items (windows, layers) this rank takes; blocks
        in rank order, sizes differing by at most one, the same for the same ``n`` and ``world``."""
        from .moe_ranks import bounds

        return bounds(n, self.rank, self.world)

    def mine(self, i: int, n: int) -> bool:
        """Whether item ``i`` of ``n`` is in this rank's :meth:`block`."""
        lo, hi = self.block(n)
        return lo <= i < hi

    def gather(self, items: list) -> list | None:
        """Every rank's ``items`` (each a list of what :func:`compressor.distributed.pack` sends:
        tensors, numbers, strings, lists, dicts) on rank 0, joined in rank order -- window order
        when each rank's are its :meth:`block`'s, in order; ``None`` on the other ranks.

        Raises:
            TypeError: an item holds what :func:`compressor.distributed.pack` cannot send.
        """
        from .distributed import gather

        got = gather(items)
        return None if got is None else [x for part in got for x in part]


def join(device: str) -> tuple[Share | None, str]:
    """Join the ``torchrun`` process group, if any (:func:`compressor.distributed.setup`, which
    starts the watch over the other ranks). Returns ``(share, device)``: ``share`` ``None`` for
    one process.

    Raises:
        InputError: the process group cannot form (:func:`compressor.distributed.setup`).
    """
    from .distributed import setup

    rank, world, device = setup(device)
    return (Share(rank, world) if world > 1 else None), device


def agree(share: Share | None, work: Callable[[], object], send: Callable[[object], object] = lambda v: None,
          elsewhere: Callable[[object], object] = lambda sent: None):
    """Work rank 0 does alone, its outcome on every rank.

    Rank 0 returns ``work()`` and sends ``send(value)`` (what :func:`compressor.distributed.pack`
    sends) to the others, which return ``elsewhere(sent)``. A :class:`~compressor.errors.KvqError`
    that ``work`` raises is raised again on every other rank, the same class and message, marked
    ``quiet`` (the CLI exits with its code without printing it: rank 0 says it). One process:
    ``work()``.

    Raises:
        KvqError: what ``work`` raised on rank 0.
    """
    from .distributed import share as broadcast_obj

    if share is None:
        return work()
    if share.rank == 0:
        try:
            value = work()
        except KvqError as e:
            broadcast_obj(["error", type(e).__name__ if type(e).__name__ in _ERRORS else "KvqError", str(e)])
            raise
        broadcast_obj(["ok", send(value)])
        return value
    got = broadcast_obj(None)
    if got[0] == "error":
        err = _ERRORS[got[1]](got[2])
        err.quiet = True  # rank 0 prints it
        raise err
    return elsewhere(got[1])
