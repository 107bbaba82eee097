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

A mixture-of-experts layer larger than the budget (``expert_group``: one Kimi K2 layer holds
384 routed experts, 68 GB in float32) is read in groups instead
(:func:`compressor.moe_ranks.expert_groups`, the grouping a streamed quantize uses): its
non-expert tensors first, held, then groups of whole routed experts of both models, each read,
used and released before the next (:func:`compressor.moe_stream.forward_grouped`). Every
configuration runs its windows through the layer once with an
:class:`~compressor.moe_stream.ExpertTap` recording the experts' inputs and the routing the
layer's own router computed; each group's experts add their weighted outputs into those
windows' routed outputs in ascending index order (as :class:`compressor.moe.UnfusedExperts`
adds them); the layer then runs again, the tap replaying the routed outputs, so its own code
adds them to the residual and the shared experts: the whole layer's outputs. A quantized KV
cache is filled afresh in each of the two runs (the attention sees the same inputs both times).

At the end each model's own forward, with its decoder layers replaced by pass-through
stand-ins, turns each window's last hidden states into logits ``logit_chunk`` positions at a
time (final norm, the head read now, and what the model's class does to its logits:
Gemma's softcapping in the model's dtype, as the whole-model path's
:func:`compressor.evaluate.window_logits` gets them), and the statistics are those of
:func:`compressor.evaluate.compare` (:func:`compressor.evaluate.window_record`), equal
to the whole-model figures within float tolerance. Memory holds one decoder layer of each
model (or its non-expert part and one group of experts), the hidden states of every
configuration (``windows x seqlen x hidden`` each; one more copy, the experts' recorded
inputs, while experts run in groups), and at the end both heads and one chunk of logits per
configuration (:func:`memory_plan`).

Greedy drift is not computed here: generation runs every layer once per new token.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InputError
from .evaluate import LOGIT_CHUNK, fold, new_acc, summaries, window_record
from .stats import STATS_BLOCK

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

    def load_layer(self, i: int, on_nonfinite: Callable[[str], None] | None = None,
                   names: list[str] | None = None) -> torch.nn.Module:
        """Decoder layer ``i`` with its tensors read (``names``: only those, full in-memory names; a
        group of :func:`compressor.moe_ranks.expert_groups`). ``on_nonfinite(name)`` is called for a
        tensor holding NaN or Inf (default: refused).

        Raises:
            InputError: a tensor is missing, unreadable, or holds NaN/Inf without ``on_nonfinite``.
        """
        from .source.lazy import layer_names, load_into

        load_into(self.model, self.ckpt, self.arch, layer_names(self.model, self.arch, i) if names is None else names,
                  self.dtype, on_nonfinite or self._refuse_nonfinite)
        return self.layers[i]

    def experts(self, i: int):
        """Decoder layer ``i``'s routed experts (:class:`compressor.moe.UnfusedExperts`), ``None`` for a dense layer."""
        from .moe import routed_experts

        return routed_experts(self.layers[i], self.arch)

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
    """Refuse a model the streamed path does not evaluate: GLM-5 layers (``layer_returns_tuple``) that
    read the previous layer's sparse-attention top-k (``indexer_types`` ``"shared"``), which is not
    carried between layers (``kvq quantize`` refuses them too); ``"full"`` layers never read it.
    Raises InputError naming the first such layer."""
    from .arch import get_arch

    shared = [i for i, t in enumerate(getattr(model.config, "indexer_types", None) or ()) if t == "shared"]
    if get_arch(model.config.model_type).layer_returns_tuple and shared:
        raise InputError(f"streamed verify does not evaluate {model.config.model_type} with decoder layer {shared[0]} "
                         "reusing the previous layer's sparse-attention top-k (indexer_types 'shared'); verify it "
                         "whole, without --stream")


# ---------------------------------------------------------------------------------------
# memory plan


