"""``kvq serve-smoke --long-tokens N`` (issue #47): a long greedy generation through the bundled
runtime as served (packed weights, the artifact's KV cache) against the reference model.

The runtime continues the first prompt greedily for ``N`` tokens; the reference (float weights,
float cache) is teacher-forced on prompt + continuation, and the runtime teacher-forced on the
same tokens one at a time through a fresh cache (its decode path, :meth:`Runtime.logits` with
``chunk=1``). Per generated position: top-1 agreement (the reference's choice vs the token the
runtime generated), KL(reference || runtime) in nats, both also per bucket of query positions
(:mod:`compressor.positions`); the first divergence; and the degeneration signal of
:func:`compressor.service_eval.repeated_4gram_pct` for the runtime's continuation and the
reference's own greedy one.
"""

from __future__ import annotations

import torch

from .. import console as show
from ..positions import sequence_buckets
from ..service_eval import repeated_4gram_pct
from ..stats import first_divergence, kl_and_top1, summarize


@torch.no_grad()
def long_generation(rt, ref_model, prompt: list[int], n_tokens: int, device: str, console=None) -> dict:
    """The report's ``long_generation`` section (module docstring).

    Args:
        rt: the :class:`compressor.runtime.generate.Runtime` as served; ``ref_model``: the
            reference transformers model; ``prompt``: token ids (the first prompt's).

    Raises:
        InputError: prompt + ``n_tokens`` longer than the runtime's context.
    """
    rt.check_length(len(prompt) + n_tokens)
    show.step(console, f"long generation: {n_tokens} greedy tokens through the runtime after a {len(prompt)}-token "
                       "prompt, against the reference ...")
    gen = rt.generate([prompt], max_new_tokens=n_tokens).tokens[0]
    seq = prompt + gen
    ref_model.to(device)
    x = torch.tensor([seq], device=device)
    first = len(prompt) - 1
    ref_logits = ref_model(x).logits[0, first:first + len(gen)].float().cpu()
    served = rt.logits([seq[:-1]], chunk=1)[0, first:].float().cpu()
    kl, _ = kl_and_top1(ref_logits, served)
    ref_next = ref_logits.argmax(-1).tolist()
    agree = [a == b for a, b in zip(ref_next, gen)]
    ref_gen = ref_model.generate(x[:, :len(prompt)], max_new_tokens=n_tokens, do_sample=False, num_beams=1,
                                 attention_mask=torch.ones_like(x[:, :len(prompt)]), eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    kls = kl.tolist()
    return {
        "measured_on": "runtime (weights + KV as served)", "prompt_tokens": len(prompt), "tokens": len(gen),
        "first_position": first, "top1_agreement_pct": round(100.0 * sum(agree) / max(1, len(agree)), 4),
        "first_divergence": first_divergence(ref_next, gen), "kl": summarize(kls),
        "by_position": sequence_buckets(kls, agree, first), "kl_per_token": [float(f"{v:.4g}") for v in kls],
        "disagreements": [i for i, s in enumerate(agree) if not s],
        "repeated_4gram_pct": {"reference": repeated_4gram_pct(ref_gen), "runtime": repeated_4gram_pct(gen)},
        "runtime_vs_reference_first_difference": first_divergence(ref_gen, gen),
    }
