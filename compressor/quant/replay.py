"""Outputs of a decoder layer's finished parts, kept per calibration batch and replayed.

GPTQ's true-sequential passes (:mod:`compressor.quant.gptq_layer`) run the decoder layer
once per stage of linears, and the driver runs it once more to give the next layer its
inputs (:func:`compressor.quant.layer.recompute_layer`). Once a part of the layer has its weights
and its inputs final, its output on a calibration batch no longer changes:
:class:`ModuleReplay` keeps it the first time the part runs in that state and returns a
copy instead of running it again. The parts are the layer's direct children (its
attention, once ``o_proj`` is solved: replayed by the later passes and the recompute) and
single linears (q/k/v, replayed while the attention is computed once more in full; gate/up,
replayed by the recompute). The forward is deterministic, so the values are the ones the
part would compute again, and the artifact is the same (``tests/test_replay.py``).

The kept outputs cost activation memory (a child's: one ``[batch, T, hidden]`` copy of the
calibration activations; a linear's: its output width); a layer keeps them only while they
fit in the byte budget it is given, and lets a linear's go once its child's are kept.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..arch import get_module
from .primitives import abs_max


def _copy(out):
    """A copy of a part's output (a tensor, or a tuple/list holding tensors and ``None``)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copy(o) for o in out)
    return out


def _nbytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


class ModuleReplay:
    """Per-batch outputs of a decoder layer's final parts (module docstring).

    ``layer``: the decoder layer; ``budget``: bytes the kept outputs may take (``None``:
    unbounded). Callers mark parts final with :meth:`finalize` (relative module paths: a
    child such as ``self_attn`` or a linear such as ``mlp.up_proj``) once their weights and
    everything upstream are, set :attr:`batch` to the calibration batch's index before each
    forward, run the forwards inside :meth:`active`, and :meth:`release` what no later
    forward needs. A part called several times in one forward is kept per call.

    ``peak`` is the largest absolute value among the outputs of the ``nn.Linear`` modules
    inside the kept parts (float32), for the driver's float16 range check, which does not
    see the linears of a replayed child run.
    """

    def __init__(self, layer: torch.nn.Module, budget: int | None):
        self.layer = layer
        self.budget = budget
        self.final: list[str] = []
        self.kept: dict[str, dict[tuple[int, int], object]] = {}
        self.held = 0
        self.batch = 0
        self.peak = 0.0
        self.replayed = 0
        self.released: set[str] = set()
        self._calls: dict[str, int] = {}

    def finalize(self, paths) -> None:
        """Mark ``paths`` final: from the next :meth:`active` on, their outputs are kept and
        replayed (a path once released stays so)."""
        for p in paths:
            if p not in self.final and p not in self.released:
                self.final.append(p)
                self.kept[p] = {}

    def release(self, paths) -> None:
        """Drop the kept outputs of ``paths`` (no later forward reads them); they are no longer replayed."""
        for p in paths:
            if p in self.final:
                self.held -= sum(_nbytes(o) for o in self.kept.pop(p).values())
                self.final.remove(p)
                self.released.add(p)

    def complete(self, path: str, n_batches: int) -> bool:
        """Whether ``path``'s output is kept for every one of ``n_batches`` batches."""
        return {j for j, _ in self.kept.get(path, {})} == set(range(n_batches))

    def start_batch(self, j: int) -> None:
        """The next forward is calibration batch ``j``."""
        self.batch = j
        self._calls.clear()

    @contextmanager
    def active(self, record: bool = True):
        """Within the block, a final part returns its kept output for the current batch (and
        call) when it has one, and otherwise runs and (with ``record``, while the budget
        allows) keeps it."""
        patched, handles = [], []
        for path in self.final:
            part = get_module(self.layer, path)
            part.forward = self._wrap(path, part.forward, record)
            patched.append(part)
            if record:
                handles += [m.register_forward_hook(self._track) for m in part.modules()
                            if isinstance(m, torch.nn.Linear)]
        try:
            yield self
        finally:
            for part in patched:
                del part.forward  # the class's forward again
            for h in handles:
                h.remove()

    def _track(self, _mod, _inp, out) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            self.peak = max(self.peak, abs_max(out))

    def _wrap(self, path: str, forward, record: bool):
        kept = self.kept[path]

        def replayed_forward(*args, **kwargs):
            call = self._calls.get(path, 0)
            self._calls[path] = call + 1
            key = (self.batch, call)
            if key in kept:
                self.replayed += 1
                return _copy(kept[key])
            out = forward(*args, **kwargs)
            size = _nbytes(out)
            if record and (self.budget is None or self.held + size <= self.budget):
                kept[key] = _copy(out)
                self.held += size
            return out

        return replayed_forward
