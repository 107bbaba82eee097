"""The model ``config.json`` describes against the tensors the checkpoint stores.

:mod:`compressor.source.config_check` reads sizes; this module builds the model the config
describes (on the meta device: no memory) and compares its tensor names and shapes with the
safetensors headers, before any weight is read. A config that describes another layout
would otherwise be built anyway: a tensor the checkpoint does not store would keep its
random initialisation, one it stores but the model does not use (an expert, a dense MLP, a
separate head) would be dropped, and a shape that disagrees would fail later in verify or
serve with an internal error. Each is refused in one line naming the tensor, both shapes
where they differ, and the config fields that decide it
(:class:`compressor.errors.InputError`, exit 2).

Tolerated, because kvq handles them elsewhere: multi-token-prediction layers stored after
the decoder layers (``num_nextn_predict_layers``, carried by the artifact), block-FP8
``*_scale_inv`` companions, a wrapper's carried tensors (vision tower, projector), a stored
``lm_head.weight`` under ``tie_word_embeddings`` that holds the embedding's bytes, and
tensors whose stored rank differs from the model's (fused/unfused expert layouts, mapped by
:func:`compressor.arch.state_from_checkpoint`).
"""

from __future__ import annotations

import re

from ..errors import InputError

#: config fields that decide which tensors a decoder layer holds, named in the refusal
LAYOUT_FIELDS = ("num_hidden_layers", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step",
                 "moe_layer_freq", "n_routed_experts", "num_experts", "num_local_experts", "n_shared_experts",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
                 "moe_intermediate_size", "intermediate_size", "tie_word_embeddings")


#: tensor names of already-quantized linears (compressed-tensors pack-quantized, AutoAWQ / GPTQ)
PACKED_SUFFIXES = (".weight_packed", ".qweight")


#: the fields that decide which tensors a layer holds (not their shapes)
LAYER_FIELDS = LAYOUT_FIELDS[:10]  # (q_lora_rank included: it decides q_proj vs q_a/q_b_proj)


def _fields(cfg, fields=LAYOUT_FIELDS) -> str:
    present = [f for f in fields if f in cfg.to_dict()]  # a field set to null counts (q_lora_rank: null)
    return ", ".join(present)


def check_layout(model, arch, ckpt, names: list[str], spec: str) -> list[str]:
    """Compare ``model`` (built from the config, on meta; experts unfused) with ``ckpt``.

    Args:
        model: the model the config describes. arch: its architecture row.
        ckpt: a :class:`compressor.source.lazy.LazyCheckpoint` (``where``: name -> (shard, entry)).
        names: the in-memory tensor names the model reads from the checkpoint.
        spec: how to name the source in messages.

    Returns:
        the in-memory names the checkpoint does not store under their own name (the caller
        may still find them through another layout; empty when every name maps).

    Raises:
        InputError: a stored tensor whose shape differs from the model's; tensors missing
            from the checkpoint while it stores decoder-layer tensors the model does not
            use; a stored separate ``lm_head.weight`` under ``tie_word_embeddings`` that is
            not the embedding.
    """
    from ..arch import checkpoint_name

    cfg = model.config
    state = model.state_dict()
    missing, used = [], set()
    for n in names:
        c = checkpoint_name(arch, n)
        if c not in ckpt:  # (a packed source's reader maps X.weight onto its packed tensors)
            missing.append(n)
            continue
        used.update((c, c + "_scale_inv"))
        if c not in ckpt.where:
            continue
        stored = list(ckpt.where[c][1].shape)
        want = list(state[n].shape)
        if len(stored) == len(want) and stored != want:
            raise InputError(f"{spec}: config.json describes {c} as {want} but the checkpoint stores {stored} "
                             f"(check {_fields(cfg)})")
    _check_tied_head(model, arch, ckpt, spec)
    if not missing or any(k.endswith(PACKED_SUFFIXES) for k in ckpt.where):
        return missing  # (an already-quantized source stores packed tensors: read by compressor.commands.kv_only)
    unused = _unused_layer_tensors(arch, ckpt, used, cfg)
    if unused:
        raise InputError(f"{spec}: config.json does not describe the checkpoint's layers: the model it builds needs "
                         f"{checkpoint_name(arch, missing[0])} ({len(missing)} tensor(s) not stored), while the "
                         f"checkpoint stores {unused[0]} ({len(unused)} tensor(s) the model would drop); check "
                         f"{_fields(cfg, LAYER_FIELDS)}")
    return missing


def _unused_layer_tensors(arch, ckpt, used: set[str], cfg) -> list[str]:
    """Stored tensors of decoder layers ``< num_hidden_layers`` that no model tensor reads."""
    from ..arch import checkpoint_name

    prefix = checkpoint_name(arch, f"{arch.layers}.0.")[:-2]  # e.g. "model.layers." or "language_model.model.layers."
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    n_layers = cfg.num_hidden_layers
    out = []
    for name in ckpt.where:
        m = pat.match(name)
        if m and int(m.group(1)) < n_layers and name not in used:
            out.append(name)
    return sorted(out)


def _check_tied_head(model, arch, ckpt, spec: str) -> None:
    """Under ``tie_word_embeddings`` a stored ``lm_head.weight`` must be the embedding (same
    shape, dtype and bytes): otherwise the config would drop the checkpoint's own head."""
    from ..arch import checkpoint_name

    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = checkpoint_name(arch, f"{arch.lm_head}.weight")
    emb_name = next((checkpoint_name(arch, n) for n in model.state_dict() if n.endswith("embed_tokens.weight")), None)
    if head not in ckpt.where or emb_name is None or emb_name not in ckpt.where:
        return
    (hs, he), (es, ee) = ckpt.where[head], ckpt.where[emb_name]
    if (he.dtype, list(he.shape)) == (ee.dtype, list(ee.shape)) and _same_bytes(hs, he, es, ee):
        return
    raise InputError(f"{spec}: config.json sets tie_word_embeddings but the checkpoint stores its own {head}, "
                     f"which is not the embedding; set tie_word_embeddings to false to keep it")


def _same_bytes(shard_a, a, shard_b, b, chunk: int = 1 << 24) -> bool:
    if a.end - a.start != b.end - b.start:
        return False
    with open(shard_a, "rb") as fa, open(shard_b, "rb") as fb:
        off = 0
        while off < a.end - a.start:
            n = min(chunk, a.end - a.start - off)
            fa.seek(a.start + off)
            fb.seek(b.start + off)
            if fa.read(n) != fb.read(n):
                return False
            off += n
    return True
