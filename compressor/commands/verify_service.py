"""``kvq verify``'s service figures (issue #47): the window figures by position, a long
greedy generation and a multi-turn chat with the quantized KV cache against the float one,
and the cost of an fp8 cache run at unit scales.

Hooks of :mod:`compressor.commands.verify`: :func:`check_gate` while planning,
:func:`add_unit_scale_row` with the compared configurations, :func:`unit_scale_section`
and :func:`sections` after the window statistics. The long generation and the chat run the
``KV only`` configuration (the model the report's ``evaluated_in.rows`` names for it),
so they measure the cache alone; without a KV scheme they do not run.
"""

from __future__ import annotations

import torch

from .. import console as show
from ..errors import InputError
from ..positions import window_buckets
from ..service_eval import LONG_PROMPT_TOKENS, REPLY_TOKENS, long_generation, multi_turn, user_turns
from .options import VerifyOptions

GATE = "min_long_agreement_pct"

#: the extra configuration :func:`compressor.evaluate.compare` runs for a static fp8 scheme: the
#: ``KV only`` row's model and cache with every ``k_scale``/``v_scale`` at 1.0
UNIT_ROW = "KV only, unit scales"

#: what vLLM and SGLang do with an MLA latent cache's scale from a compressed-tensors checkpoint (docs/kv-cache.md)
MLA_ENGINES = ("vLLM and SGLang load no KV scale for an MLA latent cache from a compressed-tensors checkpoint "
               "(docs/kv-cache.md, 'What the engines read'): with --kv-cache-dtype fp8 they run it at unit scales")


def check_gate(thresholds: dict, opts: VerifyOptions, kv_info, report: dict) -> None:
    """Drop or refuse ``min_long_agreement_pct`` when no long generation will run (no KV
    scheme, or ``--long-tokens 0``): a flag is refused, a recipe's gate becomes a warning.

    Raises:
        InputError: ``--min-long-agreement`` given where its statistic is not computed.
    """
    if GATE not in thresholds or (kv_info is not None and opts.evaluation.long_tokens > 0):
        return
    why = "--long-tokens is 0" if kv_info is not None else "the artifact has no KV scheme (pass --kv-scheme)"
    if opts.gates.min_long_agreement is not None:
        raise InputError(f"--min-long-agreement cannot be evaluated: {why}")
    report["warnings"].append(f"recipe gate {GATE} not evaluated: {why}")
    del thresholds[GATE]


def sections(report: dict, results: dict, served: str, candidates: dict, tokenizer, wins, text, opts: VerifyOptions,
             console) -> None:
    """The report's ``by_position``, ``long_generation`` and ``multi_turn`` sections."""
    ev = opts.evaluation
    report["by_position"] = window_buckets(results, served)
    if "KV only" not in candidates:
        if ev.long_tokens or ev.turns:
            show.note(console, "long generation and multi-turn: no KV scheme to measure (pass --kv-scheme)")
        return
    model, make_cache = candidates["KV only"]
    if ev.long_tokens:
        prompt = wins[0, :LONG_PROMPT_TOKENS].to(opts.device)
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos and prompt.numel() + ev.long_tokens > max_pos:
            report["warnings"].append(f"--long-tokens {ev.long_tokens} after a {prompt.numel()}-token prompt exceeds "
                                      f"the model's max_position_embeddings {max_pos}")
        show.step(console, f"long generation: {ev.long_tokens} greedy tokens after {prompt.numel()} of the eval text, "
                           "float cache vs quantized cache ...")
        report["long_generation"] = {"measured_on": "KV only",
                                     **long_generation(model, make_cache, prompt, ev.long_tokens, opts.kv.chunk)}
    if ev.turns:
        users = user_turns(text.text, ev.turns)
        show.step(console, f"multi-turn: {len(users)} user turns, {REPLY_TOKENS}-token replies, caches kept across "
                           "turns ...")
        chat = multi_turn(model, make_cache, tokenizer, users, REPLY_TOKENS, opts.kv.chunk)
        if len(users) < ev.turns and chat["note"] is None:
            chat["note"] = f"the evaluation text has {len(users)} paragraphs for user turns, not {ev.turns}"
        if chat["note"]:
            show.note(console, f"[yellow]multi-turn:[/] {chat['note']}")
            report["warnings"].append(f"multi-turn: {chat['note']}")
        report["multi_turn"] = {"measured_on": "KV only", "reply_tokens": REPLY_TOKENS, **chat}


