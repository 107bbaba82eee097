"""``kvq serve-smoke --long-tokens N`` and ``--turns N`` (issue #47): a long greedy generation and a
multi-turn chat through the bundled runtime as served (packed weights, the artifact's KV cache) against
the reference model.

The runtime continues the first prompt greedily for ``N`` tokens and is teacher-forced on the
same tokens one at a time through a fresh cache (its decode path, :meth:`Runtime.logits` with
``chunk=1``): :func:`long_runtime`, before the runtime is released. The reference (float
weights, float cache; whole, or a decoder layer at a time) is then teacher-forced on prompt +
continuation: :func:`long_compare`. Per generated position: top-1 agreement (the reference's
choice vs the token the runtime generated), KL(reference || runtime) in nats, both also per
bucket of query positions (:mod:`compressor.positions`); the first divergence; and the
degeneration signal of :func:`compressor.service_eval.repeated_4gram_pct` for the runtime's
continuation and the reference's own greedy one (:func:`greedy_by_passes` when streamed).

The chat (:func:`turns_runtime`, then :func:`turns_compare`): the prompts are the user turns, through
the tokenizer's chat template, with one runtime cache kept across the turns (prefix reuse); the
reference is teacher-forced on the whole conversation, and each turn gets the figures of ``kvq
verify``'s multi-turn check over its prompt and over the runtime's reply.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import console as show
from ..evaluate import LOGIT_CHUNK
from ..positions import sequence_buckets
from ..service_eval import NO_TEMPLATE, ChatTurns, past_bound_note, repeated_4gram_pct, span_figures
from ..stats import first_divergence, kl_and_top1, summarize

#: ``forward(seqs, consume)``: the reference over token lists; ``consume(k, at)`` reads sequence
#: ``k``'s float32 logits of positions ``a .. b-1`` through ``at(a, b)`` (whole model or streamed)
Forward = Callable[[list[list[int]], Callable], None]


def chunked(at, start: int, end: int, step: int = LOGIT_CHUNK):
    """``(a, logits of positions a .. b-1)`` over ``[start, end)``, ``step`` positions at a time."""
    for a in range(start, end, step):
        yield a, at(a, min(a + step, end))


def argmax_pass(forward: Forward, prompt: list[int], cont: list[int]) -> list[int]:
    """The reference's greedy choice after ``prompt + cont[:j]`` for every ``j < len(cont)``: one pass."""
    out: list[int] = []
    forward([prompt + cont[:-1]], lambda _k, at: out.extend(
        t for _, lg in chunked(at, len(prompt) - 1, len(prompt) - 1 + len(cont)) for t in lg.argmax(-1).tolist()))
    return out


def greedy_by_passes(forward: Forward, prompt: list[int], cont: list[int], choices: list[int]) -> list[int]:
    """The reference's own greedy continuation of ``prompt`` (``len(cont)`` tokens) from
    teacher-forced passes, as a streamed reference must make it (generating would read every
    layer once per token): ``choices`` is the pass over ``prompt + cont`` (:func:`argmax_pass`).
    Each pass's choices are right up to and including the first one that differs from the tokens
    it was fed (every earlier input was the greedy one); they become the next pass's tokens
    (Jacobi iteration), so each pass settles at least one more token: at most one pass per token,
    none when the reference agrees with ``cont`` throughout."""
    for _ in range(len(cont) + 1):
        if first_divergence(choices, cont) is None:
            break
        cont = choices
        choices = argmax_pass(forward, prompt, cont)
    return cont


def long_runtime(rt, prompt: list[int], n_tokens: int, console=None) -> dict:
    """The runtime's part of the long generation: its continuation and its logits over it.

    Args:
        rt: the :class:`compressor.runtime.generate.Runtime` as served; ``prompt``: token ids (the first prompt's).

    Raises:
        InputError: prompt + ``n_tokens`` longer than the runtime's context.
    """
    rt.check_length(len(prompt) + n_tokens)
    show.step(console, f"long generation: {n_tokens} greedy tokens through the runtime after a {len(prompt)}-token "
                       "prompt ...")
    gen = rt.generate([prompt], max_new_tokens=n_tokens).tokens[0]
    served = rt.logits([(prompt + gen)[:-1]], chunk=1)[0, len(prompt) - 1:].float().cpu()
    return {"prompt": prompt, "gen": gen, "served": served}


