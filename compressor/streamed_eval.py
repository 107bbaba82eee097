"""Perplexity, KL, top-1 and per-layer hidden-state error of models larger than memory.

``kvq verify --stream`` compares an artifact with its reference without either model ever
being whole in memory. Both are built with their decoder layers on ``meta``
(:func:`compressor.source.open.open_lazy`: embedding, final norm and RoPE buffers loaded, an
untied head left on ``meta``); every evaluation window is embedded once, then the models
advance together one decoder layer at a time:

1. layer ``i`` of each model is read from its files (the reference through
   :class:`~compressor.source.lazy.LazyCheckpoint`, block-FP8 dequantized per tensor; the
   artifact's packed linears dequantized per tensor by the format's reader);
2. every configuration (the reference, and each candidate: the artifact or the reference,
   with or without a quantized KV cache) runs all its windows through its model's layer ``i``,
   with the keyword arguments the model's own forward gives that layer
   (:func:`compressor.layer_inputs.layer_kwargs`: masks, RoPE of the layer's type);
3. the per-layer hidden-state error is summed, and both layers go back to ``meta``.

A configuration with a quantized KV cache feeds each window in chunks of ``kv_chunk`` tokens
through a fresh cache, as :func:`compressor.evaluate.window_hidden` does for the whole model:
layer ``i``'s output for chunk ``c`` depends only on its own cache and its input for chunk
``c``, so running chunk after chunk through layer ``i`` (its cache layer filled as the whole
model fills it) gives the same states. The keyword arguments of chunk ``c`` are captured
from the model's forward with a cache that reports the ``c * kv_chunk`` tokens before it.

At the end each model's own forward, with its decoder layers replaced by pass-through
stand-ins, turns each window's last hidden states into logits ``logit_chunk`` positions at a
time (final norm, the head read now, and what the model's class does to its logits:
Gemma's softcapping in the model's dtype, as the whole-model path's
:func:`compressor.evaluate.window_logits` gets them), and the statistics are those of
:func:`compressor.evaluate.compare` (:func:`compressor.evaluate._window_statistics`), equal
to the whole-model figures within float tolerance. Memory holds one decoder layer of each
model, the hidden states of every configuration (``windows x seqlen x hidden`` each), and at
the end both heads and one chunk of logits per configuration (:func:`memory_plan`).

Greedy drift is not computed here: generation runs every layer once per new token.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InputError
from .evaluate import LOGIT_CHUNK, _summary, _window_statistics

GIB = 2**30
#: bytes a Python process with torch and transformers imported holds before any model (measured: about 0.5 GiB)
BASELINE_BYTES = GIB // 2


@dataclass
class LazyModel:
    """A causal LM whose decoder layers are read one at a time.

    ``model``: built by :func:`compressor.source.open.open_lazy` (decoder layers on ``meta``;
    ``defer_head=True`` leaves an untied head there until the statistics need it);
    ``ckpt``: the reader of its tensors; ``dtype``: what they are read and run in;
    ``role``: ``reference`` or ``artifact`` (in messages).
    """

    model: torch.nn.Module
    ckpt: object  # compressor.source.lazy.LazyCheckpoint (or a subclass dequantizing packed linears)
    dtype: torch.dtype
    role: str

    @property
    def arch(self):
        """The model's architecture row (:data:`compressor.arch.ARCHITECTURES`)."""
        from .arch import get_arch

        return get_arch(self.model.config.model_type)

    @property
    def layers(self) -> torch.nn.ModuleList:
        """The decoder layers (on ``meta`` except the one being evaluated)."""
        return self.model.get_submodule(self.arch.layers)

    def load_layer(self, i: int, on_nonfinite: Callable[[str], None] | None = None) -> torch.nn.Module:
        """Decoder layer ``i`` with its tensors read. ``on_nonfinite(name)`` is called for a tensor
        holding NaN or Inf (default: refused).

        Raises:
            InputError: a tensor is missing, unreadable, or holds NaN/Inf without ``on_nonfinite``.
        """
        from .source.lazy import layer_names, load_into

        load_into(self.model, self.ckpt, self.arch, layer_names(self.model, self.arch, i), self.dtype,
                  on_nonfinite or self._refuse_nonfinite)
        return self.layers[i]

    def _refuse_nonfinite(self, name: str):
        raise InputError(f"{self.role} model tensor {name} contains NaN or Inf; it cannot serve as the {self.role}")

    def release_layer(self, i: int) -> None:
        """Decoder layer ``i``'s weights back to ``meta``."""
        from .source.lazy import to_meta

        to_meta(self.layers[i])

    @property
    def tied(self) -> bool:
        """The head is the input embedding."""
        return bool(getattr(self.model.config, "tie_word_embeddings", False))

    def release_embedding(self) -> None:
        """The input embedding back to ``meta`` (kept when the head is tied to it)."""
        from .source.lazy import to_meta

        if not self.tied:
            to_meta(self.model.get_submodule(self.arch.embed_tokens))

    def load_head(self, on_nonfinite: Callable[[str], None] | None = None) -> None:
        """Read an untied head left on ``meta`` (``on_nonfinite``: as for :meth:`load_layer`).

        Raises:
            InputError: unreadable, or NaN/Inf without ``on_nonfinite``.
        """
        from .source.lazy import load_into

        name = f"{self.arch.lm_head}.weight"
        if not self.tied and self.model.get_parameter(name).is_meta:
            load_into(self.model, self.ckpt, self.arch, [name], self.dtype, on_nonfinite or self._refuse_nonfinite)


