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
def window_logits(model, x: torch.Tensor, make_cache: Callable[[], object] | None = None, kv_chunk: int = 128) -> torch.Tensor:
    """Next-token logits ``[seqlen - 1, vocab]`` float32 for one window ``x [1, seqlen]``.

    Without ``make_cache``: one forward pass. With it: chunks of ``kv_chunk`` tokens
    through a fresh cache (see the module docstring).
    """
    if make_cache is None:
        return model(x).logits[0, :-1].float()
    from .quant.kv import cache_kwarg

    cache = make_cache()
    kw = cache_kwarg(model)
    parts = [model(x[:, a : a + kv_chunk], use_cache=True, **{kw: cache}).logits[0].float()
             for a in range(0, x.shape[1], kv_chunk)]
    return torch.cat(parts)[:-1]


@torch.no_grad()
def compare(
    reference,
    candidates: dict[str, tuple[object, Callable[[], object] | None]],
    wins: torch.Tensor,
    device: str = "cpu",
    kv_chunk: int = 128,
    on_window: Callable[[int, int], None] | None = None,
) -> dict:
    """Perplexity of the reference and of each candidate, and each candidate's KL
    divergence and top-1 agreement against the reference, window by window.

    Args:
        reference: the original model (float, no quantized cache).
        candidates: label -> (model, make_cache or None); models may repeat with different caches.
        wins: ``[n_windows, seqlen]`` int64 token windows.

    Memory holds one window's logits per model at a time (``seqlen x vocab`` float32);
    per-token KL values (8 bytes each) are kept for the median and p99.

    Returns:
        ``{"reference": ppl dict, label: ppl dict + {"kl": summary, "kl_values": [...],
        "top1_agreement", "per_window_kl_mean", "per_window_top1"}}`` (see
        :func:`compressor.stats.kl_and_top1`, :func:`compressor.stats.summarize`).
    """
    from .stats import kl_and_top1, summarize

    t0 = time.perf_counter()
    acc = {label: {"nll": 0.0, "per": [], "kl": [], "same": 0, "w_kl": [], "w_top1": []} for label in ["reference", *candidates]}
    count = 0
    for i, w in enumerate(wins):
        x = w.unsqueeze(0).to(device)
        target = x[0, 1:]
        ref_logits = window_logits(reference, x)
        n = target.numel()
        nll = torch.nn.functional.cross_entropy(ref_logits, target, reduction="sum").double().item()
        acc["reference"]["nll"] += nll
        acc["reference"]["per"].append(math.exp(nll / n))
        for label, (model, make_cache) in candidates.items():
            logits = window_logits(model, x, make_cache, kv_chunk)
            nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum").double().item()
            kl, same = kl_and_top1(ref_logits, logits)
            a = acc[label]
            a["nll"] += nll
            a["per"].append(math.exp(nll / n))
            a["kl"].append(kl.cpu())
            a["same"] += int(same.sum())
            a["w_kl"].append(float(kl.mean()))
            a["w_top1"].append(float(same.double().mean()))
            del logits
        del ref_logits
        count += n
        if on_window:
            on_window(i + 1, len(wins))
    out = {}
    for label, a in acc.items():
        r = {"ppl": math.exp(a["nll"] / count), "nll": a["nll"] / count, "windows": int(wins.shape[0]),
             "seqlen": int(wins.shape[1]), "predicted_tokens": count, "per_window_ppl": [round(p, 4) for p in a["per"]]}
        if label != "reference":
            values = torch.cat(a["kl"]).numpy()
            r.update(kl=summarize(values), kl_values=values, top1_agreement=a["same"] / count,
                     per_window_kl_mean=[float(f"{v:.6g}") for v in a["w_kl"]],
                     per_window_top1=[float(f"{v:.6g}") for v in a["w_top1"]])
        out[label] = r
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


@torch.no_grad()
def hidden_state_errors(reference, model, batches: torch.Tensor, device: str = "cpu") -> list[float]:
    """Relative error of ``model``'s hidden state after each decoder layer against the
    reference's, both run end to end on ``batches [n, seqlen]`` (float64 sums).

    Returns one value per decoder layer (its output, captured by a forward hook; the
    final norm is not applied).
    """
    from .arch import get_arch

    def outputs(m, x):
        layers = m.get_submodule(get_arch(m.config.model_type).layers)
        got = []
        hooks = [layer.register_forward_hook(lambda _m, _i, o: got.append((o[0] if isinstance(o, tuple) else o).detach()))
                 for layer in layers]
        try:
            m(x)
        finally:
            for h in hooks:
                h.remove()
        return got

    num, den = None, None
    for b in batches:
        x = b.unsqueeze(0).to(device)
        hr, ha = outputs(reference, x), outputs(model, x)
        n = torch.stack([(a.double() - r.double()).pow(2).sum() for a, r in zip(ha, hr)])
        d = torch.stack([r.double().pow(2).sum() for r in hr])
        num = n if num is None else num + n
        den = d if den is None else den + d
    return [math.sqrt(float(a) / float(b)) if float(b) > 0 else math.inf for a, b in zip(num, den)]


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
        logits = window_logits(model, x, make_cache, kv_chunk)
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