@torch.no_grad()
def long_compare(run: dict, forward: Forward, greedy: Callable, console=None) -> dict:
    """The report's ``long_generation`` section (module docstring) from :func:`long_runtime`'s
    ``run``; ``greedy(prompt, cont, choices)``: the reference's own greedy continuation
    (``choices``: its choice at each of ``cont``'s positions, teacher-forced)."""
    prompt, gen, served = run["prompt"], run["gen"], run["served"]
    show.step(console, f"long generation: the reference over the {len(gen)} tokens ...")
    first = len(prompt) - 1
    kls, ref_next = [], []

    def consume(_k, at):
        for a, lg in chunked(at, first, first + len(gen)):
            kls.append(kl_and_top1(lg, served[a - first:a - first + lg.shape[0]])[0])
            ref_next.extend(lg.argmax(-1).tolist())

    forward([prompt + gen], consume)
    agree = [a == b for a, b in zip(ref_next, gen)]
    ref_gen = greedy(prompt, gen, ref_next)
    kls = torch.cat(kls).tolist() if kls else []
    return {
        "measured_on": "runtime (weights + KV as served)", "prompt_tokens": len(prompt), "tokens": len(gen),
        "first_position": first, "top1_agreement_pct": round(100.0 * sum(agree) / max(1, len(agree)), 4),
        "first_divergence": first_divergence(ref_next, gen), "kl": summarize(kls),
        "by_position": sequence_buckets(kls, agree, first), "kl_per_token": [float(f"{v:.4g}") for v in kls],
        "disagreements": [i for i, s in enumerate(agree) if not s],
        "repeated_4gram_pct": {"reference": repeated_4gram_pct(ref_gen), "runtime": repeated_4gram_pct(gen)},
        "runtime_vs_reference_first_difference": first_divergence(ref_gen, gen),
    }


#: room per turn in the runtime's cache for what the chat template adds around a user turn (roles, a system
#: prompt; SmolLM2's ChatML adds about 30 tokens at the first turn, 10 at each later one)
TEMPLATE_TOKENS = 64


def turn_users(prompts: list, turns: int) -> list:
    """The user turns of serve-smoke's chat: the prompts in order, again from the first when ``turns`` exceeds them."""
    return [prompts[i % len(prompts)] for i in range(turns)]


def chat_length(user_tokens: list[int], reply_tokens: int) -> int:
    """Tokens a chat takes, bounded: each turn's user text (``user_tokens``, one count a turn), :data:`TEMPLATE_TOKENS`
    and a reply of ``reply_tokens``."""
    return sum(n + TEMPLATE_TOKENS + reply_tokens for n in user_tokens)


def chat_room(tokenizer, users: list[str], reply_tokens: int) -> int:
    """Tokens the runtime's cache holds for a chat of ``users`` (:func:`chat_length` of their token counts)."""
    return chat_length([len(tokenizer(u, add_special_tokens=False)["input_ids"]) for u in users], reply_tokens)


@torch.inference_mode()
def turns_runtime(rt, tokenizer, users: list[str], reply_tokens: int, console=None) -> dict:
    """The runtime's part of the multi-turn chat (issue #47): one KV cache of the artifact's scheme kept
    across the turns, as a server with a prefix cache keeps it. At each turn the text the chat template
    adds (:class:`compressor.service_eval.ChatTurns`) is prefilled onto the cache, then a greedy reply of
    at most ``reply_tokens`` (ending at the tokenizer's EOS, as :class:`compressor.runtime.engine.Engine`
    serves) is decoded token by token, and its last token fed too.

    Returns ``{"turns": [{"ids": appended prompt ids, "reply": reply ids, "served": float32 logits
    [len(ids) + len(reply) - 1, vocab] (row r predicts token r + 1 of ids + reply), "ended": "eos" or
    "length"}], "note"}``; ``note``
    says why the chat stopped early or did not run (no chat template), else ``None``.

    A turn that would take the conversation past the model's context length (or, under DeepSeek sparse
    attention, past ``index_topk``: :meth:`~compressor.runtime.generate.Runtime.check_length`) is not run:
    the chat stops there, and ``note`` says so.
    """
    if not getattr(tokenizer, "chat_template", None):
        return {"turns": [], "note": NO_TEMPLATE}
    spec = rt.decoder.spec
    bounds = {"the model's context length": spec.max_position_embeddings,
              "index_topk, where the runtime's dense attention stops being exact": spec.dense_limit,
              "the cache sized for these turns": chat_room(tokenizer, users, reply_tokens)}
    why, room = min(((k, v) for k, v in bounds.items() if v), key=lambda kv: kv[1])
    show.step(console, f"multi-turn: {len(users)} user turns through the runtime, {reply_tokens}-token replies, "
                       "its cache kept across turns ...")
    cache, chat, stop = rt.new_cache(1, room), ChatTurns(tokenizer), tokenizer.eos_token_id
    out: list[dict] = []
    for user in users:
        ids = chat.ask(user)
        if ids is None:
            return {"turns": out, "note": chat.stopped}
        if int(cache.lengths[0]) + len(ids) + reply_tokens > room:
            return {"turns": out, "note": past_bound_note(len(out) + 1, room, why)}
        rows = [rt.decoder.forward(torch.tensor([ids]), cache)[0].float().cpu()]
        reply = [int(rows[0][-1].argmax())]
        while reply[-1] != stop and len(reply) < reply_tokens:
            rows.append(rt.decoder.forward(torch.tensor([reply[-1:]]), cache, last_only=True).float().cpu())
            reply.append(int(rows[-1][-1].argmax()))
        rt.decoder.forward(torch.tensor([reply[-1:]]), cache, last_only=True)  # the last token into the cache
        chat.answer(reply, reply[-1] == stop)
        out.append({"ids": ids, "reply": reply, "served": torch.cat(rows), "ended": "eos" if reply[-1] == stop
                    else "length"})
    return {"turns": out, "note": None}


