"""The KV cache as a service uses it: long greedy generation and multi-turn chat (issue #47).

Teacher-forced windows (:mod:`compressor.evaluate`) measure the cache over a prefill;
here it is measured as a serving engine uses it, token by token, against the same model
with a float cache (transformers' ``DynamicCache``), both stepped in lockstep:

* :func:`long_generation` -- the float-cache model continues a prompt greedily for ``n``
  tokens; the quantized-cache model is teacher-forced on that continuation (fed the same
  tokens, one per step) and compared at every step: KL(float || quantized) in nats, top-1
  agreement, the first step where the top-1 tokens differ. Then the quantized-cache model
  runs free (its own greedy tokens) and both continuations get a degeneration signal, the
  percentage of repeated 4-grams (``100 * (1 - distinct / all)`` over the 4-grams of the
  generated tokens; loops drive it up).
* :func:`multi_turn` -- a conversation rendered by the tokenizer's chat template, one user
  turn at a time: each turn's new text (the template's rendering minus what the caches
  already hold) is appended to the same two cache objects (prefix reuse, as an engine with
  a prefix cache serves a follow-up), then the float-cache model replies greedily and the
  quantized-cache model is teacher-forced on the reply. Per turn: the figures above over
  the appended prompt and over the reply.

The prompt and each appended turn go through the cache in chunks of ``kv_chunk`` tokens
(chunked prefill), the generated tokens one at a time. No EOS stops a long generation (as
the greedy-drift check, :func:`compressor.quality.greedy_drift`); a reply stops at the
model's EOS or after ``reply_tokens``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from .positions import sequence_buckets
from .stats import kl_and_top1, summarize

#: tokens of the evaluation text a long generation starts from (the first window's start)
LONG_PROMPT_TOKENS = 128
#: greedy tokens of each assistant reply in :func:`multi_turn`
REPLY_TOKENS = 48
#: characters of the evaluation text per user turn (cut at a word boundary)
TURN_CHARS = 400


class _Run:
    """One model with one cache, stepped: :meth:`feed` appends tokens and returns their logits."""

    def __init__(self, model, cache, kv_chunk: int):
        from .quant.kv import cache_kwarg

        self.model, self.cache, self.chunk = model, cache, kv_chunk
        self.kw = cache_kwarg(model)

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """``ids [n]`` int64 appended to the cache in chunks of ``kv_chunk``; logits ``[n, vocab]``
        float32 (``all_logits``) or ``[vocab]`` of the last token."""
        ids = ids.view(1, -1)
        parts = []
        for a in range(0, ids.shape[1], self.chunk):
            last = a + self.chunk >= ids.shape[1]
            keep = {} if all_logits or not last else {"logits_to_keep": 1}
            out = self.model(ids[:, a:a + self.chunk], use_cache=True, **{self.kw: self.cache}, **keep)
            if all_logits or last:
                parts.append(out.logits[0].float())
        logits = torch.cat(parts)
        return logits if all_logits else logits[-1]


def _float_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def repeated_4gram_pct(tokens: list[int]) -> float | None:
    """Percentage of 4-grams of ``tokens`` that repeat an earlier one (``None`` under 4 tokens)."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return None if not grams else round(100.0 * (1 - len(set(grams)) / len(grams)), 4)


def _first_false(same: list[bool]) -> int | None:
    return next((i for i, s in enumerate(same) if not s), None)


def _lockstep(fl: _Run, q: _Run, lf: torch.Tensor, lq: torch.Tensor, n: int, stop: set[int]) -> dict:
    """Greedy ``n`` tokens of the float run (logits ``lf [vocab]`` so far), the quantized run
    fed the same tokens; per step KL and top-1 agreement. Stops after a token in ``stop``."""
    tokens, kls, same = [], [], []
    device = lf.device
    for t in range(n):
        kl, s = kl_and_top1(lf[None], lq[None])
        kls.append(float(kl[0]))
        same.append(bool(s[0]))
        nxt = int(lf.argmax())
        tokens.append(nxt)
        if t + 1 < n and nxt not in stop:
            x = torch.tensor([nxt], device=device)
            lf, lq = fl.feed(x), q.feed(x)
        if nxt in stop:
            break
    return {"tokens": tokens, "kl": kls, "same": same}