def add_unit_scale_row(candidates: dict, kv_info, seqlen: int, basis, report: dict) -> None:
    """Add :data:`UNIT_ROW` to ``candidates`` for a static fp8 scheme with a ``KV only`` row: that
    row's model and cache with ``k_scale = v_scale = 1.0`` (``[1]`` or ``[kv_heads]`` ones) in every
    layer -- what vLLM and SGLang run when a checkpoint's scales are missing or not read
    (docs/kv-cache.md). ``basis``: the key basis the ``KV only`` cache applies (a key-pairs
    artifact's factors on the reference model), ``None`` for none. It costs one more forward per
    evaluation window; the long generation and the chat do not run it."""
    from .verify_common import cache_factory

    if "KV only" not in candidates or kv_info is None or kv_info[0].scheme != "fp8" or not kv_info[1]:
        return
    model = candidates["KV only"][0]
    ones = {i: (torch.ones_like(k), torch.ones_like(v)) for i, (k, v) in kv_info[1].items()}
    make = cache_factory(model, (kv_info[0], ones), seqlen, report)
    candidates[UNIT_ROW] = (model, make if basis is None else (lambda: make(basis)))


def unit_scale_section(results: dict, kv_info, attention: str, report: dict) -> dict | None:
    """Take :data:`UNIT_ROW` out of ``results`` (:func:`compressor.evaluate.compare`'s, so no other
    section lists it) and return the report's ``kv_cache.unit_scale``, or ``None`` without the row.

    ``calibrated`` and ``unit``: perplexity (and its increase over the reference, percent), KL
    mean and p99 (nats) and top-1 agreement (percent) of the ``KV only`` row with the artifact's
    scales and at unit scales, on the same windows; ``by_position``: both per bucket of query
    positions; ``scales``: the range of the calibrated ``k_scale``/``v_scale``; ``scales_all_unit``:
    they are all exactly 1.0 (a unit-scale artifact, also said in a warning); ``engines``: on an
    MLA cache (``attention`` ``mla``), what vLLM and SGLang do with its scale.
    """
    unit = results.pop(UNIT_ROW, None)
    if unit is None:
        return None
    ref, cal = results["reference"], results["KV only"]

    def figures(r: dict) -> dict:
        return {"ppl": round(r["ppl"], 4), "increase_pct": round((r["ppl"] / ref["ppl"] - 1.0) * 100.0, 4),
                "kl_mean": r["kl"]["mean"], "kl_p99": r["kl"]["p99"], "top1_pct": round(100.0 * r["top1_agreement"], 4)}

    k = torch.cat([k.flatten() for k, _ in kv_info[1].values()])
    v = torch.cat([v.flatten() for _, v in kv_info[1].values()])
    all_unit = bool((k == 1).all() and (v == 1).all())
    if all_unit:
        report["warnings"].append("every fp8 KV scale is 1.0: a unit-scale artifact (its figures are what an engine "
                                  "without scales runs; calibrated scales are absmax / 448)")
    buckets = window_buckets({"reference": ref, "calibrated": cal, "unit": unit}, "calibrated")["buckets"]
    by = [{"bucket": b["bucket"], "tokens": b["tokens"], "calibrated": c["calibrated"], "unit": c["unit"]}
          for b in buckets for c in [b["configurations"]]]
    scales = {"k_min": float(k.min()), "k_max": float(k.max()), "v_min": float(v.min()), "v_max": float(v.max())}
    return {"row": "KV only", "scales": scales, "scales_all_unit": all_unit, "calibrated": figures(cal),
            "unit": figures(unit), "by_position": by,
            "engines": MLA_ENGINES if attention == "mla" else None}