def open_model(source, dtype: torch.dtype, role: str, ckpt=None):
    """``(LazyModel, tokenizer)`` of a Hugging Face folder (``source``: a
    :class:`compressor.source.resolve.ModelSource`), read through ``ckpt`` (default: the folder's
    :class:`~compressor.source.lazy.LazyCheckpoint`; a packed artifact's dequantizing reader).
    A GGUF file is read from kvq's cache of its conversion (made once, whole, when missing:
    :func:`compressor.source.open.open_lazy`'s ``convert_gguf``).

    Raises:
        InputError: the folder cannot be read one layer at a time (the reason named), or
            :func:`check_streamable` refuses its row.
    """
    from .source.open import open_lazy

    lazy = open_lazy(source, dtype, ckpt=ckpt, defer_head=True, convert_gguf=True)
    if lazy[0] is None:
        raise InputError(f"streamed verify cannot read the {role} {source.spec} one decoder layer at a time: {lazy[1]}")
    model, tokenizer, ckpt = lazy
    check_streamable(model)
    return LazyModel(model, ckpt, dtype, role), tokenizer


def check_streamable(model) -> None:
    """Refuse, naming the architecture row, a model the streamed path does not evaluate yet.

    Raises:
        InputError: decoder layers that hand extra outputs to the next layer (GLM-5's top-k
            indices, ``layer_returns_tuple``).
    """
    from .arch import get_arch

    arch = get_arch(model.config.model_type)
    if arch.layer_returns_tuple:
        raise InputError(f"streamed verify does not evaluate {model.config.model_type} yet (its decoder layers hand "
                         "their top-k indices to the next layer); verify it whole, without --stream")


# ---------------------------------------------------------------------------------------
# memory plan