def _free_run(run: _Run, logits: torch.Tensor, n: int) -> list[int]:
    tokens = []
    for t in range(n):
        tokens.append(int(logits.argmax()))
        if t + 1 < n:
            logits = run.feed(torch.tensor([tokens[-1]], device=logits.device))
    return tokens


@torch.no_grad()
def long_generation(model, make_cache: Callable[[], object], prompt: torch.Tensor, n_tokens: int,
                    kv_chunk: int = 128) -> dict:
    """Long greedy generation with the float cache vs the quantized cache (module docstring).

    Args:
        model: a transformers causal LM; ``make_cache``: a fresh quantized cache
            (:func:`compressor.quant.kv.quantized_cache`).
        prompt: ``[P]`` int64 token ids on the model's device (``P >= 1``).
        n_tokens: tokens generated (``>= 1``).

    Returns:
        ``{"prompt_tokens", "tokens", "first_position", "top1_agreement_pct", "first_divergence",
        "kl": summary, "by_position": buckets, "kl_per_token", "disagreements", "repeated_4gram_pct":
        {"float", "quantized"}, "free_running_first_difference"}``: positions are query positions
        (``first_position`` is the prompt's last token, ``P - 1``; see :mod:`compressor.positions`);
        ``first_divergence``, ``disagreements`` and ``free_running_first_difference`` index the
        generated tokens (``None``: no difference).
    """
    fl, q = _Run(model, _float_cache(model), kv_chunk), _Run(model, make_cache(), kv_chunk)
    steps = _lockstep(fl, q, fl.feed(prompt), q.feed(prompt), n_tokens, set())
    free = _Run(model, make_cache(), kv_chunk)
    q_tokens = _free_run(free, free.feed(prompt), n_tokens)
    first = int(prompt.numel()) - 1
    same = steps["same"]
    return {
        "prompt_tokens": int(prompt.numel()), "tokens": n_tokens, "first_position": first,
        "top1_agreement_pct": round(100.0 * sum(same) / len(same), 4), "first_divergence": _first_false(same),
        "kl": summarize(steps["kl"]), "by_position": sequence_buckets(steps["kl"], same, first),
        "kl_per_token": [float(f"{v:.4g}") for v in steps["kl"]],
        "disagreements": [i for i, s in enumerate(same) if not s],
        "repeated_4gram_pct": {"float": repeated_4gram_pct(steps["tokens"]), "quantized": repeated_4gram_pct(q_tokens)},
        "free_running_first_difference": _first_false([a == b for a, b in zip(steps["tokens"], q_tokens)]),
    }


def user_turns(text: str, n: int, chars: int = TURN_CHARS) -> list[str]:
    """``n`` user messages from an evaluation text: its paragraphs (blank-line separated; its
    lines when that gives fewer than ``n``, as in wikitext read by :func:`compressor.calib.load_text`;
    ``= heading =`` lines skipped) of at least 40 characters, whitespace collapsed, each cut to
    ``chars`` at a word boundary; fewer when the text has fewer."""
    out = _turns(re.split(r"\n\s*\n", text), n, chars)
    return out if len(out) == n else _turns(text.splitlines(), n, chars)


def _turns(paragraphs: list[str], n: int, chars: int) -> list[str]:
    out = []
    for para in paragraphs:
        p = " ".join(para.split())
        if len(p) < 40 or p.startswith("= "):
            continue
        out.append(p if len(p) <= chars else p[:chars].rsplit(" ", 1)[0])
        if len(out) == n:
            break
    return out


NO_TEMPLATE = "the tokenizer has no chat template: the multi-turn check did not run"


