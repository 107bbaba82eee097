""""Did you mean": the closest known names to a name kvq does not know, for one-line refusals
(an unknown recipe name, an unknown ``--set`` key), and the one line naming a recipe's first
invalid key (:func:`format_validation`). Standard library only (:mod:`difflib`)."""

from __future__ import annotations

import difflib
import re
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


#: the names pydantic gives the members of a union field in an error's location (``int``,
#: ``literal['auto']``, ``function-after[...]``): not keys of the recipe
_UNION_TAGS = {"int", "float", "str", "bool", "none"}


def _recipe_loc(loc) -> str:
    keys = [str(x) for x in loc if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x))]
    return ".".join(keys)


def format_validation(errors: list[dict], where: str) -> str:
    """One line for a recipe's first invalid key: ``WHERE: KEY: what it should be`` (a union's
    members' messages joined: ``Input should be a valid integer or 'auto'``). ``errors``: pydantic's
    ``ValidationError.errors()``."""
    first = errors[0]
    loc = _recipe_loc(first["loc"])  # "" for a rule across keys (a model validator): the message names them
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    same = [e["msg"] for e in errors if _recipe_loc(e["loc"]) == loc]
    if len(same) > 1 and all(m.startswith("Input should be ") for m in same):
        kinds = dict.fromkeys(m.removeprefix("Input should be ").split(", ")[0] for m in same)
        msg = "Input should be " + " or ".join(kinds)
    msg = re.sub(r" or instance of \w+", "", msg.removeprefix("Value error, "))  # no pydantic class names
    return f"{where}: {loc}: {msg}" if loc else f"{where}: {msg}"
