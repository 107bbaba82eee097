"""``kvq serve-smoke --long-tokens N`` (issue #47): a long greedy generation through the bundled
runtime as served (packed weights, the artifact's KV cache) against the reference model.

The runtime continues the first prompt greedily for ``N`` tokens and is teacher-forced on the
same tokens one at a time through a fresh cache (its decode path, :meth:`Runtime.logits` with
``chunk=1``): :func:`long_runtime`, before the runtime is released. The reference (float
weights, float cache; whole, or a decoder layer at a time) is then teacher-forced on prompt +
continuation: :func:`long_compare`. Per generated position: top-1 agreement (the reference's
choice vs the token the runtime generated), KL(reference || runtime) in nats, both also per
bucket of query positions (:mod:`compressor.positions`); the first divergence; and the
degeneration signal of :func:`compressor.service_eval.repeated_4gram_pct` for the runtime's
continuation and the reference's own greedy one (:func:`greedy_by_passes` when streamed).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import console as show
from ..evaluate import LOGIT_CHUNK
from ..positions import sequence_buckets
from ..service_eval import repeated_4gram_pct
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
