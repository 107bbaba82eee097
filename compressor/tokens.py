"""Text to token ids by the tokenizer's own rule, in every place kvq turns text into ids.

A tokenizer either puts a BOS token in front of every text it encodes with special tokens
(Llama 3, Gemma, Mistral, DeepSeek-V3 and Kimi: ``add_bos_token`` or a post-processor) or
adds none (SmolLM2, Qwen). A model whose tokenizer adds one never sees text without it in
service, and its first positions behave very differently without it (an attention sink
that is missing). So calibration windows, evaluation windows, verify's greedy-drift
prompts, the bundled runtime's prompts (HTTP completions and the plain-text chat fallback)
all start with that BOS when, and only when, the tokenizer adds one.

The rule is read from the tokenizer itself (:func:`bos_token_id`), not from a list of
families, and recorded as :func:`bos_rule` in the manifest's calibration provenance and in
the verify and serve-smoke reports.
"""

from __future__ import annotations

from .errors import InputError

#: the probe text :func:`bos_token_id` encodes with and without special tokens
_PROBE = "Hello world"


def bos_token_id(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of a text, or ``None`` when it adds none.

    A probe text encoded with special tokens is compared with the same text encoded
    without them: when the former is the tokenizer's ``bos_token_id`` followed by the
    latter, the tokenizer adds a BOS (whatever the mechanism: ``add_bos_token``, a
    ``TemplateProcessing`` post-processor, a slow tokenizer's ``build_inputs_with_special_tokens``).
    A tokenizer that appends an EOS too is still a BOS-adding one; the EOS is not kept.

    Args:
        tokenizer: a transformers tokenizer (``bos_token_id`` attribute, callable on text).

    Returns:
        the BOS id (``int``) or ``None``.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        with_special = list(tokenizer(_PROBE, add_special_tokens=True)["input_ids"])
        without = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: treat the text as it is
        return None
    if len(with_special) > len(without) and with_special[0] == bos and with_special[1:1 + len(without)] == without:
        return int(bos)
    return None


def bos_rule(tokenizer) -> dict:
    """The tokenizer's BOS rule as recorded in manifests and reports.

    Returns:
        ``{"bos_token_id": int | None, "rule": str}``: the id every encoded text starts with
        (``None``: the tokenizer adds none), and one sentence saying so.
    """
    bos = bos_token_id(tokenizer)
    if bos is None:
        return {"bos_token_id": None, "rule": "the tokenizer adds no BOS: ids are the text's tokens only"}
    tok = getattr(tokenizer, "bos_token", None)
    return {"bos_token_id": bos,
            "rule": f"the tokenizer adds a BOS ({tok!s}, id {bos}): every sequence starts with it, as in service"}


def encode(tokenizer, text: str, bos: int | None | bool = True) -> list[int]:
    """Token ids of ``text`` as the tokenizer encodes it for the model, BOS by its rule.

    Args:
        tokenizer: a transformers tokenizer.
        text: any string (may be empty).
        bos: ``True`` (default): read the rule with :func:`bos_token_id`; an ``int`` or
            ``None``: that rule, already read (saves a probe per call).

    Returns:
        ``list[int]``: the BOS (if the tokenizer adds one) then the text's tokens, never an
        empty list: an empty text is the BOS alone, or the tokenizer's ``bos_token_id``
        when it has one but does not add it.

    Raises:
        InputError: the text is empty after tokenization and the tokenizer has no BOS at all.
    """
    rule = bos_token_id(tokenizer) if bos is True else bos
    ids = list(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    if rule is not None:
        return [int(rule)] + ids
    if not ids:
        fallback = getattr(tokenizer, "bos_token_id", None)
        if fallback is None:
            raise InputError("the prompt is empty after tokenization")
        return [int(fallback)]
    return ids


def check_vocabulary(tokenizer, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer that can produce an id the model has no embedding row for: every id
    of its vocabulary (added and special tokens included) must be below ``vocab_size`` (the
    embedding's rows, ``config.json`` ``vocab_size``). Such an id would fail inside the
    model's embedding at the first text that contains the token, long after the check.

    Args:
        tokenizer: a transformers tokenizer (``get_vocab``).
        vocab_size: the embedding's rows.
        where: names the tokenizer (its folder) in the message.

    Raises:
        InputError: naming the first such token and its id.
    """
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return
    beyond = sorted((i, t) for t, i in vocab.items() if isinstance(i, int) and not 0 <= i < vocab_size)
    if beyond:
        i, t = beyond[0]
        raise InputError(f"{where}: the tokenizer's token {t!r} has id {i}, beyond the model's embedding of "
                         f"{vocab_size} rows (config.json vocab_size; {len(beyond)} such token(s)): no text containing "
                         "it could be run; remove the token from the tokenizer or give the embedding its rows")
