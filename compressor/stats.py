"""Statistics ``kvq verify`` reports: distribution drift, weight error, hidden-state error.

Definitions (all figures are computed in float64 unless noted):

* **KL divergence** per predicted token, in nats: ``KL(P_ref || P_art) = sum_v p_ref(v)
  (log p_ref(v) - log p_art(v))`` over the vocabulary, from the two models' next-token
  logits at the same position (the direction and the mean / median / p99 / max summary
  of llama.cpp's ``perplexity --kl-divergence``).
* **top-1 agreement**: fraction of positions where both models' argmax token is equal.
* **relative Frobenius error** ``||W - W_hat||_F / ||W||_F`` and **SQNR**
  ``10 log10(||W||^2 / ||W - W_hat||^2)`` dB of a dequantized weight ``W_hat`` against
  the original ``W`` (SQNR = -20 log10(relative error)).
* **weight statistics**: mean, standard deviation (population), absmax and excess
  kurtosis ``E[(x - mu)^4] / sigma^4 - 3`` (0 for a Gaussian; large for outlier-heavy
  weights, which quantize badly).
* **hidden-state relative error** after decoder layer ``i``: ``||h_art - h_ref||_F /
  ||h_ref||_F`` over the tokens of a batch, both models run end to end on the same
  input (so the error accumulates through the layers as it does when serving).
* **greedy drift**: generating greedily from the same prompt, the first generated
  position where the two models pick different tokens (``None`` if they agree for all
  ``max_new_tokens``).
"""

from __future__ import annotations

import math

import torch


def kl_and_top1(ref_logits: torch.Tensor, art_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P_ref || P_art) in nats and top-1 agreement.

    Args:
        ref_logits, art_logits: ``[T, V]`` logits (any float dtype) at the same ``T`` positions.

    Returns:
        ``(kl [T] float64, same_top1 [T] bool)``; KL is clamped at 0 (rounding can give -1e-9).

    Raises:
        ValueError: shapes differ.
    """
    if ref_logits.shape != art_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(art_logits.shape)}")
    lp = torch.log_softmax(ref_logits.float(), dim=-1)
    lq = torch.log_softmax(art_logits.float(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).double().clamp_min(0.0)
    same = ref_logits.argmax(-1) == art_logits.argmax(-1)
    return kl, same


def summarize(values) -> dict:
    """``{"mean", "median", "p99", "max", "min", "count"}`` of a 1-D sequence (float64).

    ``p99`` is the linear-interpolated 99th percentile (numpy's default method), ``median``
    the 50th. An empty input gives ``count: 0`` and ``None`` for the rest.
    """
    import numpy as np

    a = np.asarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        return {"count": 0, "mean": None, "median": None, "p99": None, "max": None, "min": None}
    return {"count": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "min": float(a.min())}


#: elements per float64 block of :func:`weight_error` and :func:`weight_stats` (8 MiB): a tensor is
#: read a block of rows at a time, so a large one (a ``[vocab, hidden]`` LM head, 226 MB per float64
#: copy at SmolLM2's 49152 x 576) never exists whole in float64, let alone in several copies
STATS_BLOCK = 1 << 20


def _row_blocks(*tensors: torch.Tensor):
    """Equal slices of leading rows of same-shaped ``tensors`` as flat float64 copies (the caller
    may change them in place), about :data:`STATS_BLOCK` elements each (a 0-d tensor is one block)."""
    t0 = tensors[0]
    if t0.dim() == 0:
        yield tuple(t.to(torch.float64, copy=True).reshape(1) for t in tensors)
        return
    rows = max(1, STATS_BLOCK // max(1, t0[0].numel()))
    for r in range(0, t0.shape[0], rows):
        yield tuple(t[r:r + rows].to(torch.float64, copy=True).reshape(-1) for t in tensors)


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> dict:
    """``{"rel_fro", "sqnr_db"}`` of ``w_hat`` against ``w`` (same shape, any float dtype; sums in
    float64, a block of rows at a time: :data:`STATS_BLOCK`).

    An exact copy has ``rel_fro`` 0 and ``sqnr_db`` ``inf``; an all-zero ``w`` gives
    ``rel_fro`` ``inf`` unless ``w_hat`` is zero too.

    Raises:
        ValueError: shapes differ.
    """
    if w.shape != w_hat.shape:
        raise ValueError(f"weight shapes differ: {tuple(w.shape)} vs {tuple(w_hat.shape)}")
    num = den = 0.0
    for a, b in _row_blocks(w, w_hat):
        d = b.sub_(a)
        num += float(torch.dot(d, d))
        den += float(torch.dot(a, a))
    if num == 0.0:
        return {"rel_fro": 0.0, "sqnr_db": math.inf}
    if den == 0.0:
        return {"rel_fro": math.inf, "sqnr_db": -math.inf}
    return {"rel_fro": math.sqrt(num / den), "sqnr_db": 10.0 * math.log10(den / num)}


def weight_stats(w: torch.Tensor) -> dict:
    """``{"mean", "std", "absmax", "kurtosis"}`` of all elements of ``w`` (float64, two passes
    over blocks of rows: :data:`STATS_BLOCK`; population std; excess kurtosis, ``None`` for a
    constant tensor)."""
    n = max(1, w.numel())
    mu = sum(float(x.sum()) for (x,) in _row_blocks(w)) / n
    m2 = m4 = 0.0
    absmax = -math.inf
    for (x,) in _row_blocks(w):  # no tensor outlives its block (a small one kept would pin the freed blocks)
        peak = max(abs(float(x.max())), abs(float(x.min())))  # NaN when the block holds one
        absmax = absmax if math.isnan(absmax) or peak <= absmax else peak
        d = x.sub_(mu)
        m2 += float(torch.dot(d, d))
        d.mul_(d)
        m4 += float(torch.dot(d, d))
    var = m2 / n
    kurt = None if var == 0.0 else float((m4 / n) / var**2 - 3.0)
    return {"mean": mu, "std": math.sqrt(var), "absmax": absmax, "kurtosis": kurt}


def relative_error(ref: torch.Tensor, other: torch.Tensor) -> float:
    """``||other - ref||_F / ||ref||_F`` (float64); ``inf`` if ``ref`` is zero and ``other`` is not."""
    num = float((other.double() - ref.double()).pow(2).sum())
    den = float(ref.double().pow(2).sum())
    if num == 0.0:
        return 0.0
    return math.inf if den == 0.0 else math.sqrt(num / den)


def first_divergence(ref_tokens, art_tokens) -> int | None:
    """Index of the first position where two generated token lists differ; ``None`` if
    they agree on their common length and have the same length."""
    for i, (a, b) in enumerate(zip(ref_tokens, art_tokens)):
        if int(a) != int(b):
            return i
    return None if len(ref_tokens) == len(art_tokens) else min(len(ref_tokens), len(art_tokens))