class ChatTurns:
    """A conversation through a tokenizer's chat template as a server with a prefix cache feeds it: at each
    user turn, the token ids of the text the template adds to what the cache already holds (the earlier
    turns' rendering, replies included, is a prefix of the next one's)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.messages, self.held, self.stopped = tokenizer, [], "", None

    def ask(self, user: str) -> list[int] | None:
        """The ids to append for the user turn ``user`` (the generation prompt included); ``None`` when
        the template renders the earlier turns differently (``stopped`` says so), and the chat ends."""
        self.messages.append({"role": "user", "content": user})
        text = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        if not text.startswith(self.held):
            self.stopped = (f"the chat template renders earlier turns differently at turn "
                            f"{sum(m['role'] == 'user' for m in self.messages)}: stopped there")
            return None
        new, self.held = text[len(self.held):], text
        return self.tokenizer(new, add_special_tokens=False)["input_ids"]

    def answer(self, tokens: list[int], eos: bool) -> None:
        """The reply ``tokens`` generated (all of them in the cache; the last one the stop token when ``eos``)."""
        content = self.tokenizer.decode(tokens[:-1] if eos else tokens, skip_special_tokens=True)
        self.held += self.tokenizer.decode(tokens, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": content})


def _stop_ids(model, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return {int(i) for i in ids if i is not None}


def span_figures(kl: list[float], same: list[bool]) -> dict:
    """A span's figures (a turn's prompt or reply): ``{"tokens", "kl_mean" (nats), "top1_pct", "first_divergence"}``
    from its per-position KL and top-1 agreement."""
    return {"tokens": len(kl), "kl_mean": summarize(kl)["mean"],
            "top1_pct": round(100.0 * sum(same) / len(same), 4) if same else None,
            "first_divergence": _first_false(same)}


@torch.no_grad()
def past_bound_note(turn: int, bound: int, why: str) -> str:
    """The note of a chat stopped before turn ``turn`` (from 1), which would pass ``bound`` tokens (``why``)."""
    return f"turn {turn} would take the conversation past {bound} tokens ({why}): stopped there"


def multi_turn(model, make_cache: Callable[[], object], tokenizer, users: list[str],
               reply_tokens: int = REPLY_TOKENS, kv_chunk: int = 128) -> dict:
    """A multi-turn conversation through the tokenizer's chat template, the float and the
    quantized cache each kept across turns (module docstring).

    Returns ``{"turns": [{"turn", "context_tokens", "prompt": figures, "reply": figures,
    "ended"}], "note"}``; figures are ``{"tokens", "kl_mean", "top1_pct", "first_divergence"}``
    (the prompt's are teacher-forced on the appended turn's text, its first position
    predicting the second). ``note`` says why the conversation stopped early or did not run
    (no chat template: ``turns`` empty), else ``None``. A turn that would take the conversation
    past the model's context length (``max_position_embeddings``: its text and a full reply) is
    not run: the chat stops there, and ``note`` says so (as serve-smoke's runtime chat does).
    """
    if not getattr(tokenizer, "chat_template", None):
        return {"turns": [], "note": NO_TEMPLATE}
    device = next(model.parameters()).device
    fl, q = _Run(model, _float_cache(model), kv_chunk), _Run(model, make_cache(), kv_chunk)
    stop = _stop_ids(model, tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None)
    chat, turns, note = ChatTurns(tokenizer), [], None
    for i, user in enumerate(users):
        new = chat.ask(user)
        if new is None:
            note = chat.stopped
            break
        context = fl.cache.get_seq_length()
        if limit and context + len(new) + reply_tokens > limit:
            note = past_bound_note(i + 1, limit, "the model's context length")
            break
        ids = torch.tensor(new, device=device)
        lf, lq = fl.feed(ids, all_logits=True), q.feed(ids, all_logits=True)
        kl, same = kl_and_top1(lf[:-1], lq[:-1])
        steps = _lockstep(fl, q, lf[-1], lq[-1], reply_tokens, stop)
        ended = "eos" if steps["tokens"][-1] in stop else "length"
        last = torch.tensor(steps["tokens"][-1:], device=device)  # generated, not yet fed: into both caches
        fl.feed(last), q.feed(last)
        chat.answer(steps["tokens"], ended == "eos")
        turns.append({"turn": i + 1, "context_tokens": int(context),
                      "prompt": span_figures(kl.tolist(), same.tolist()),
                      "reply": span_figures(steps["kl"], steps["same"]), "ended": ended})
    return {"turns": turns, "note": note}
