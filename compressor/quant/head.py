"""LM-head quantization (recipe ``head:``): GPTQ or round-to-nearest, per output channel or grouped.

The head is a ``[vocab, hidden]`` Linear after the final norm; for large vocabularies it is
a large share of a low-bit artifact (Kimi K2's ``163840 x 7168`` head is 1.17 B parameters,
2.3 GB in bfloat16; it stays that size when only the decoder layers are quantized). It is
quantized after the decoder layers, in blocks of rows (every scheme here is per row, and GPTQ's
error feedback runs along a row's columns, so a block's result is the whole matrix's), which
bounds the transient float copy whatever the vocabulary: with GPTQ when the run had a
calibration pass (AWQ, GPTQ, AWQ+GPTQ: the Hessian of the final norm's outputs on the
quantized model, :func:`head_hessian`; with the recipe's ``gptq.damp`` and range search),
else with min-max RTN.

Layout: compressed-tensors ``pack-quantized``, the head out of the ignore list and in a config
group of its own (``targets: [lm_head]``) when its scheme differs from the body's (else in the
body's ``Linear`` class group), as llm-compressor writes a quantized head; vLLM's compressed-tensors path loads it (a ``ParallelLMHead`` with a weight scheme) and
transformers decompresses it. A tied head (``tie_word_embeddings``) is quantized only by
untying it, with the recipe's ``head.untie: true`` (:func:`check_untie` refuses it otherwise,
naming the bytes it adds): the artifact keeps the embedding, adds the packed head and sets
``tie_word_embeddings: false``, so a loader never ties a quantized head to a float table. The
shared table itself is made smaller by the recipe's ``embedding:`` (:mod:`.embedding`).
"""

from __future__ import annotations

import torch

from ..errors import InputError, QuantizationError
from .layer import QuantizedLinear, stored_dequantize
from .primitives import Scheme
from ..registry import FORMATS
from .rtn import rtn_quantize

#: rows quantized at once: a ``[ROWS, hidden]`` float32 block (128 MiB at hidden 7168)
ROWS = 4096