@dataclass
class MemoryPlan:
    """What streamed verify holds at its peak, in bytes (:func:`memory_plan`)."""

    layers: int  #: the largest decoder layer of each model, together (its non-expert part when experts are grouped)
    outer: int  #: embeddings, final norms and heads held during the layer loop (tied heads, norms)
    embeddings: int  #: the input embeddings while the windows are embedded (released after unless tied)
    heads: int  #: the heads at the end
    hidden: int  #: every configuration's hidden states (windows x seqlen x hidden each, twice while a layer runs)
    work: int  #: one window's activations inside a layer, or the logits of one chunk per configuration
    weight_stats: int  #: weight statistics of the largest linear (an AWQ-undone float32 copy, float64 row blocks)
    streams: int  #: configurations evaluated
    whole: int  #: both models whole (today's path), for the comparison
    expert_group: int = 0  #: one group of routed experts of both models (0: MoE layers read whole)
    experts_per_group: int = 0  #: routed experts a group holds (0: MoE layers read whole)
    routed_io: int = 0  #: with grouped experts, their recorded inputs beside the hidden states (one more copy)

    @property
    def peak(self) -> int:
        """The largest of the three phases (embedding, layer loop, statistics), plus the process baseline."""
        return BASELINE_BYTES + max(self.embeddings + self.hidden,
                                    self.outer + self.layers + self.expert_group + self.hidden + self.routed_io
                                    + max(self.work, self.weight_stats),
                                    self.heads + self.outer + self.hidden + self.work)

    def describe(self, lead: str | None = None) -> str:
        """One line: the peak (or ``lead``, another figure said first) and what makes it."""
        layers = f"one decoder layer of each model {self.layers / GIB:.2f} GiB"
        if self.experts_per_group:
            layers = (f"the non-expert part of a decoder layer of each model {self.layers / GIB:.2f} GiB, routed "
                      f"experts in groups of {self.experts_per_group} ({self.expert_group / GIB:.2f} GiB, both models; "
                      f"their inputs {self.routed_io / GIB:.2f} GiB)")
        return (f"{lead or f'{self.peak / GIB:.2f} GiB at peak'}: {layers}, "
                f"hidden states of {self.streams} configuration(s) {self.hidden / GIB:.2f} GiB, untied heads "
                f"{self.heads / GIB:.2f} GiB at the end, work {self.work / GIB:.2f} GiB, weight statistics "
                f"{self.weight_stats / GIB:.2f} GiB, process "
                f"{BASELINE_BYTES / GIB:.2f} GiB (both models whole: {self.whole / GIB:.2f} GiB)")

    def as_dict(self) -> dict:
        """The plan for the report (GiB, 3 decimals; ``experts_per_group``: 0 when MoE layers are read whole)."""
        return {**{k: round(v / GIB, 3) for k, v in (
            ("peak_gib", self.peak), ("layers_gib", self.layers), ("expert_group_gib", self.expert_group),
            ("hidden_gib", self.hidden), ("heads_gib", self.heads), ("work_gib", self.work),
            ("weight_stats_gib", self.weight_stats), ("whole_model_gib", self.whole))},
            "experts_per_group": self.experts_per_group}

    @property
    def expert_group_limit(self) -> int | None:
        """The byte limit of a group of experts of both models for :func:`streamed_compare`
        (``None``: MoE layers read whole)."""
        return self.expert_group or None


def _nbytes(module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters read in ``dtype`` (shapes from ``meta`` too)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * size for p in module.parameters())


def _layer_parts(lm: LazyModel) -> tuple[int, int, int, int]:
    """``(largest layer, largest layer without its routed experts, largest routed expert, most
    experts in a layer)`` of ``lm``, in bytes read in its dtype."""
    whole = part = one = most = 0
    for i, layer in enumerate(lm.layers):
        b = _nbytes(layer, lm.dtype)
        experts = lm.experts(i)
        e = _nbytes(experts, lm.dtype) if experts is not None else 0
        whole, part = max(whole, b), max(part, b - e)
        if experts is not None and len(experts):
            one, most = max(one, max(_nbytes(x, lm.dtype) for x in experts)), max(most, len(experts))
    return whole, part, one, most


