"""Calling one decoder layer outside its model: the keyword arguments each layer is called with
(attention masks, RoPE of the layer's type, cache position), recorded from the model's own
forward, and the hidden states entering the first layer. Used by the quantize pipeline's
layer loop (:mod:`compressor.pipeline`) and by the streamed verify (:mod:`compressor.streamed_eval`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .arch import ArchSpec, checkpoint_name, get_module
from .errors import InputError, QuantizationError
from .quant.layer import StopForward

#: keyword arguments of a decoder layer that belong to the caller's cache, not to the layer
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache", "output_attentions", "cache_position")


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer ``index``: records its input, stops the forward at ``stop``."""

    def __init__(self, index: int, record, stop: int, returns_tuple: bool = False):
        super().__init__()
        self.index, self.record, self.stop, self.returns_tuple = index, record, stop, returns_tuple

    def forward(self, hidden_states, *args, **kwargs):
        self.record(self.index, hidden_states, kwargs)
        if self.index == self.stop:
            raise StopForward
        return (hidden_states, None) if self.returns_tuple else hidden_states


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def layer_kwargs(model, arch: ArchSpec, ids: torch.Tensor, **forward) -> list[dict]:
    """The keyword arguments each decoder layer receives when ``model`` runs ``ids [1, T]``
    (int64): ``attention_mask``, ``position_embeddings``, ``position_ids``, as the model's own
    forward builds them (sliding windows, per-layer-type RoPE); the caller's cache arguments
    are left out. ``forward``: further arguments of the model's forward (``use_cache``, a cache
    whose length places ``ids`` after earlier tokens). The decoder layers are replaced by
    catchers (restored afterwards), so only the embedding, masks and RoPE run: the layers may
    be on ``meta``.

    Raises:
        QuantizationError: the model did not call some decoder layer.
    """
    layers = get_module(model, arch.layers)
    originals = list(layers)
    n = len(originals)
    kwargs: list[dict | None] = [None] * n

    def record_kwargs(i, _h, kw):
        kwargs[i] = {k: v for k, v in kw.items() if k not in _CACHE_KWARGS}

    try:
        for i in range(n):
            layers[i] = _Catcher(i, record_kwargs, n - 1, arch.layer_returns_tuple)
        try:
            model(input_ids=ids, **forward)
        except StopForward:
            pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    missing = [i for i, k in enumerate(kwargs) if k is None]
    if missing:
        raise QuantizationError(f"the model's forward did not reach decoder layer {missing[0]}; cannot capture its inputs")
    return kwargs


@torch.no_grad()
def capture_layer_inputs(model, arch: ArchSpec, calib_ids: torch.Tensor, batch_size: int, device: str,
                         kwargs_only: bool = False, ckpt=None):
    """Inputs of decoder layer 0 and the keyword arguments of every layer, from the model's own forward.

    One forward of one sequence records each layer's keyword arguments (:func:`layer_kwargs`;
    batch 1, so they broadcast over any batch); then, with layer 0 replaced by a catcher
    (restored afterwards), one forward per batch of ``calib_ids [n, T]`` records layer 0's
    input. Only the embedding (and mask/RoPE construction) runs. ``ckpt``: a streamed source's
    reader; an embedding left on ``meta`` (``open_lazy(defer_embedding=True)``) is then read
    row by row, only the tokens' rows (:func:`compact_embedding`, :func:`read_rows`).

    Returns:
        ``(hidden, kwargs)``: list of float32 ``[b, T, H]`` on ``device`` (empty with
        ``kwargs_only``, when resuming), and one dict per layer.

    Raises:
        QuantizationError: the model did not call some decoder layer.
    """
    rows = None if ckpt is None else (
        lambda u: read_rows(ckpt, checkpoint_name(arch, f"{arch.embed_tokens}.weight"), u))
    with compact_embedding(model, calib_ids if not kwargs_only else calib_ids[:1], rows) as ids:
        kwargs = layer_kwargs(model, arch, ids[:1], use_cache=False)
        layers = get_module(model, arch.layers)
        first = layers[0]
        hidden: list[torch.Tensor] = []

        def record_hidden(_i, h, _kw):
            hidden.append(h.detach().float().to(device))

        try:
            layers[0] = _Catcher(0, record_hidden, 0)
            for b in [] if kwargs_only else ids.split(batch_size):
                try:
                    model(input_ids=b, use_cache=False)
                except StopForward:
                    pass
        finally:
            layers[0] = first
    if not kwargs_only and len(hidden) != len(calib_ids.split(batch_size)):
        raise QuantizationError("the model's forward did not reach decoder layer 0; cannot capture its inputs")
    return hidden, [_to_device(k, device) for k in kwargs]


@contextmanager
def compact_embedding(model, ids: torch.Tensor, rows):
    """While the block runs, ``model``'s input embedding on ``meta`` is replaced by a copy of the
    module holding only the rows of the tokens in ``ids`` (``rows(unique ids [U] int64) -> [U, H]``,
    :func:`read_rows`), and the block gets ``ids`` renumbered into those rows: the same hidden
    states as the whole table gives, at the cost of ``U`` rows (a calibration set of 16 x 128
    tokens reads about 2,000 of Kimi K2's 163,840 rows: 4.7 GB of float32 not read, on every
    rank). An embedding already loaded, or ``rows`` None: the block gets ``ids`` as they are."""
    emb = model.get_input_embeddings()
    if rows is None or not getattr(emb, "weight", torch.empty(0)).is_meta:
        yield ids
        return
    uniq, local = torch.unique(ids, return_inverse=True)
    small = copy.copy(emb)  # the module's class and settings (e.g. an embedding scale), its own parameters
    small._parameters = dict(emb._parameters)
    small.weight = torch.nn.Parameter(rows(uniq), requires_grad=False)
    model.set_input_embeddings(small)
    try:
        yield local.reshape(ids.shape)
    finally:
        model.set_input_embeddings(emb)


def read_rows(ckpt, name: str, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``index`` ([U] int64, ascending) of the 2-D tensor ``name`` of a streamed source ``ckpt``
    (:class:`compressor.source.lazy.LazyCheckpoint`) as ``dtype`` ``[U, H]``: each row read on its
    own (``pread`` of its bytes, counted in ``ckpt.bytes_read``) from a plain float tensor; any other
    (block-FP8, another reader) is read whole and indexed.

    Raises:
        InputError: a row holds NaN or Inf, an index outside the table (named), a truncated shard.
    """
    from .quant.inplace_linalg import all_finite
    from .source.lazy import _DTYPES

    shard, e = getattr(ckpt, "where", {}).get(name, (None, None))
    stored = _DTYPES.get(getattr(e, "dtype", None))
    if stored is None or not stored.is_floating_point or stored.itemsize < 2 or len(e.shape) != 2:
        out = ckpt.get(name, dtype)[index]
    else:
        n_rows, width = e.shape
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_rows):
            raise InputError(f"{shard}: token id {int(index.max())} is outside {name} ({n_rows} rows)")
        row = width * stored.itemsize
        raw = torch.empty(index.numel(), row, dtype=torch.uint8)
        with open(shard, "rb") as f:
            for k, r in enumerate(index.tolist()):
                f.seek(e.start + r * row)
                if f.readinto(memoryview(raw[k].numpy())) != row:
                    raise InputError(f"{shard}: truncated while reading {name}")
        ckpt.bytes_read += raw.numel()
        out = raw.view(stored).reshape(index.numel(), width).to(dtype)
    if out.is_floating_point() and not all_finite(out):
        raise InputError(f"source model tensor {name} contains NaN or Inf; refusing to quantize")
    return out
