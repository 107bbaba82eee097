"""Input-embedding quantization (recipe ``embedding:``): symmetric RTN per vocabulary row or group.

The embedding is a ``[vocab, hidden]`` table read by lookup; under ``tie_word_embeddings`` it is
the LM head's matrix too. For a small model with a large vocabulary it is much of a low-bit
artifact (SmolLM2-135M: 49,152 x 576, 56.6 MB of a 118 MB W4 artifact in float16), and a quantized
head cannot shrink it: untying adds the head's bytes (:func:`compressor.quant.head.check_untie`). ``embedding: {num_bits: 8}`` stores the table
itself packed, so a tied model stays tied and its head reads the same quantized table.

Layout: compressed-tensors ``pack-quantized`` as for a Linear (``<embed>.weight_packed`` int32
``[vocab, ceil(hidden * b / 32)]``, ``weight_scale`` ``[vocab, G]`` in the storage dtype,
``weight_shape``; symmetric, so no zero point) and a config group of its own targeting the
embedding's checkpoint name (``model.embed_tokens``), the layout compressed-tensors 0.20's
``compress_module``/``decompress_module`` use for ``Embedding`` modules and vLLM's
``CompressedTensorsEmbeddingWNA16Int`` (PR #44340) reads for a lookup table.

Readers: kvq's (``kvq verify``'s :func:`compressor.artifact.load_artifact`, the runtime behind
``serve-smoke``/``serve``) dequantize the table at load. transformers 5.25 with compressed-tensors
0.20.1 does not load a packed ``Embedding`` (its weight initialisation reads the missing
``weight``; tested tied and untied), and vLLM's method serves lookups only: a tied table as the
LM head needs vLLM PR #45535 (open). :func:`check_embedding`'s warning says so on every run.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .head import compressed_tensors_only, megabytes, packed_bytes, quantize_rows
from .primitives import Scheme

#: who reads a packed embedding, as the quantize warning and docs/recipes.md say it
READERS = ("kvq verify, serve-smoke and serve read it; transformers 5.25 with compressed-tensors 0.20.1 fails to "
           "load a quantized Embedding, and vLLM's compressed-tensors embedding method (PR #44340) serves lookups "
           "only, not a tied LM head (PR #45535, open)")


def _embedding(model, arch) -> torch.nn.Embedding:
    from ..arch import find_module

    emb = find_module(model, arch.embed_tokens)
    if not isinstance(emb, torch.nn.Embedding):
        raise InputError(f"recipe embedding: the model has no Embedding {arch.embed_tokens}")
    return emb


def check_embedding(recipe, fmt: str, model=None, arch=None, scale_bytes: int = 2) -> str | None:
    """Refuse an embedding scheme the artifact cannot hold, before any work (``model``: once
    loaded); with ``model``, return the warning every such run prints: the bytes before and
    after, and which consumers read the artifact (:data:`READERS`).

    Args:
        recipe: the effective recipe (``recipe.embedding``: :class:`compressor.recipe.EmbeddingScheme`).
        fmt: the ``--format``.
        model, arch: the loaded model and its architecture row, or ``None`` (recipe checks only).
        scale_bytes: bytes of one stored scale (2 for bfloat16/float16, 4 for float32).

    Raises:
        InputError: a format other than compressed-tensors; with ``model``: no Embedding at
            ``arch.embed_tokens``, a group size that does not divide the hidden size, or a
            multimodal wrapper (kvq quantizes embeddings only in text models).
    """
    e = recipe.embedding
    if e is None:
        return None
    compressed_tensors_only("embedding", fmt, "the embedding")
    if model is None:
        return None
    if arch.wrapper is not None:
        raise InputError("recipe embedding: kvq quantizes the embedding only in text models, not inside a "
                         "multimodal wrapper")
    vocab, hidden = _embedding(model, arch).weight.shape
    if e.group_size != -1 and hidden % e.group_size:
        raise InputError(f"recipe embedding.group_size {e.group_size} does not divide the hidden size {hidden}")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    after = packed_bytes(vocab, hidden, e.num_bits, e.group_size, True, scale_bytes)
    grouping = "per row" if e.group_size == -1 else f"in groups of {e.group_size}"
    return (f"recipe embedding: the {vocab:,} x {hidden:,} embedding{' (also the tied LM head)' if tied else ''} is "
            f"stored {e.num_bits}-bit {grouping}: {megabytes(after)} instead of {megabytes(vocab * hidden * scale_bytes)}; "
            f"{READERS}")


def embedding_scheme(recipe, arch) -> dict[str, Scheme]:
    """``{in-memory embedding name: Scheme(num_bits, group_size, True)}``, empty without ``embedding:``."""
    e = recipe.embedding
    return {} if e is None else {arch.embed_tokens: Scheme(e.num_bits, e.group_size, True)}


def add_embedding(recipe, arch, model, packed: dict, pack, rename, dtype: torch.dtype) -> dict | None:
    """Quantize the embedding table (recipe ``embedding:``; symmetric min-max RTN, rows in
    blocks) into ``packed`` (checkpoint name -> stored tensors; ``pack``: record dict -> packed
    dict, the format's packer; ``dtype``: the scales' storage dtype). The model is not changed:
    a tied head quantized afterwards (``head.untie``) starts from the float table.

    Returns:
        The manifest's ``quality.embedding`` record (scheme, relative weight error, whether
        the table is also the tied head, stored and float bytes), ``None`` without ``embedding:``.

    Raises:
        QuantizationError: a non-finite scale or row; InputError: a scale ``dtype`` cannot hold.
    """
    e = recipe.embedding
    if e is None:
        return None
    w = _embedding(model, arch).weight
    record, rel = quantize_rows(w, e.num_bits, e.group_size, True, dtype, arch.embed_tokens)
    tensors = pack({arch.embed_tokens: record})
    packed.update({rename(n): t for n, t in tensors.items()})
    stored = sum(t.numel() * t.element_size() for ts in tensors.values() for t in ts.values())
    return {"num_bits": e.num_bits, "group_size": e.group_size, "symmetric": True, "method": "rtn",
            "relative_error": round(rel, 6), "tied": bool(getattr(model.config, "tie_word_embeddings", False)),
            "bytes": stored, "float_bytes": w.numel() * dtype.itemsize}
