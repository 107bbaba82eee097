""""Did you mean": the closest known names to a name kvq does not know, for one-line refusals
(an unknown recipe name, an unknown ``--set`` key). Standard library only (:mod:`difflib`)."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'a' or 'b'?"`` naming the ``n`` (at most) ``choices`` closest to ``word``
    (:func:`difflib.get_close_matches`, similarity ratio 0.6 or more, closest first), else ``""``;
    appended to a refusal's line."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    if not close:
        return ""
    named = [f"'{c}'" for c in close]
    return "; did you mean " + ", ".join(named[:-1]) + (" or " if len(named) > 1 else "") + named[-1] + "?"


def dotted_keys(mapping: dict, prefix: str = "") -> list[str]:
    """Every key of a nested mapping as a dotted path (``weights``, ``weights.num_bits``, ...),
    sections before their fields."""
    out = []
    for key, value in mapping.items():
        out.append(prefix + str(key))
        if isinstance(value, dict):
            out += dotted_keys(value, f"{prefix}{key}.")
    return out
