"""AWQ's first step (Lin et al., 2023, arXiv:2306.00978): what the calibration batches show a decoder layer.

:func:`observe` runs the float layer over the calibration batches with input hooks: the mean ``|x|`` per
input channel of each watched module over every token (the activation statistic AWQ's scales grow
from), the full inputs of the first ``loss_n`` sequences (the scale and clip searches' losses) and the
float layer's output on them (the output-error figure).

Under several ranks (:mod:`compressor.sample_ranks`) each rank runs only its own batches and every
batch's hook records travel to every rank in batch order (:meth:`compressor.sample_ranks.Samples.rounds`):
a channel's ``|x|`` sum is a float32 sum of one per-call sum after another, so the records are added on
every rank in the order one process adds them, and the statistics, the loss inputs and hence the scales
are one process's bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .layer import layer_forward

__all__ = ["InputStats", "loss_batches", "observe"]


class InputStats:
    """Input hooks on ``watched`` (key -> module) while :meth:`hooked` is entered: per key the sum
    of ``|x|`` per input channel (``abs_sum``, ``[in]`` float32, ``None`` if never called), the
    rows seen (``n_rows``) and, of the calls made while :attr:`keep` is true, the inputs
    (``stored``: float32 ``[b, T, in]`` or, for routed experts, ``[n, in]``).

    With :attr:`record` a list, a call is appended to it as ``(key, tensor)`` entries (``"s" + key``:
    its ``|x|`` sum, ``"n" + key``: its rows, ``[1]`` int64, ``"x" + key``: its input when kept) instead
    of being added; :meth:`add` adds such entries, in the order given."""

    def __init__(self, watched: dict):
        self.watched = watched
        self.abs_sum: dict[str, torch.Tensor | None] = {k: None for k in watched}
        self.n_rows = {k: 0 for k in watched}
        self.stored: dict[str, list[torch.Tensor]] = {k: [] for k in watched}
        self.keep = True
        self.record: list | None = None

    def _hook(self, key):
        def hook(_mod, args):
            x = args[0].detach()
            flat = x.abs().float().reshape(-1, x.shape[-1])
            entries = [("s" + key, flat.sum(0)), ("n" + key, torch.tensor([flat.shape[0]]))]
            entries += [("x" + key, x.float())] if self.keep else []
            if self.record is not None:
                self.record.extend(entries)
            else:
                for tag, t in entries:
                    self.add(tag, t)
        return hook

    def add(self, tag: str, t: torch.Tensor) -> None:
        """One record entry (the class docstring) added: ``t`` is kept as given (not copied)."""
        kind, key = tag[0], tag[1:]
        if kind == "s":
            self.abs_sum[key] = t if self.abs_sum[key] is None else self.abs_sum[key] + t
        elif kind == "n":
            self.n_rows[key] += int(t[0])
        else:
            self.stored[key].append(t)

    @contextmanager
    def hooked(self):
        """The hooks, registered on entry and removed on exit."""
        handles = [m.register_forward_pre_hook(self._hook(k)) for k, m in self.watched.items()]
        try:
            yield self
        finally:
            for hd in handles:
                hd.remove()

    def x_mean(self) -> dict:
        """Per key the mean ``|x|`` per input channel, ``[in]`` float32 (``None`` if never called)."""
        return {k: (s / max(self.n_rows[k], 1)) if s is not None else None for k, s in self.abs_sum.items()}

    def loss_inputs(self, linears: dict, hidden: list, loss_n: int) -> dict[str, torch.Tensor]:
        """Per key the inputs the losses use: ``[loss_n, T, in]`` (``[n, in]`` for routed experts: their
        first ``loss_n * T`` tokens); an empty ``[0, in]`` for a key never called while kept."""
        x_loss = {}
        for k, v in self.stored.items():
            if not v:
                width = self.watched[k].in_features if k in linears else hidden[0].shape[-1]
                x_loss[k] = torch.zeros(0, width, device=hidden[0].device)
            elif v[0].ndim == 2:  # routed tokens of one expert
                x_loss[k] = torch.cat(v)[: loss_n * hidden[0].shape[1]]
            else:
                x_loss[k] = torch.cat(v)[:loss_n]
        return x_loss


def loss_batches(hidden: list, loss_n: int) -> list[bool]:
    """Per batch of ``hidden`` (tensors, or their shapes), whether it holds some of the first ``loss_n``
    sequences (its inputs are kept)."""
    out, seen = [], 0
    for h in hidden:
        out.append(seen < loss_n)
        seen += h[0] if isinstance(h, tuple) else h.shape[0]
    return out


def observe(layer, hidden, kw, watched: dict, loss_n: int, samples=None,
            outputs: bool = True) -> tuple[InputStats, list[torch.Tensor]]:
    """Run the float layer over ``hidden`` (a list of ``[b, T, H]`` float32) with input hooks on ``watched``
    (key -> module).

    Returns ``(stats, float_out)``: the :class:`InputStats` of every calibration token, the inputs
    kept for the first ``loss_n`` sequences; the float layer's output on those sequences (a
    list of ``[b, T, H]``). ``samples`` (:class:`compressor.sample_ranks.Samples`): ``hidden`` is this rank's
    share of the batches; the forwards run on it and every rank gets the whole-run statistics, loss inputs
    and (with ``outputs``) outputs (the module docstring), the same tensors as one process's. Without
    ``outputs`` the returned list is empty (a streamed MoE layer, whose routed part is added later).
    """
    stats = InputStats(watched)
    float_out: list[torch.Tensor] = []
    if samples is not None:
        return _observe_divided(layer, hidden, kw, stats, loss_n, samples, float_out if outputs else None)
    seen = 0
    with stats.hooked():
        for h, keep in zip(hidden, loss_batches(hidden, loss_n)):
            stats.keep = keep
            y = layer_forward(layer, h, kw)
            if keep and outputs:
                float_out.append(y[: loss_n - seen])
            seen += h.shape[0]
    return stats, float_out


def _observe_divided(layer, own: list, kw, stats: InputStats, loss_n: int, samples, float_out: list | None):
    """:func:`observe` over this rank's batches ``own``, every batch's records added on every rank in batch order
    (``float_out`` ``None``: the outputs are not sent)."""
    keep = loss_batches(samples.shapes, loss_n)
    before = [sum(s[0] for s in samples.shapes[:j]) for j in range(samples.n)]  # sequences before batch j

    def run(m: int, h: torch.Tensor) -> list:
        j = samples.mine[m]
        stats.keep, stats.record = keep[j], []
        y = layer_forward(layer, h, kw)
        kept, stats.record = stats.record, None
        return kept + ([("y", y[: loss_n - before[j]])] if keep[j] and float_out is not None else [])

    def consume(_j: int, tag: str, t: torch.Tensor) -> None:
        (float_out.append if tag == "y" else lambda v: stats.add(tag, v))(t)

    with stats.hooked():
        samples.rounds(own, run, consume)
    return stats, float_out if float_out is not None else []
