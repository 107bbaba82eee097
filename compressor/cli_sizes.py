"""Byte sizes given on the command line (``--shard-size 5GB``), parsed for click."""

from __future__ import annotations

import re

import click

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: str, param) -> int:
    """``5GB`` / ``500MB`` / ``2GiB`` / ``123456`` -> bytes (at least 1 MB: smaller shards are for tests)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise click.BadParameter(f"{value!r} is not a size like 500MB, 5GB or 2GiB", param=param)
    n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n < 10**6:
        raise click.BadParameter(f"{value!r} is below the 1 MB minimum", param=param)
    return n
