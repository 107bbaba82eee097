"""Perplexity on a text, in the convention of the published AWQ/GPTQ/llama.cpp tables.

The whole text is tokenized once without special tokens and cut into non-overlapping
windows of ``seqlen`` tokens (the tail shorter than a window is dropped); each window
is an independent sequence, every position after the first is predicted, and
``ppl = exp(mean token NLL)`` over all predicted tokens (``windows * (seqlen - 1)``).
Memory stays bounded by one window's logits (``seqlen x vocab`` float32).

With a quantized KV cache (``make_cache``), each window is fed in chunks of
``kv_chunk`` tokens through a fresh cache, as a serving engine's chunked prefill does:
every chunk's queries attend to what the cache returns after the chunk was written
(older tokens quantized, KIVI's residual window in full precision). Without a cache
the window is one forward pass (identical results to a chunked pass with a float cache).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .errors import InputError


def windows(ids: torch.Tensor, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """``[n_windows, seqlen]`` non-overlapping windows of the token stream ``ids [n]``.

    Raises:
        InputError: the text is shorter than one window.
    """
    n = ids.numel() // seqlen
    if n == 0:
        raise InputError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}; use a smaller --seqlen")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seqlen].view(n, seqlen)


@torch.no_grad()
def perplexity(
    model,
    wins: torch.Tensor,
    device: str = "cpu",
    on_window: Callable[[int, int], None] | None = None,
    make_cache: Callable[[], object] | None = None,
    kv_chunk: int = 128,
) -> dict:
    """Perplexity of ``model`` over ``wins [n_windows, seqlen]`` (int64).

    ``make_cache``: returns a fresh transformers ``Cache`` (e.g.
    :func:`compressor.quant.kv.quantized_cache`) used for each window, fed in chunks of
    ``kv_chunk`` tokens.

    Returns:
        ``{"ppl", "nll", "windows", "seqlen", "predicted_tokens", "per_window_ppl", "seconds"}``;
        NLL accumulated in float64.
    """
    t0 = time.perf_counter()
    total, count, per = 0.0, 0, []
    for i, w in enumerate(wins):
        x = w.unsqueeze(0).to(device)
        if make_cache is None:
            logits = model(x).logits[0, :-1].float()
        else:
            from .quant.kv import cache_kwarg

            cache = make_cache()
            kw = cache_kwarg(model)
            parts = [model(x[:, a : a + kv_chunk], use_cache=True, **{kw: cache}).logits[0].float()
                     for a in range(0, x.shape[1], kv_chunk)]
            logits = torch.cat(parts)[:-1]
            del cache, parts
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").double().item()
        total += nll
        count += x.shape[1] - 1
        per.append(math.exp(nll / (x.shape[1] - 1)))
        del logits
        if on_window:
            on_window(i + 1, len(wins))
    return {
        "ppl": math.exp(total / count),
        "nll": total / count,
        "windows": int(wins.shape[0]),
        "seqlen": int(wins.shape[1]),
        "predicted_tokens": count,
        "per_window_ppl": [round(p, 4) for p in per],
        "seconds": round(time.perf_counter() - t0, 2),
    }
