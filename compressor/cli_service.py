"""``kvq verify``'s options of the service checks (issue #47): the long generation, the
multi-turn chat and the long generation's gate, as one click decorator (:func:`service_options`);
help texts in :mod:`compressor.cli_help`, ranges from :class:`~compressor.commands.options.VerifyOptions`."""

from __future__ import annotations

import functools

import click

from .cli_help import HELP
from .cli_options import bounded
from .commands.options import SmokeOptions, VerifyOptions


def smoke_long_option(f):
    """Add serve-smoke's ``--long-tokens`` and ``--turns`` to a click command."""
    f = click.option("--turns", type=bounded(SmokeOptions, "turns"), default=0, show_default=True,
                     help=HELP["serve-smoke.turns"])(f)
    return click.option("--long-tokens", type=bounded(SmokeOptions, "long_tokens"), default=0, show_default=True,
                        help=HELP["serve-smoke.long-tokens"])(f)


def smoke_memory_options(f):
    """Add serve-smoke's ``--stream`` and ``--memory-budget-gib`` to a click command."""
    f = click.option("--memory-budget-gib", type=bounded(SmokeOptions, "memory_budget_gib", float), default=None,
                     help=HELP["serve-smoke.memory-budget-gib"])(f)
    return click.option("--stream", is_flag=True, help=HELP["serve-smoke.stream"])(f)


def service_options(f):
    """Add ``--long-tokens``, ``--turns`` and ``--min-long-agreement`` to a click command, which receives
    them as one ``service`` dict of :class:`~compressor.commands.options.VerifyOptions` keywords."""
    @functools.wraps(f)
    def command(*args, long_tokens, turns, min_long_agreement, **kw):
        return f(*args, service={"long_tokens": long_tokens, "turns": turns, "min_long_agreement": min_long_agreement},
                 **kw)

    for decorate in reversed((
        click.option("--long-tokens", type=bounded(VerifyOptions, "long_tokens"), default=256, show_default=True,
                     help=HELP["verify.long-tokens"]),
        click.option("--turns", type=bounded(VerifyOptions, "turns"), default=4, show_default=True,
                     help=HELP["verify.turns"]),
        click.option("--min-long-agreement", type=bounded(VerifyOptions, "min_long_agreement", float), default=None,
                     help=HELP["verify.min-long-agreement"]),
    )):
        command = decorate(command)
    return command