@torch.no_grad()
def turns_compare(run: dict, forward: Forward, reply_tokens: int, console=None) -> dict:
    """The report's ``multi_turn`` section from :func:`turns_runtime`'s ``run``: the reference teacher-forced
    on the whole conversation in one pass (its float cache), and per turn the figures of
    :func:`compressor.service_eval.span_figures` over the appended prompt (its first position predicting the
    second) and over the reply (top-1: the reference's choice vs the token the runtime generated)."""
    seq: list[int] = []
    row_of: list[int] = []  # each position's row in the runtime's logits, -1: not compared (a turn's last token)
    n_rows = 0
    for t in run["turns"]:
        n = len(t["ids"]) + len(t["reply"])
        row_of += list(range(n_rows, n_rows + n - 1)) + [-1]
        seq += t["ids"] + t["reply"]
        n_rows += n - 1
    turns = {"measured_on": "runtime (weights + KV as served)", "reply_tokens": reply_tokens, "turns": [],
             "note": run["note"]}
    if not seq:
        return turns
    show.step(console, f"multi-turn: the reference over the {len(seq)}-token conversation ...")
    served = torch.cat([t["served"] for t in run["turns"]])
    kl, same = torch.zeros(n_rows, dtype=torch.float64), torch.zeros(n_rows, dtype=torch.bool)
    rows = torch.tensor(row_of)

    def consume(_k, at):
        for a, lg in chunked(at, 0, len(seq) - 1):
            r = rows[a:a + lg.shape[0]]
            m = r >= 0
            if m.any():
                kl[r[m]], same[r[m]] = kl_and_top1(lg[m], served[r[m]])

    forward([seq], consume)
    at, context = 0, 0
    for i, t in enumerate(run["turns"]):
        p, n = len(t["ids"]) - 1, len(t["ids"]) + len(t["reply"]) - 1
        turns["turns"].append({
            "turn": i + 1, "context_tokens": context,
            "prompt": span_figures(kl[at:at + p].tolist(), same[at:at + p].tolist()),
            "reply": span_figures(kl[at + p:at + n].tolist(), same[at + p:at + n].tolist()),
            "ended": t["ended"]})
        at, context = at + n, context + n + 1
    return turns


def whole_reference(ref_model, device: str) -> tuple[Forward, Callable]:
    """``(forward, greedy)`` of a reference loaded whole (transformers): one forward per
    sequence, and ``generate`` for its own greedy continuation."""
    @torch.no_grad()
    def forward(seqs, consume):
        ref_model.to(device)
        for k, seq in enumerate(seqs):
            logits = ref_model(torch.tensor([seq], device=device)).logits[0].float().cpu()
            consume(k, lambda a, b, lg=logits: lg[a:b])

    @torch.no_grad()
    def greedy(prompt, cont, _choices):
        x = torch.tensor([prompt], device=device)
        return ref_model.generate(x, max_new_tokens=len(cont), do_sample=False, num_beams=1,
                                  attention_mask=torch.ones_like(x), eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()

    return forward, greedy


def streamed_reference(lm, expert_group: int | None, progress: Callable | None = None) -> tuple[Forward, Callable]:
    """``(forward, greedy)`` of a reference read a decoder layer at a time
    (:func:`compressor.streamed_logits.streamed_logits`; ``lm``: its
    :class:`~compressor.streamed_eval.LazyModel`); greedy by :func:`greedy_by_passes`."""
    from ..streamed_logits import streamed_logits

    def forward(seqs, consume):
        streamed_logits(lm, seqs, consume, expert_group, on_progress=progress)

    return forward, lambda prompt, cont, choices: greedy_by_passes(forward, prompt, cont, choices)
