"""``kvq verify``'s service figures (issue #47): the window figures by position, a long
greedy generation and a multi-turn chat with the quantized KV cache against the float one.

Hooks of :mod:`compressor.commands.verify`: :func:`check_gate` while planning,
:func:`sections` after the window statistics. The long generation and the chat run the
``KV only`` configuration (the model the report's ``evaluated_in.rows`` names for it),
so they measure the cache alone; without a KV scheme they do not run.
"""

from __future__ import annotations

from .. import console as show
from ..errors import InputError
from ..positions import window_buckets
from ..service_eval import LONG_PROMPT_TOKENS, REPLY_TOKENS, long_generation, multi_turn, user_turns
from .options import VerifyOptions

GATE = "min_long_agreement_pct"


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
