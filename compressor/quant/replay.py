"""Outputs of a decoder layer's finished parts, kept per calibration batch and replayed.

GPTQ's true-sequential passes (:mod:`compressor.quant.gptq_layer`) run the decoder layer
once per stage of linears, and the driver runs it once more to give the next layer its
inputs (:func:`compressor.pipeline._recompute`). Once every quantized linear of a direct
child of the layer (its attention, say) is final, and so is everything upstream of it, that
child's output on a calibration batch no longer changes: :class:`ModuleReplay` keeps it the
first time the child runs in that state and returns a copy instead of running the child in
the later passes and in the recompute. The forward is deterministic, so the values are the
ones the child would compute again, and the artifact is the same (``tests/test_replay.py``).

Children holding no quantized linear are never kept (they are cheap: norms). The kept
outputs cost one ``[batch, T, hidden]`` copy of the calibration activations per child; a
layer keeps them only while they fit in the byte budget it is given.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def _copy(out):
    """A copy of a child's output (a tensor, or a tuple/list holding tensors and ``None``)."""
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
    """Per-batch outputs of a decoder layer's final children (module docstring).

    ``layer``: the decoder layer; ``children``: the names of its direct children that hold a
    quantized linear; ``budget``: bytes the kept outputs may take (``None``: unbounded).
    Callers mark children final with :meth:`finalize` once all their quantized linears and
    everything upstream are, set :attr:`batch` to the calibration batch's index before each
    forward, and run the forwards inside :meth:`active`.

    ``peak`` is the largest absolute value among the outputs of the ``nn.Linear`` modules
    inside the kept children (float32), for the driver's float16 range check, which does
    not see the linears of a replayed child run.
    """

    def __init__(self, layer: torch.nn.Module, children: list[str], budget: int | None):
        self.layer = layer
        self.children = list(children)
        self.budget = budget
        self.final: list[str] = []
        self.kept: dict[str, dict[int, object]] = {}
        self.held = 0
        self.batch = 0
        self.peak = 0.0
        self.replayed = 0

    def finalize(self, names) -> None:
        """Mark ``names`` (children of the layer) final: from the next :meth:`active` on, their
        outputs are kept and replayed."""
        for n in names:
            if n in self.children and n not in self.final:
                self.final.append(n)
                self.kept[n] = {}

    @contextmanager
    def active(self, record: bool = True):
        """Within the block, a final child returns its kept output for :attr:`batch` when it
        has one, and otherwise runs and (with ``record``, while the budget allows) keeps it."""
        patched, handles = [], []
        for name in self.final:
            child = getattr(self.layer, name)
            child.forward = self._wrap(name, child.forward, record)
            patched.append(child)
            if record:
                handles += [m.register_forward_hook(self._track) for m in child.modules()
                            if isinstance(m, torch.nn.Linear)]
        try:
            yield self
        finally:
            for child in patched:
                del child.forward  # the class's forward again
            for h in handles:
                h.remove()

    def _track(self, _mod, _inp, out) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.peak = max(self.peak, float(out.detach().abs().amax()))

    def _wrap(self, name: str, forward, record: bool):
        kept = self.kept[name]

        def replayed_forward(*args, **kwargs):
            j = self.batch
            if j in kept:
                self.replayed += 1
                return _copy(kept[j])
            out = forward(*args, **kwargs)
            size = _nbytes(out)
            if record and (self.budget is None or self.held + size <= self.budget):
                kept[j] = _copy(out)
                self.held += size
            return out

        return replayed_forward