def memory_plan(reference: LazyModel, artifact: LazyModel | None, n_windows: int, seqlen: int,
                owners: list[str], logit_chunk: int = LOGIT_CHUNK, weight_stats: bool = False,
                budget: int | None = None) -> MemoryPlan:
    """Estimate the peak memory of :func:`streamed_compare` from the models' shapes (no weight is read).

    Args:
        owners: the model of each configuration (``reference`` / ``artifact``), the reference's own included.
        budget: bytes the run may hold, process included; when the plan with whole decoder
            layers exceeds it, MoE layers are planned with their routed experts in groups: as
            many experts of both models as the budget leaves room for, at least one (the
            smallest unit: one expert and the non-expert part of a layer of each model, with
            the hidden states; a plan above ``budget`` is for the caller to refuse).

    Returns:
        A :class:`MemoryPlan`: the largest decoder layer of each model (with grouped experts:
        its non-expert part, plus one group of experts of both models and one more copy of
        the hidden states for the experts' recorded inputs), float32 hidden states
        of ``owners`` x ``n_windows x seqlen x hidden`` (two copies while a layer runs), the
        heads and embeddings, one window's activations inside a layer (attention scores of
        every head, the MLP's ``3 x intermediate``), ``logit_chunk x vocab x 4 B x 6`` per
        configuration at the end; with ``weight_stats``, one float32 copy of the largest 2-D
        weight (:func:`compressor.quality.weight_report`'s AWQ-undone artifact weight; the
        statistics read float64 blocks of rows) or three float64 copies of the largest
        q_proj/k_proj (the RoPE-pair fit), whichever is larger.
    """
    models = [m for m in (reference, artifact) if m is not None]
    cfg = reference.model.config
    parts = [_layer_parts(m) for m in models]
    emb = sum(_nbytes(m.model.get_submodule(m.arch.embed_tokens), m.dtype) for m in models)
    head = sum(0 if m.tied else _nbytes(m.model.get_submodule(m.arch.lm_head), m.dtype) for m in models)
    tied = sum(_nbytes(m.model.get_submodule(m.arch.embed_tokens), m.dtype) for m in models if m.tied)
    norms = sum(_nbytes(m.model.get_submodule(m.arch.final_norm), m.dtype) for m in models)
    copy = len(owners) * n_windows * seqlen * cfg.hidden_size * 4
    inter = max(getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "moe_intermediate_size", 0) or 0, cfg.hidden_size)
    work = max(seqlen * (3 * inter + 6 * cfg.hidden_size) * 4 + cfg.num_attention_heads * seqlen * seqlen * 4,
               len(owners) * logit_chunk * cfg.vocab_size * 4 * 6)
    whole = sum(_nbytes(m.model, m.dtype) for m in models)  # every parameter once (a tied head is the embedding)
    largest = max((p.numel() for p in reference.layers.parameters() if p.ndim == 2), default=0)
    pairs = max((p.numel() for n, p in reference.layers.named_parameters() if p.ndim == 2
                 and n.endswith(("q_proj.weight", "k_proj.weight"))), default=0)
    stats = max(4 * largest, 3 * 8 * pairs) + 3 * 8 * min(STATS_BLOCK, largest)  # + the float64 blocks
    plan = MemoryPlan(layers=sum(p[0] for p in parts), outer=tied + norms, embeddings=emb, heads=head, hidden=2 * copy,
                      work=work, weight_stats=stats if weight_stats else 0, streams=len(owners),
                      whole=whole + BASELINE_BYTES + work)
    one, most = sum(p[2] for p in parts), parts[0][3]
    if budget is None or plan.peak <= budget or not one:
        return plan
    grouped = dataclasses.replace(plan, layers=sum(p[1] for p in parts), routed_io=copy, expert_group=one,
                                  experts_per_group=1)
    n = min(most, max(1, (budget - grouped.peak) // one + 1))
    return dataclasses.replace(grouped, expert_group=n * one, experts_per_group=n)


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
             kv_chunk: int, keep: bool = True) -> None:
    """Every window of ``stream`` through decoder layer ``i`` (in chunks through a fresh cache
    when the stream has one); the outputs replace the windows' hidden states when ``keep``
    (else they are dropped: a recording pass of :func:`compressor.moe_stream.forward_grouped`)."""
    from .quant.layer import layer_forward

    for w, h in enumerate(stream.hidden):
        if stream.make_cache is None:
            out = layer_forward(layer, h, kw_full[i])
        else:
            cache = stream.make_cache()
            out = torch.cat([layer_forward(layer, h[:, a:a + kv_chunk], kw[i], cache)
                             for a, kw in zip(range(0, h.shape[1], kv_chunk), kw_chunks)], dim=1)
        if keep:
            stream.hidden[w] = out


def _advance_grouped(i: int, models: dict, streams: dict, groups: list[list[str]], advance: Callable,
                     on_layer: Callable | None, on_experts: Callable | None, on_nonfinite: Callable) -> None:
    """Decoder layer ``i`` of each model with its routed experts read in ``groups``
    (:func:`compressor.moe_ranks.expert_groups`: the non-expert tensors, then groups of whole
    experts), every configuration's windows advanced through it by
    :func:`compressor.moe_stream.forward_grouped`; ``advance(layer, stream, keep)`` runs a
    stream's windows through a layer. ``on_layer`` is called once the non-expert part is read,
    ``on_experts`` after each group is read (the group's experts read, the others on ``meta``)."""
    from contextlib import ExitStack

    from .arch import expert_index
    from .moe_stream import ExpertTap, forward_grouped
    from .source.lazy import to_meta

    held = {role: lm for role, lm in models.items() if lm is not None}
    read = {role: lm.load_layer(i, on_nonfinite if role == "artifact" else None, names=groups[0])
            for role, lm in held.items()}
    if on_layer is not None:
        on_layer(i, read["reference"], read.get("artifact"))
    arch, prefix = held["reference"].arch, f"{held['reference'].arch.layers}.{i}."

    def each_group():
        for names in groups[1:]:
            for role, lm in held.items():
                lm.load_layer(i, on_nonfinite if role == "artifact" else None, names=names)
            experts = sorted({expert_index(arch, n[len(prefix):]) for n in names})
            if on_experts is not None:
                on_experts(i, read["reference"], read.get("artifact"), experts)
            yield experts
            to_meta(*[lm.experts(i)[e] for lm in held.values() for e in experts])

    taps = {role: ExpertTap(lm.experts(i)) for role, lm in held.items()}
    with ExitStack() as stack:
        for tap in taps.values():
            stack.enter_context(tap.active())
        role = {id(lm): r for r, lm in held.items()}
        forward_grouped([(taps[role[id(s.owner)]], lambda keep, s=s: advance(read[role[id(s.owner)]], s, keep))
                         for s in streams.values()], each_group())


def _embed(models: dict, streams: dict[str, _Stream], wins, kv_chunk: int) -> tuple[dict, dict]:
    """Every stream's layer-0 inputs (each window embedded by its model's own forward), then the
    input embeddings released (kept when tied). Returns ``(kw_full, kw_chunks)`` per role: each
    decoder layer's keyword arguments for a whole window, and per KV chunk (``None`` without a
    cached stream)."""
    from .layer_inputs import capture_layer_inputs

    kw_full: dict[str, list[dict]] = {}
    kw_chunks: dict[str, list[list[dict]] | None] = {}
    for role, lm in models.items():
        if lm is None:
            continue
        mine = [s for s in streams.values() if s.owner is lm]
        if mine:  # layer 0's inputs and each layer's arguments, from the model's own forward
            h0, kw_full[role] = capture_layer_inputs(lm.model, lm.arch, wins, 1, "cpu")
            h0 = [h.to(lm.dtype) for h in h0]  # recorded in float32: the model's own values back
            for s in mine:
                s.hidden = list(h0)
            cached = next((s.make_cache for s in mine if s.make_cache is not None), None)
            kw_chunks[role] = _chunk_kwargs(lm, wins[:1], kv_chunk, cached) if cached else None
            del h0
        lm.release_embedding()
    return kw_full, kw_chunks


@torch.no_grad()
def streamed_compare(reference: LazyModel, artifact: LazyModel | None,
                     candidates: dict[str, tuple[str, Callable[[], object] | None]], wins: torch.Tensor | None,
                     kv_chunk: int = 128, hidden_of: str | None = None, hidden_rows: tuple[int, int] = (2, 512),
                     on_layer: Callable | None = None, on_heads: Callable | None = None,
                     on_progress: Callable[[int, int], None] | None = None, logit_chunk: int = LOGIT_CHUNK,
                     expert_group: int | None = None, on_experts: Callable | None = None, share=None) -> dict:
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
            read, before any window runs through them (weight statistics, key bases); with
            ``expert_group``, for an MoE layer once its non-expert part is read (routed experts
            on ``meta``).
        on_experts: ``on_experts(i, reference_layer, artifact_layer_or_None, experts)`` with
            ``expert_group``, after each group of routed experts of an MoE layer is read
            (``experts``: their indices, ascending; the layer's other experts on ``meta``).
        expert_group: bytes one group of routed experts of both models may hold
            (:attr:`MemoryPlan.expert_group_limit`; at least one expert a group): MoE layers
            are then read and run in groups (:func:`compressor.moe_stream.forward_grouped`),
            each group released before the next; ``None``: each decoder layer read whole.
        on_heads: ``on_heads(reference_model, artifact_model_or_None)`` once the heads are read.
        on_progress: ``on_progress(done, total)`` after each decoder layer and at the end.
        share: several ranks (:class:`compressor.verify_ranks.Share`): this rank advances its block of
            ``wins`` only; rank 0 adds every window's figures in window order (the one-process figures,
            bit for bit), the others get ``None`` for ``results`` and ``hidden_state_error``.

    Returns:
        ``{"results": what compare returns (``None`` without ``wins``), "hidden_state_error": per-layer list or None,
        "nonfinite_tensors": artifact tensors holding NaN/Inf (named), "seconds"}``.

    Raises:
        InputError: a row :func:`check_streamable` refuses; a reference tensor with NaN/Inf.
    """
    from .moe_ranks import expert_groups

    t0 = time.perf_counter()
    models = {"reference": reference, "artifact": artifact}
    check_streamable(reference.model)
    streams = {} if wins is None else {"reference": _Stream(reference, None),
                                       **{label: _Stream(models[owner], mc) for label, (owner, mc) in candidates.items()}}
    lo, hi = (0, 0 if wins is None else len(wins)) if share is None or wins is None else share.block(len(wins))
    own = None if wins is None else wins[lo:hi]  # this rank's windows (all of them for one process)
    kw_full, kw_chunks = _embed(models, streams, own, kv_chunk)
    n_layers = len(reference.layers)
    nonfinite: list[str] = []
    rows, cols = hidden_rows[0] - lo, hidden_rows[1]  # the first windows overall: this rank's among them
    terms: list[list[tuple[float, float]]] = [[] for _ in range(max(0, min(rows, hi - lo)))]  # per window, layer
    per_weight = sum(torch.empty((), dtype=m.dtype).element_size() for m in models.values() if m is not None)

    def advance(layer, s: _Stream, keep: bool = True):
        role = "reference" if s.owner is reference else "artifact"
        _advance(layer, i, s, kw_full[role], kw_chunks[role], kv_chunk, keep)

    for i in range(n_layers):
        groups = None if expert_group is None else expert_groups(reference.model, reference.arch, i, expert_group,
                                                                 per_weight)
        if groups is not None:
            _advance_grouped(i, models, streams, groups, advance, on_layer, on_experts, nonfinite.append)
        else:
            lr = reference.load_layer(i)
            la = artifact.load_layer(i, nonfinite.append) if artifact is not None else None
            if on_layer is not None:
                on_layer(i, lr, la)
            for s in streams.values():
                advance(lr if s.owner is reference else la, s)
        if hidden_of is not None and streams:
            for t, r, a in zip(terms, streams["reference"].hidden, streams[hidden_of].hidden):
                r, a = r[:, :cols].double(), a[:, :cols].double()
                t.append((float((a - r).pow(2).sum()), float(r.pow(2).sum())))
        reference.release_layer(i)
        if artifact is not None:
            artifact.release_layer(i)
        if on_progress is not None:
            on_progress(i + 1, n_layers + 1)
    results = None
    if wins is not None:
        results = _statistics(models, streams, own, logit_chunk, on_heads, nonfinite.append)
    elif on_heads is not None:
        reference.load_head()
        if artifact is not None:
            artifact.load_head(nonfinite.append)
        on_heads(reference.model, None if artifact is None else artifact.model)
    if on_progress is not None:
        on_progress(n_layers + 1, n_layers + 1)
    results, hidden = _joined(results, terms if hidden_of is not None and streams else None, wins, n_layers, share)
    return {"results": results, "hidden_state_error": hidden, "nonfinite_tensors": nonfinite,
            "seconds": round(time.perf_counter() - t0, 2)}


def _joined(results: dict | None, terms: list | None, wins, n_layers: int, share) -> tuple[dict | None, list | None]:
    """``(results, hidden-state error per layer)`` from :func:`_statistics`'s records and ``terms`` (per
    window, per layer: the error's and the reference's squared sums; ``None``: not measured), every rank's
    on rank 0 under ``share`` (the others get ``(None, None)``), added in window order as one process adds them."""
    if results is not None and share is not None:
        got, records = share.gather(terms or []), share.gather(results["records"])
        if records is None:
            return None, None
        results, terms = {**results, "records": records}, got if terms is not None else None
    if results is not None:
        acc = new_acc(results["records"][0])
        for rec in results["records"]:
            fold(acc, rec)
        results = {**summaries(acc, wins), "seconds": results["seconds"]}
    if terms is None:
        return results, None
    num, den = [0.0] * n_layers, [0.0] * n_layers
    for t in terms:  # window order, each layer's sums as one process adds them
        for i, (a, b) in enumerate(t):
            num[i] += a
            den[i] += b
    return results, [math.sqrt(a / b) if b > 0 else math.inf for a, b in zip(num, den)]

def _statistics(models: dict, streams: dict[str, _Stream], wins: torch.Tensor, logit_chunk: int, on_heads,
                on_nonfinite) -> dict:
    """The final norm and head of each model over its configurations' last hidden states:
    ``{"records": each window's :func:`compressor.evaluate.window_record`, "seconds"}`` (this phase's;
    ``wins``: the windows the streams hold; ``on_nonfinite``: for the artifact's head)."""
    t0 = time.perf_counter()
    for role, lm in models.items():
        if lm is not None:
            lm.load_head(on_nonfinite if role == "artifact" else None)
    if on_heads is not None:
        on_heads(models["reference"].model, None if models["artifact"] is None else models["artifact"].model)
    records = []

    def at(label, w):  # logits of positions a..b-1: the model's own forward after its last decoder layer
        s = streams[label]
        return lambda a, b: s.owner.model(inputs_embeds=s.hidden[w][:, a:b], use_cache=False).logits[0].float()

    with _layers_passed_through([m for m in models.values() if m is not None]):
        for w in range(wins.shape[0]):
            records.append(window_record(wins[w, 1:], at("reference", w), {label: at(label, w) for label in streams
                                                                           if label != "reference"}, logit_chunk))
            for s in streams.values():
                s.hidden[w] = None  # this window's last states are no longer needed
    return {"records": records, "seconds": round(time.perf_counter() - t0, 2)}
