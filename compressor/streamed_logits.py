"""A reference model's logits over token sequences of any lengths, one decoder layer at a time.

``kvq serve-smoke`` teacher-forces the reference on each prompt plus the runtime's continuation;
at Kimi K2 / GLM size the reference (float32, 4 bytes a parameter) does not fit whole. As
:func:`compressor.streamed_eval.streamed_compare` does for verify's windows, the model is built
with its decoder layers on ``meta`` (:func:`compressor.streamed_eval.open_model`); each sequence is
embedded by the model's own forward (its layer-0 input and every layer's keyword arguments:
causal mask and RoPE of that sequence's length, :func:`compressor.layer_inputs.capture_layer_inputs`),
then every sequence advances through decoder layer ``i``, read and released before layer ``i + 1``
(an MoE layer above the budget in groups of routed experts,
:func:`compressor.streamed_eval._advance_grouped`). At the end the model's own forward, its decoder
layers passed through, turns each sequence's last hidden states into logits of the positions the
caller asks for (final norm, head, what the model's class does to logits), chunk by chunk: the
same logits as the whole model's forward within float tolerance.

Memory: one decoder layer (or its non-expert part and one group of experts), every sequence's
hidden states (two copies while a layer runs), the head at the end, one chunk of logits
(:func:`compressor.streamed_eval.memory_plan` with the sequences as windows of the longest length).
"""

from __future__ import annotations

from typing import Callable

import torch

from .streamed_eval import LazyModel, _advance, _advance_grouped, _layers_passed_through, _Stream, check_streamable

#: ``at(a, b)``: float32 logits ``[b - a, vocab]`` of positions ``a .. b-1`` of one sequence
Logits = Callable[[int, int], torch.Tensor]


def _embedding_read(lm: LazyModel) -> None:
    """The input embedding read again when an earlier pass released it to ``meta``."""
    from .source.lazy import load_into

    name = f"{lm.arch.embed_tokens}.weight"
    if lm.model.get_parameter(name).is_meta:
        load_into(lm.model, lm.ckpt, lm.arch, [name], lm.dtype, lm._refuse_nonfinite)


def _head_released(lm: LazyModel) -> None:
    """An untied head back to ``meta`` (a tied head is the embedding, kept)."""
    from .source.lazy import to_meta

    if not lm.tied:
        to_meta(lm.model.get_submodule(lm.arch.lm_head))


@torch.no_grad()
def streamed_logits(lm: LazyModel, seqs: list[list[int]], consume: Callable[[int, Logits], None],
                    expert_group: int | None = None, on_progress: Callable[[int, int], None] | None = None) -> None:
    """Run ``seqs`` through ``lm`` a decoder layer at a time; ``consume(k, at)`` then reads sequence
    ``k``'s logits through ``at`` (module docstring), chunk by chunk, before the next sequence's.

    Args:
        lm: the model (:func:`compressor.streamed_eval.open_model`); its embedding is read again
            when released, and released (unless tied) with the head once done, so passes repeat.
        seqs: token ids, one list per sequence (lengths may differ; at least one token each).
        expert_group: bytes one group of routed experts may hold
            (:attr:`compressor.streamed_eval.MemoryPlan.expert_group_limit`); ``None``: layers read whole.
        on_progress: ``on_progress(done, total)`` after each decoder layer and at the end.

    Raises:
        InputError: a row :func:`compressor.streamed_eval.check_streamable` refuses; a tensor
            with NaN/Inf or missing.
    """
    from .layer_inputs import capture_layer_inputs
    from .moe_ranks import expert_groups

    check_streamable(lm.model)
    _embedding_read(lm)
    streams: dict[str, _Stream] = {}
    kwargs: dict[int, list[dict]] = {}
    for k, seq in enumerate(seqs):
        h0, kw = capture_layer_inputs(lm.model, lm.arch, torch.tensor([seq]), 1, "cpu")
        streams[f"sequence {k}"] = s = _Stream(lm, None, [h0[0].to(lm.dtype)])
        kwargs[id(s)] = kw
    lm.release_embedding()
    n_layers = len(lm.layers)
    per_weight = torch.empty((), dtype=lm.dtype).element_size()
    for i in range(n_layers):
        def advance(layer, s: _Stream, keep: bool = True, i=i):
            _advance(layer, i, s, kwargs[id(s)], None, 1, keep)

        groups = None if expert_group is None else expert_groups(lm.model, lm.arch, i, expert_group, per_weight)
        if groups is not None:
            _advance_grouped(i, {"reference": lm, "artifact": None}, streams, groups, advance, None, None, None)
        else:
            layer = lm.load_layer(i)
            for s in streams.values():
                advance(layer, s)
        lm.release_layer(i)
        if on_progress is not None:
            on_progress(i + 1, n_layers + 1)
    lm.load_head()
    with _layers_passed_through([lm]):
        for k, s in enumerate(streams.values()):
            h = s.hidden[0]
            consume(k, lambda a, b, h=h: lm.model(inputs_embeds=h[:, a:b], use_cache=False).logits[0].float())
            s.hidden[0] = None
    _head_released(lm)
    if on_progress is not None:
        on_progress(n_layers + 1, n_layers + 1)
