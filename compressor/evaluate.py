"""Perplexity on a text, in the convention of the published AWQ/GPTQ/llama.cpp tables.

The whole text is tokenized once without special tokens and cut into non-overlapping
windows of ``seqlen`` tokens (the tail shorter than a window is dropped); each window
is an independent sequence, every position after the first is predicted, and
``ppl = exp(mean token NLL)`` over all predicted tokens (``windows * (seqlen - 1)``).
Memory stays bounded by the logits of ``LOGIT_CHUNK`` positions (the head is applied to
the decoder's final hidden states a chunk at a time), not by ``seqlen x vocab``.

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


def windows(ids: torch.Tensor, seqlen: int, max_windows: int | None = None, bos_id: int | None = None) -> torch.Tensor:
    """``[n_windows, seqlen]`` non-overlapping windows of the token stream ``ids [n]``.

    With ``bos_id`` (the tokenizer adds a BOS: :func:`compressor.tokens.bos_token_id`)
    each window is the BOS followed by the next ``seqlen - 1`` text tokens, as llama.cpp's
    perplexity evaluates: the model sees what it sees in service, and the BOS is never a
    predicted token. Without it, windows are ``seqlen`` text tokens (the published
    AWQ/GPTQ tables' convention).

    Raises:
        InputError: the text is shorter than one window.
    """
    if bos_id is not None:
        body = windows(ids, seqlen - 1, max_windows)
        return torch.cat([torch.full((body.shape[0], 1), bos_id, dtype=body.dtype), body], dim=1)
    n = ids.numel() // seqlen
    if n == 0:
        raise InputError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}; use a smaller --seqlen")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seqlen].view(n, seqlen)


#: positions whose logits are materialized at once: peak memory of the statistics is about
#: ``LOGIT_CHUNK x vocab x 4 B x 6`` (two models' logits, two log-softmaxes, the KL terms),
#: not ``seqlen x vocab`` (a 2048-token window over a 262k vocabulary is 2.1 GB per copy)
LOGIT_CHUNK = 64


@torch.no_grad()
def window_logits(model, x: torch.Tensor, make_cache: Callable[[], object] | None = None, kv_chunk: int = 128) -> torch.Tensor:
    """Next-token logits ``[seqlen - 1, vocab]`` float32 for one window ``x [1, seqlen]``.

    Without ``make_cache``: one forward pass. With it: chunks of ``kv_chunk`` tokens
    through a fresh cache (see the module docstring). Materializes the whole window's
    logits: the statistics use :func:`window_hidden` and :class:`LogitHead` instead.
    """
    if make_cache is None:
        return model(x).logits[0, :-1].float()
    from .quant.kv import cache_kwarg

    cache = make_cache()
    kw = cache_kwarg(model)
    parts = [model(x[:, a : a + kv_chunk], use_cache=True, **{kw: cache}).logits[0].float()
             for a in range(0, x.shape[1], kv_chunk)]
    return torch.cat(parts)[:-1]


class LogitHead:
    """The model's output head applied to chunks of final hidden states, so a window's
    logits never exist all at once (transformers' causal-LM heads: ``lm_head`` then the
    optional ``final_logit_softcapping``, Gemma's ``cap * tanh(logits / cap)``).

    ``usable`` is false when the model has no separate decoder/head, or when the head
    applied to the decoder's output does not reproduce the model's own logits on a short
    probe (a head with a scaling kvq does not know): callers then fall back to
    :func:`window_logits`.
    """

    def __init__(self, model, probe: torch.Tensor):
        self.model = model
        self.decoder = getattr(model, "get_decoder", lambda: None)()
        self.head = getattr(model, "get_output_embeddings", lambda: None)()
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self.usable = self.decoder is not None and self.head is not None and self._probe(probe)

    def _probe(self, x: torch.Tensor) -> bool:
        try:
            want = self.model(x).logits[0].float()
            got = self(self.decoder(x).last_hidden_state[0])
        except Exception:  # noqa: BLE001 - any mismatch in calling convention means: not usable
            return False
        return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, H]`` (the decoder's final, normed states) -> logits ``[n, vocab]`` float32."""
        logits = self.head(hidden).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


@torch.no_grad()
def window_hidden(model, x: torch.Tensor, make_cache: Callable[[], object] | None = None, kv_chunk: int = 128) -> torch.Tensor:
    """Final hidden states ``[seqlen, H]`` of ``model.get_decoder()`` for one window
    ``x [1, seqlen]``; with ``make_cache``, fed in chunks of ``kv_chunk`` tokens through a
    fresh quantized cache exactly as :func:`window_logits` does."""
    decoder = model.get_decoder()
    if make_cache is None:
        return decoder(x).last_hidden_state[0]
    from .quant.kv import cache_kwarg

    cache = make_cache()
    kw = cache_kwarg(decoder)
    return torch.cat([decoder(x[:, a : a + kv_chunk], use_cache=True, **{kw: cache}).last_hidden_state[0]
                      for a in range(0, x.shape[1], kv_chunk)])


def _chunked_logits(model, x: torch.Tensor, make_cache, kv_chunk: int, head: LogitHead | None):
    """A function ``(a, b) -> logits [b - a, vocab]`` float32 for predicting positions
    ``a..b-1`` of the window (chunked through ``head`` when usable, else sliced from the
    whole window's logits)."""
    if head is not None and head.usable:
        h = window_hidden(model, x, make_cache, kv_chunk)
        return lambda a, b: head(h[a:b])
    full = window_logits(model, x, make_cache, kv_chunk)
    return lambda a, b: full[a:b]


@torch.no_grad()
def compare(
    reference,
    candidates: dict[str, tuple[object, Callable[[], object] | None]],
    wins: torch.Tensor,
    device: str = "cpu",
    kv_chunk: int = 128,
    on_window: Callable[[int, int], None] | None = None,
    logit_chunk: int = LOGIT_CHUNK,
    share=None,
) -> dict | None:
    """Perplexity of the reference and of each candidate, and each candidate's KL
    divergence and top-1 agreement against the reference, window by window.

    Args:
        reference: the original model (float, no quantized cache).
        candidates: label -> (model, make_cache or None); models may repeat with different caches.
        wins: ``[n_windows, seqlen]`` int64 token windows.
        logit_chunk: positions whose logits exist at once (see :data:`LOGIT_CHUNK`).
        share: under several ranks (:class:`compressor.verify_ranks.Share`): this rank evaluates
            its block of ``wins`` only, rank 0 receives every window's figures and adds them in
            window order as one process does (the same figures, bit for bit); ``None``: every window here.

    Memory holds each model's final hidden states for one window (``seqlen x hidden``)
    and the logits of ``logit_chunk`` positions per model at a time; per-token KL values
    (8 bytes each) are kept for the median and p99.

    Returns:
        ``{"reference": ppl dict, label: ppl dict + {"kl": summary, "kl_values": [...],
        "top1_agreement", "per_window_kl_mean", "per_window_top1"}}`` (see
        :func:`compressor.stats.kl_and_top1`, :func:`compressor.stats.summarize`); ``None`` on
        a rank other than 0 under ``share``.
    """
    t0 = time.perf_counter()
    acc = new_acc(["reference", *candidates])
    heads: dict[int, LogitHead] = {}
    probe = wins[:1, :8].to(device)  # the first window's, on every rank: the same head either way
    own = range(len(wins)) if share is None else range(*share.block(len(wins)))
    records = []
    for k, i in enumerate(own):
        x = wins[i].unsqueeze(0).to(device)
        for m in [reference] + [m for m, _ in candidates.values()]:
            if id(m) not in heads:
                heads[id(m)] = LogitHead(m, probe)
        ref_at = _chunked_logits(reference, x, None, kv_chunk, heads[id(reference)])
        cand_at = {label: _chunked_logits(m, x, mc, kv_chunk, heads[id(m)]) for label, (m, mc) in candidates.items()}
        rec = window_record(x[0, 1:], ref_at, cand_at, logit_chunk)
        if share is None:
            fold(acc, rec)  # one process: added as it comes
        else:
            records.append(rec)
        if on_window:
            on_window(k + 1, len(own))
    if share is not None:
        records = share.gather(records)  # every window's, in window order, on rank 0
        if records is None:
            return None
        for rec in records:
            fold(acc, rec)
    out = summaries(acc, wins)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def new_acc(labels) -> dict:
    """The running sums :func:`fold` adds windows into, per configuration label."""
    return {label: {"nll": 0.0, "per": [], "kl": [], "same": 0, "w_kl": [], "w_top1": []} for label in labels}


def window_record(target: torch.Tensor, ref_at, cand_at: dict, logit_chunk: int) -> dict:
    """One window's figures, ``logit_chunk`` positions at a time: per label ``{"nll": float (sum,
    nats), "pos_nll": float64 [n], "pos_same": int64 [n]}``, candidates also ``{"kl": float32 [n]
    (per position, nats), "same": int}`` (``target [n]``: the predicted tokens; ``ref_at``,
    ``cand_at[label]``: ``(a, b) -> logits [b - a, vocab]``). What :func:`fold` adds up; plain
    tensors, floats and ints, so it travels between ranks (:func:`compressor.distributed.gather`)."""
    from .stats import kl_and_top1

    n = target.numel()
    labels = ["reference", *cand_at]
    nll = {label: 0.0 for label in labels}
    kls = {label: [] for label in cand_at}
    same = {label: 0 for label in cand_at}
    pos = {label: (torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.int64)) for label in labels}
    for a in range(0, n, logit_chunk):
        b = min(a + logit_chunk, n)
        ref_logits = ref_at(a, b)
        nll["reference"] += _token_nll(ref_logits, target[a:b], pos["reference"][0][a:b])
        for label, at in cand_at.items():
            logits = at(a, b)
            nll[label] += _token_nll(logits, target[a:b], pos[label][0][a:b])
            kl, s = kl_and_top1(ref_logits, logits)
            kls[label].append(kl.cpu())
            same[label] += int(s.sum())
            pos[label][1][a:b] = s.cpu().long()
            del logits
        del ref_logits
    rec = {label: {"nll": nll[label], "pos_nll": pos[label][0], "pos_same": pos[label][1]} for label in labels}
    for label in cand_at:
        rec[label].update(kl=torch.cat(kls[label]), same=same[label])
    return rec


def fold(acc: dict, rec: dict) -> None:
    """Add one window's :func:`window_record` into ``acc`` (:func:`new_acc`); windows added in
    window order give the same sums, bit for bit, wherever each window was evaluated."""
    for label, a in acc.items():
        r = rec[label]
        n = r["pos_nll"].numel()
        # per-position sums over windows (compressor.positions reads them into position buckets)
        a["pos_nll"] = r["pos_nll"] + a.get("pos_nll", 0)
        a["pos_same"] = r["pos_same"] + a.get("pos_same", 0)
        a["nll"] += r["nll"]
        a["per"].append(math.exp(r["nll"] / n))
        if "kl" in r:
            kl = r["kl"]
            a["kl"].append(kl)
            a["same"] += r["same"]
            a["w_kl"].append(float(kl.mean()))
            a["w_top1"].append(r["same"] / n)


def summaries(acc: dict, wins: torch.Tensor) -> dict:
    """Each label's figures from the sums of every window of ``wins [n_windows, seqlen]``."""
    count = int(wins.shape[0]) * (int(wins.shape[1]) - 1)
    return {label: _summary(label, a, wins, count) for label, a in acc.items()}


def _token_nll(logits: torch.Tensor, target: torch.Tensor, out: torch.Tensor) -> float:
    """NLL of each position (``logits [n, vocab]``, ``target [n]``) into ``out [n]`` float64; returns their sum."""
    per = torch.nn.functional.cross_entropy(logits, target, reduction="none").double().cpu()
    out.copy_(per)
    return float(per.sum())


def _summary(label: str, a: dict, wins: torch.Tensor, count: int) -> dict:
    from .stats import summarize

    r = {"ppl": math.exp(a["nll"] / count), "nll": a["nll"] / count, "windows": int(wins.shape[0]),
         "seqlen": int(wins.shape[1]), "predicted_tokens": count, "per_window_ppl": [round(p, 4) for p in a["per"]],
         "pos_nll": a.get("pos_nll"), "pos_same": a.get("pos_same") if label != "reference" else None}
    if label != "reference":
        values = torch.cat(a["kl"]).numpy()
        r.update(kl=summarize(values), kl_values=values, top1_agreement=a["same"] / count,
                 per_window_kl_mean=[float(f"{v:.6g}") for v in a["w_kl"]],
                 per_window_top1=[float(f"{v:.6g}") for v in a["w_top1"]])
    return r


@torch.no_grad()
def hidden_state_errors(reference, model, batches: torch.Tensor, device: str = "cpu", share=None) -> list[float] | None:
    """Relative error of ``model``'s hidden state after each decoder layer against the
    reference's, both run end to end on ``batches [n, seqlen]`` (float64 sums).

    ``share`` (several ranks, :class:`compressor.verify_ranks.Share`): this rank runs its block
    of ``batches``; rank 0 adds every batch's sums in batch order (the one-process figures, bit for
    bit) and the other ranks get ``None``.

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

    terms = []
    for j in range(len(batches)) if share is None else range(*share.block(len(batches))):
        x = batches[j].unsqueeze(0).to(device)
        hr, ha = outputs(reference, x), outputs(model, x)
        terms.append((torch.stack([(a.double() - r.double()).pow(2).sum() for a, r in zip(ha, hr)]),
                      torch.stack([r.double().pow(2).sum() for r in hr])))
    if share is not None:
        terms = share.gather(terms)
        if terms is None:
            return None
    num, den = None, None
    for n, d in terms:
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
    head = None
    for i, w in enumerate(wins):
        x = w.unsqueeze(0).to(device)
        head = head or LogitHead(model, x[:, :8])
        logits_at = _chunked_logits(model, x, make_cache, kv_chunk, head)
        target = x[0, 1:]
        nll = sum(torch.nn.functional.cross_entropy(logits_at(a, min(a + LOGIT_CHUNK, target.numel())),
                                                    target[a:a + LOGIT_CHUNK], reduction="sum").double().item()
                  for a in range(0, target.numel(), LOGIT_CHUNK))
        total += nll
        count += x.shape[1] - 1
        per.append(math.exp(nll / (x.shape[1] - 1)))
        del logits_at
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