def packed_bytes(rows: int, cols: int, num_bits: int, group_size: int, symmetric: bool, scale_bytes: int) -> int:
    """Bytes of a ``[rows, cols]`` matrix stored ``pack-quantized`` (compressed-tensors): the
    dense ``num_bits`` codes of each row in int32 words, one scale per row and group in the
    storage dtype (``scale_bytes`` each), asymmetric zero points packed along the rows, and the
    int64 ``weight_shape``."""
    groups = 1 if group_size == -1 else cols // group_size
    words = -(-cols * num_bits // 32)
    zero_points = 0 if symmetric else -(-rows * num_bits // 32) * groups * 4
    return rows * words * 4 + rows * groups * scale_bytes + zero_points + 16


def megabytes(n: int) -> str:
    """``n`` bytes as the warnings say them: ``28.41 MB`` (10^6 bytes)."""
    return f"{n / 1e6:,.2f} MB"


def check_untie(recipe, tied: bool, vocab: int, hidden: int, scale_bytes: int) -> str | None:
    """A recipe ``head:`` on a tied model (``tie_word_embeddings``) unties the head: the
    artifact keeps the embedding and adds the packed head beside it. Refused unless the
    recipe says ``head.untie: true``; then the warning that states the bytes it adds.

    Args:
        tied: the model's ``tie_word_embeddings``.
        vocab, hidden: the head's ``[vocab, hidden]`` shape.
        scale_bytes: bytes of one scale in the storage dtype (2 for bfloat16/float16).

    Returns:
        The warning (``head.untie: true`` on a tied model), else ``None``.

    Raises:
        InputError: a tied model whose head the recipe quantizes without ``head.untie: true``;
            the line names the bytes the untied head would add and both ways out.
    """
    head = recipe.head
    if head is None or not tied:
        return None
    cost = packed_bytes(vocab, hidden, head.num_bits, head.group_size, head.symmetric, scale_bytes)
    what = (f"a second, {head.num_bits}-bit copy of the {vocab:,} x {hidden:,} table beside the embedding "
            f"(+{megabytes(cost)})")
    if not head.untie:
        raise InputError(f"recipe head: the model ties lm_head to its embedding (tie_word_embeddings); quantizing the "
                         f"head unties it and stores {what}; accept that with --set head.untie=true (recipe "
                         "head.untie: true), keep the head float with --set head=null, or make the shared table "
                         "smaller with --set embedding.num_bits=8 (docs/recipes.md, 'LM head and embedding')")
    return f"recipe head.untie: the tied head is stored on its own: {what}"


def compressed_tensors_only(section: str, fmt: str, module: str) -> None:
    """Raises InputError naming the recipe ``section`` (``head``, ``embedding``) when ``fmt`` is
    cannot carry it (:attr:`compressor.formats.base.WeightFormat.carries_head`: AutoAWQ's and GPTQ's loaders
    keep ``module`` in float)."""
    if not FORMATS.get(fmt).carries_head:
        able = " or ".join(f"--format {f.name}" for f in FORMATS.entries() if f.carries_head)
        raise InputError(f"recipe {section}: {fmt} artifacts keep {module} in float; quantize it with {able}")


def check_head(recipe, fmt: str, model=None, arch=None, scale_bytes: int = 2) -> str | None:
    """Refuse a head scheme the artifact cannot hold, before any work (``model``: once loaded).

    Returns:
        With ``model``: :func:`check_untie`'s warning for a tied head the recipe unties
        (``scale_bytes``: one stored scale's bytes), else ``None``.

    Raises:
        InputError: a format other than compressed-tensors (AutoAWQ's and GPTQ's loaders
            keep ``lm_head`` in float), ``lm_head`` also in the recipe's ``ignore``, a group size that does not divide the hidden size, a
            model without a Linear ``lm_head``, a tied head without ``head.untie: true``
            (:func:`check_untie`), or a tied head inside a multimodal wrapper.
    """
    head = recipe.head
    if head is None:
        return None
    compressed_tensors_only("head", fmt, "lm_head")
    from ..recipe import matches

    if matches(recipe.ignore, "lm_head"):
        raise InputError("the recipe both quantizes the head (head:) and ignores lm_head (ignore:); "
                         "drop one (--set head=null keeps the head in float)")
    if model is None:
        return None
    lin = _head(model, arch)
    if head.group_size != -1 and lin.in_features % head.group_size:
        raise InputError(f"recipe head.group_size {head.group_size} does not divide the hidden size {lin.in_features}")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if arch is not None and arch.wrapper is not None and tied:
        raise InputError("recipe head: the model ties lm_head to its embedding inside a multimodal wrapper; "
                         "kvq unties heads only in text models")
    return check_untie(recipe, tied, lin.out_features, lin.in_features, scale_bytes)


def _head(model, arch) -> torch.nn.Linear:
    from ..arch import find_module

    name = arch.lm_head if arch is not None else "lm_head"
    lin = find_module(model, name)
    if not isinstance(lin, torch.nn.Linear):
        raise InputError(f"recipe head: the model has no Linear {name}")
    return lin


@torch.no_grad()
def head_hessian(model, arch, hidden) -> torch.Tensor:
    """GPTQ's ``H = 2 X Xᵀ / n`` of the head's inputs: the final norm applied to the last
    decoder layer's outputs on the calibration batches (after every layer was quantized, so
    the head is fitted to the activations it will see).

    Args:
        model: the model (its final norm loaded; streamed sources keep it).
        arch: its architecture row (``arch.final_norm``).
        hidden: the last layer's outputs, ``[batch, T, hidden]`` tensors (any device).

    Returns:
        ``[hidden, hidden]`` float32 on the CPU.
    """
    from ..arch import get_module
    from .gptq import HessianAccumulator

    norm = get_module(model, arch.final_norm)
    acc = None
    for h in hidden:
        norm.to(h.device)
        x = norm(h)
        acc = acc or HessianAccumulator(x.shape[-1], x.device)
        acc.add(x)
    norm.to("cpu")
    if acc is None:
        raise QuantizationError("the head's GPTQ Hessian has no calibration tokens")
    return acc.hessian(consume=True).cpu()


@torch.no_grad()
def quantize_head(model, arch, scheme, dtype: torch.dtype, hessian: torch.Tensor | None = None,
                  damp: float = 0.01, clip_grid: int | None = None,
                  clip_max_shrink: float = 0.25) -> tuple[QuantizedLinear, float]:
    """Quantize ``model``'s LM head without touching the model (a tied head shares the
    embedding's storage, which stays float): GPTQ (Frantar et al., 2022; no act-order, the
    rows in blocks, each with the same ``H``) with ``hessian``, else RTN.

    Args:
        model: the float model (its head on CPU; ``meta`` is refused).
        arch: its architecture row (``arch.lm_head``: the module path).
        scheme: :class:`compressor.recipe.HeadScheme` (``num_bits``, ``group_size``, ``symmetric``).
        dtype: storage dtype of the scales.
        hessian: ``[hidden, hidden]`` float32 from :func:`head_hessian`, or ``None`` (RTN).
        damp: GPTQ's relative dampening (the recipe's ``gptq.damp``).
        clip_grid, clip_max_shrink: GPTQ's range search (the recipe's ``gptq.clip*``; ``None``:
            min-max), as :func:`compressor.quant.gptq.gptq_quantize`; RTN ignores them.

    Returns:
        ``(record, relative Frobenius error of the dequantized head)``: ``record.q`` int8
        ``[vocab, hidden]``, ``record.scale`` ``[vocab, G]`` in ``dtype``.

    Raises:
        QuantizationError: a non-finite scale or dequantized row (the head is named).
        InputError: a scale the storage dtype cannot hold (float16 above 65,504).
    """
    w = _head(model, arch).weight
    if w.is_meta:
        raise QuantizationError("lm_head was not loaded before the head was quantized")
    return quantize_rows(w, scheme.num_bits, scheme.group_size, scheme.symmetric, dtype, "lm_head", hessian, damp,
                         clip_grid, clip_max_shrink)


@torch.no_grad()
def quantize_rows(w: torch.Tensor, num_bits: int, gs: int, symmetric: bool, dtype: torch.dtype, name: str,
                  hessian: torch.Tensor | None = None, damp: float = 0.01, clip_grid: int | None = None,
                  clip_max_shrink: float = 0.25) -> tuple[QuantizedLinear, float]:
    """Quantize a ``[rows, cols]`` matrix whose every scheme is per row (``gs``: ``-1`` per row
    or a divisor of ``cols``), :data:`ROWS` rows at a time: GPTQ with ``hessian`` (``[cols,
    cols]`` float32), else min-max RTN. ``w`` is read, never changed.

    Returns:
        ``(record, relative Frobenius error of the dequantized matrix)``: ``record.q`` int8
        ``[rows, cols]``, ``record.scale`` ``[rows, G]`` in ``dtype``.

    Raises:
        QuantizationError: a non-finite scale or dequantized row (``name`` is named).
        InputError: a scale the storage dtype cannot hold (float16 above 65,504).
    """
    qs, scales, zps = [], [], []
    err2 = ref2 = 0.0
    factors: dict = {}  # the Hessian factorized once for every block of rows (gptq.HessianFactor)
    for r0 in range(0, w.shape[0], ROWS):
        block = w[r0:r0 + ROWS].float()
        if hessian is None:
            q, scale, zp = rtn_quantize(block, num_bits, gs, symmetric)
        else:
            from .gptq import gptq_quantize

            r = gptq_quantize(block, hessian, num_bits, gs, symmetric, damp=damp, scale_dtype=dtype,
                              name=name, clip_grid=clip_grid, clip_max_shrink=clip_max_shrink, factors=factors)
            q, scale, zp = r.q, r.scale, r.zero_point
        scale, deq = stored_dequantize(q, scale, None if symmetric else zp, gs, dtype, name)
        err2 += float((deq - block).pow(2).sum())
        ref2 += float(block.pow(2).sum())
        qs.append(q)
        scales.append(scale)
        zps.append(zp)
    record = QuantizedLinear(q=torch.cat(qs), scale=torch.cat(scales).contiguous(),
                             zero_point=None if symmetric else torch.cat(zps), g_idx=None,
                             scheme=Scheme(num_bits, gs, symmetric))
    return record, (err2 / max(ref2, 1e-30)) ** 0.5


def head_schemes(recipe, arch) -> dict[str, Scheme]:
    """``{in-memory head name: Scheme(num_bits, group_size, symmetric)}``, empty without ``head:``."""
    h = recipe.head
    return {} if h is None else {arch.lm_head: Scheme(h.num_bits, h.group_size, h.symmetric)}


def add_head(recipe, arch, model, packed: dict, pack, rename, dtype: torch.dtype,
             hessian: torch.Tensor | None = None) -> dict | None:
    """Quantize the head (recipe ``head:``) into ``packed`` (checkpoint name -> stored tensors,
    ``pack``: record dict -> packed dict, the format's packer) and untie a tied model's config;
    ``hessian``: the head inputs' (the pipeline's, when it ran a calibration pass) for GPTQ.
    Returns the manifest's ``quality.head`` record, ``None`` without ``head:``."""
    h = recipe.head
    if h is None:
        return None
    g = recipe.gptq
    record, rel = quantize_head(model, arch, h, dtype, hessian, g.damp, g.clip_grid if g.clip else None, g.clip_max_shrink)
    packed.update({rename(n): t for n, t in pack({arch.lm_head: record}).items()})
    return {"num_bits": h.num_bits, "group_size": h.group_size, "symmetric": h.symmetric,
            "method": "rtn" if hessian is None else "gptq", "relative_error": round(rel, 6), "untied": untie(model)}


def untie(model) -> bool:
    """Mark a tied model's config as untied (the artifact then stores the head on its own);
    returns whether it was tied. The in-memory tensors stay shared."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        model.config.tie_word_embeddings = False
    return tied
