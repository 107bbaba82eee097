"""Position buckets: where in a sequence a KV cache's error shows (issue #47).

A quantized KV cache is read at every later position, so its error can grow with the
number of tokens cached. The figures of ``kvq verify`` -- perplexity, KL(reference ||
artifact), top-1 agreement -- are also given per bucket of positions:

==========  ======================  =========================================
bucket      query positions         tokens in context when predicting
==========  ======================  =========================================
``0-512``   0 .. 511                1 .. 512
``512-2k``  512 .. 2047             513 .. 2048
``2k-8k``   2048 .. 8191            2049 .. 8192
``8k+``     8192 ..                 8193 ..
==========  ======================  =========================================

A position is the 0-based index of the token whose next-token distribution is
predicted (the query), so position ``p`` sees ``p + 1`` tokens, the BOS included.
Buckets that start at or beyond the last position measured are left out (a 2048-token
window has two). The figures are computed from the same per-position values as the
window figures (:func:`compressor.evaluate.compare` keeps per-position sums over the
windows and every token's KL), so the buckets' token-weighted means are the totals.
"""

from __future__ import annotations

import math

import numpy as np

#: bucket starts (query positions); each bucket ends where the next starts, the last one never
EDGES: tuple[int, ...] = (0, 512, 2048, 8192)


def _label(a: int, b: int | None) -> str:
    def k(x: int) -> str:
        return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)

    return f"{k(a)}+" if b is None else f"{k(a)}-{k(b)}"


def buckets(n_positions: int, first: int = 0) -> list[tuple[str, int, int]]:
    """``[(label, start, stop)]`` of the buckets that hold any of positions ``first ..
    n_positions - 1`` (``stop`` exclusive, clipped to ``n_positions``)."""
    out = []
    for i, a in enumerate(EDGES):
        b = EDGES[i + 1] if i + 1 < len(EDGES) else None
        lo, hi = max(a, first), n_positions if b is None else min(b, n_positions)
        if lo < hi:
            out.append((_label(a, b), lo, hi))
    return out


def _round(v: float | None, digits: int = 6):
    return None if v is None or not math.isfinite(v) else float(f"{v:.{digits}g}")


def window_buckets(results: dict, served: str) -> dict:
    """The report's ``by_position`` section from :func:`compressor.evaluate.compare`'s results.

    Per bucket: the tokens counted (positions x windows), the reference's perplexity and,
    for each compared configuration, its perplexity, KL mean and p99 (nats) and top-1
    agreement (percent). ``measured_on`` names the configuration the gates judge.
    """
    ref = results["reference"]
    seqlen, n_windows = ref["seqlen"], ref["windows"]
    n = seqlen - 1
    rows = {label: r for label, r in results.items() if label not in ("reference", "seconds")}
    out = []
    for label, a, b in buckets(n):
        tokens = (b - a) * n_windows
        row = {"bucket": label, "first": a, "last": b - 1, "tokens": tokens,
               "ppl_reference": _round(math.exp(float(ref["pos_nll"][a:b].sum()) / tokens))}
        configs = {}
        for name, r in rows.items():
            kl = np.asarray(r["kl_values"], dtype=np.float64).reshape(n_windows, n)[:, a:b]
            configs[name] = {"ppl": _round(math.exp(float(r["pos_nll"][a:b].sum()) / tokens)),
                             "kl_mean": _round(float(kl.mean())), "kl_p99": _round(float(np.percentile(kl, 99))),
                             "top1_pct": _round(100.0 * float(r["pos_same"][a:b].sum()) / tokens)}
        row["configurations"] = configs
        out.append(row)
    return {"measured_on": served, "edges": list(EDGES), "seqlen": seqlen, "windows": n_windows, "buckets": out}


def sequence_buckets(kl: list[float], same: list[bool], first: int) -> list[dict]:
    """Buckets of one generated sequence: ``kl[i]`` and ``same[i]`` belong to query
    position ``first + i``; per bucket ``{"bucket", "first", "last", "tokens", "kl_mean",
    "top1_pct"}``."""
    out = []
    for label, a, b in buckets(first + len(kl), first):
        k = np.asarray(kl[a - first:b - first], dtype=np.float64)
        s = np.asarray(same[a - first:b - first], dtype=bool)
        out.append({"bucket": label, "first": a, "last": b - 1, "tokens": int(k.size),
                    "kl_mean": _round(float(k.mean())), "top1_pct": _round(100.0 * float(s.mean()))})
    return out