@dataclass
class MemoryPlan:
    """What streamed verify holds at its peak, in bytes (:func:`memory_plan`)."""

    layers: int  #: the largest decoder layer of each model, together
    outer: int  #: embeddings, final norms and heads held during the layer loop (tied heads, norms)
    embeddings: int  #: the input embeddings while the windows are embedded (released after unless tied)
    heads: int  #: the heads at the end
    hidden: int  #: every configuration's hidden states (windows x seqlen x hidden each, twice while a layer runs)
    work: int  #: one window's activations inside a layer, or the logits of one chunk per configuration
    weight_stats: int  #: weight statistics of the largest linear (float64 copies), before the layer's windows run
    streams: int  #: configurations evaluated
    whole: int  #: both models whole (today's path), for the comparison
    parts: dict = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The largest of the three phases (embedding, layer loop, statistics), plus the process baseline."""
        return BASELINE_BYTES + max(self.embeddings + self.hidden,
                                    self.outer + self.layers + self.hidden + max(self.work, self.weight_stats),
                                    self.heads + self.outer + self.hidden + self.work)

    def describe(self) -> str:
        """One line: the peak and what makes it."""
        return (f"{self.peak / GIB:.2f} GiB at peak: one decoder layer of each model {self.layers / GIB:.2f} GiB, "
                f"hidden states of {self.streams} configuration(s) {self.hidden / GIB:.2f} GiB, untied heads "
                f"{self.heads / GIB:.2f} GiB at the end, work {self.work / GIB:.2f} GiB, weight statistics "
                f"{self.weight_stats / GIB:.2f} GiB, process "
                f"{BASELINE_BYTES / GIB:.2f} GiB (both models whole: {self.whole / GIB:.2f} GiB)")

    def as_dict(self) -> dict:
        """The plan for the report (GiB, 3 decimals)."""
        return {k: round(v / GIB, 3) for k, v in (("peak_gib", self.peak), ("layers_gib", self.layers),
                                                   ("hidden_gib", self.hidden), ("heads_gib", self.heads),
                                                   ("work_gib", self.work), ("weight_stats_gib", self.weight_stats),
                                                   ("whole_model_gib", self.whole))}


def _nbytes(module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters read in ``dtype`` (shapes from ``meta`` too)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * size for p in module.parameters())


def memory_plan(reference: LazyModel, artifact: LazyModel | None, n_windows: int, seqlen: int,
                owners: list[str], logit_chunk: int = LOGIT_CHUNK, weight_stats: bool = False) -> MemoryPlan:
    """Estimate the peak memory of :func:`streamed_compare` from the models' shapes (no weight is read).

    Args:
        owners: the model of each configuration (``reference`` / ``artifact``), the reference's own included.

    Returns:
        A :class:`MemoryPlan`: the largest decoder layer of each model, float32 hidden states
        of ``owners`` x ``n_windows x seqlen x hidden`` (two copies while a layer runs), the
        heads and embeddings, one window's activations inside a layer (attention scores of
        every head, the MLP's ``3 x intermediate``), ``logit_chunk x vocab x 4 B x 6`` per
        configuration at the end; with ``weight_stats``, three float64 copies of the largest
        2-D weight (:func:`compressor.quality.weight_report`'s original, artifact and AWQ-undone
        copies).
    """
    models = [m for m in (reference, artifact) if m is not None]
    cfg = reference.model.config
    layers = sum(max(_nbytes(layer, m.dtype) for layer in m.layers) for m in models)
    emb = sum(_nbytes(m.model.get_submodule(m.arch.embed_tokens), m.dtype) for m in models)
    head = sum(0 if m.tied else _nbytes(m.model.get_submodule(m.arch.lm_head), m.dtype) for m in models)
    tied = sum(_nbytes(m.model.get_submodule(m.arch.embed_tokens), m.dtype) for m in models if m.tied)
    norms = sum(_nbytes(m.model.get_submodule(m.arch.final_norm), m.dtype) for m in models)
    hidden = 2 * len(owners) * n_windows * seqlen * cfg.hidden_size * 4
    inter = max(getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "moe_intermediate_size", 0) or 0, cfg.hidden_size)
    work = max(seqlen * (3 * inter + 6 * cfg.hidden_size) * 4 + cfg.num_attention_heads * seqlen * seqlen * 4,
               len(owners) * logit_chunk * cfg.vocab_size * 4 * 6)
    whole = sum(_nbytes(m.model, m.dtype) for m in models)  # every parameter once (a tied head is the embedding)
    largest = max((p.numel() for p in reference.layers.parameters() if p.ndim == 2), default=0)
    return MemoryPlan(layers=layers, outer=tied + norms, embeddings=emb, heads=head, hidden=hidden, work=work,
                      weight_stats=3 * 8 * largest if weight_stats else 0, streams=len(owners),
                      whole=whole + BASELINE_BYTES + work)


# ---------------------------------------------------------------------------------------
# the evaluation


@contextmanager
def _layers_passed_through(models):
    """Each model's decoder layers replaced by pass-through stand-ins (restored on exit): the
    model's forward on ``inputs_embeds`` then applies only its final norm, head and whatever
    its class does to the logits (Gemma's softcapping, in the model's own dtype)."""
    from .layer_inputs import _Catcher

    saved = []
    try:
        for lm in models:
            layers = lm.layers
            saved.append((layers, list(layers)))
            for i in range(len(layers)):
                layers[i] = _Catcher(i, lambda *_: None, -1, lm.arch.layer_returns_tuple)
        yield
    finally:
        for layers, originals in saved:
            for i, layer in enumerate(originals):
                layers[i] = layer


@dataclass
class _Stream:
    """One configuration: its model, cache factory and the hidden states of every window ``[1, T, H]``."""

    owner: LazyModel
    make_cache: Callable[[], object] | None
    hidden: list = field(default_factory=list)


def _chunk_kwargs(lm: LazyModel, x: torch.Tensor, kv_chunk: int, make_cache) -> list[list[dict]]:
    """Per chunk of ``kv_chunk`` tokens of a window ``x [1, T]``, the keyword arguments of every
    decoder layer when the model runs that chunk after the ones before it through a cache
    (``make_cache()``'s, reporting the tokens before the chunk as cached)."""
    from .layer_inputs import layer_kwargs
    from .quant.kv import cache_kwarg

    out = []
    for a in range(0, x.shape[1], kv_chunk):
        cache = make_cache()
        for layer in cache.layers:  # the tokens before the chunk, as the quantized cache counts them
            layer.cumulative_length = a
        out.append(layer_kwargs(lm.model, lm.arch, x[:, a:a + kv_chunk], use_cache=True,
                                **{cache_kwarg(lm.model): cache}))
    return out


def _advance(layer, i: int, stream: _Stream, kw_full: list[dict], kw_chunks: list[list[dict]] | None,
             kv_chunk: int) -> None:
    """Every window of ``stream`` through decoder layer ``i`` (in chunks through a fresh cache
    when the stream has one)."""
    from .quant.layer import layer_forward

    for w, h in enumerate(stream.hidden):
        if stream.make_cache is None:
            stream.hidden[w] = layer_forward(layer, h, kw_full[i])
            continue
        cache = stream.make_cache()
        stream.hidden[w] = torch.cat([layer_forward(layer, h[:, a:a + kv_chunk], kw[i], cache)
                                      for a, kw in zip(range(0, h.shape[1], kv_chunk), kw_chunks)], dim=1)


@torch.no_grad()
def streamed_compare(reference: LazyModel, artifact: LazyModel | None,
                     candidates: dict[str, tuple[str, Callable[[], object] | None]], wins: torch.Tensor | None,
                     kv_chunk: int = 128, hidden_of: str | None = None, hidden_rows: tuple[int, int] = (2, 512),
                     on_layer: Callable | None = None, on_heads: Callable | None = None,
                     on_progress: Callable[[int, int], None] | None = None, logit_chunk: int = LOGIT_CHUNK) -> dict:
    """:func:`compressor.evaluate.compare` and :func:`compressor.evaluate.hidden_state_errors`
    with both models advancing one decoder layer at a time (module docstring).

    Args:
        reference: the original model (float, no quantized cache).
        artifact: the artifact (``None`` when no candidate runs it and no layer callback needs it).
        candidates: label -> (``"reference"`` or ``"artifact"``, make_cache or None).
        wins: ``[n_windows, seqlen]`` int64 token windows; ``None``: no evaluation, only the
            layers (and heads, with ``on_heads``) read in turn for the callbacks (weight statistics).
        hidden_of: the candidate whose per-layer hidden-state error against the reference is
            measured (no cache), over the first ``hidden_rows[1]`` positions of the first
            ``hidden_rows[0]`` windows; ``None``: not measured.
        on_layer: ``on_layer(i, reference_layer, artifact_layer_or_None)`` once both layers are
            read, before any window runs through them (weight statistics, key bases).
        on_heads: ``on_heads(reference_model, artifact_model_or_None)`` once the heads are read.
        on_progress: ``on_progress(done, total)`` after each decoder layer and at the end.

    Returns:
        ``{"results": what compare returns (``None`` without ``wins``), "hidden_state_error": per-layer list or None,
        "nonfinite_tensors": artifact tensors holding NaN/Inf (named), "seconds"}``.

    Raises:
        InputError: a row :func:`check_streamable` refuses; a reference tensor with NaN/Inf.
    """
    t0 = time.perf_counter()
    models = {"reference": reference, "artifact": artifact}
    check_streamable(reference.model)
    streams = {} if wins is None else {"reference": _Stream(reference, None),
                                       **{label: _Stream(models[owner], mc) for label, (owner, mc) in candidates.items()}}
    kw_full: dict[str, list[dict]] = {}
    kw_chunks: dict[str, list[list[dict]] | None] = {}
    for role, lm in models.items():
        if lm is None:
            continue
        mine = [s for s in streams.values() if s.owner is lm]
        if mine:  # layer 0's inputs and each layer's arguments, from the model's own forward
            from .layer_inputs import capture_layer_inputs

            h0, kw_full[role] = capture_layer_inputs(lm.model, lm.arch, wins, 1, "cpu")
            h0 = [h.to(lm.dtype) for h in h0]  # recorded in float32: the model's own values back
            for s in mine:
                s.hidden = list(h0)
            cached = next((s.make_cache for s in mine if s.make_cache is not None), None)
            kw_chunks[role] = _chunk_kwargs(lm, wins[:1], kv_chunk, cached) if cached else None
            del h0
        lm.release_embedding()
    n_layers = len(reference.layers)
    nonfinite: list[str] = []
    rows, cols = hidden_rows
    num = [0.0] * n_layers
    den = [0.0] * n_layers
    for i in range(n_layers):
        lr = reference.load_layer(i)
        la = artifact.load_layer(i, nonfinite.append) if artifact is not None else None
        if on_layer is not None:
            on_layer(i, lr, la)
        for s in streams.values():
            role = "reference" if s.owner is reference else "artifact"
            _advance(lr if s.owner is reference else la, i, s, kw_full[role], kw_chunks[role], kv_chunk)
        if hidden_of is not None and streams:
            for r, a in zip(streams["reference"].hidden[:rows], streams[hidden_of].hidden[:rows]):
                r, a = r[:, :cols].double(), a[:, :cols].double()
                num[i] += float((a - r).pow(2).sum())
                den[i] += float(r.pow(2).sum())
        reference.release_layer(i)
        if artifact is not None:
            artifact.release_layer(i)
        if on_progress is not None:
            on_progress(i + 1, n_layers + 1)
    results = None
    if wins is not None:
        results = _statistics(models, streams, wins, logit_chunk, on_heads, nonfinite.append)
    elif on_heads is not None:
        reference.load_head()
        if artifact is not None:
            artifact.load_head(nonfinite.append)
        on_heads(reference.model, None if artifact is None else artifact.model)
    if on_progress is not None:
        on_progress(n_layers + 1, n_layers + 1)
    hidden = None
    if hidden_of is not None and streams:
        hidden = [math.sqrt(a / b) if b > 0 else math.inf for a, b in zip(num, den)]
    return {"results": results, "hidden_state_error": hidden, "nonfinite_tensors": nonfinite,
            "seconds": round(time.perf_counter() - t0, 2)}


def _statistics(models: dict, streams: dict[str, _Stream], wins: torch.Tensor, logit_chunk: int, on_heads,
                on_nonfinite) -> dict:
    """The final norm and head of each model over its configurations' last hidden states:
    :func:`compressor.evaluate.compare`'s figures (``results["seconds"]``: this phase's;
    ``on_nonfinite``: for the artifact's head)."""
    t0 = time.perf_counter()
    for role, lm in models.items():
        if lm is not None:
            lm.load_head(on_nonfinite if role == "artifact" else None)
    if on_heads is not None:
        on_heads(models["reference"].model, None if models["artifact"] is None else models["artifact"].model)
    acc = {label: {"nll": 0.0, "per": [], "kl": [], "same": 0, "w_kl": [], "w_top1": []} for label in streams}
    count = 0

    def at(label, w):  # logits of positions a..b-1: the model's own forward after its last decoder layer
        s = streams[label]
        return lambda a, b: s.owner.model(inputs_embeds=s.hidden[w][:, a:b], use_cache=False).logits[0].float()

    with _layers_passed_through([m for m in models.values() if m is not None]):
        for w in range(wins.shape[0]):
            _window_statistics(wins[w, 1:], at("reference", w), {label: at(label, w) for label in streams
                                                                 if label != "reference"}, acc, logit_chunk)
            count += wins.shape[1] - 1
            for s in streams.values():
                s.hidden[w] = None  # this window's last states are no longer needed
    out = {label: _summary(label, a, wins, count) for label, a in acc.items()}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
