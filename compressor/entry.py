"""The ``kvq`` console entry point: kvq's SIGINT/SIGTERM handler is in place before the CLI is imported.

Importing :mod:`compressor.cli` (click, rich, pydantic) takes about half a second; a Ctrl-C
in that window used to reach Python's default handler and print a traceback. Here the
handler (:mod:`compressor.interrupts`, standard library only) is installed first, so a
signal during the import ends in the same one line and exit code (130 for SIGINT, 143 for
SIGTERM) as one during the command.
"""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    """Install the signal handlers, import the CLI, run it (:func:`compressor.cli.main`).

    Exits 130 (SIGINT) or 143 (SIGTERM) with one line on stderr when a signal arrives while
    the CLI is being imported; otherwise the CLI's own exit codes."""
    from . import interrupts

    previous = interrupts.install()
    try:
        try:
            from .cli import main as cli_main
        except KeyboardInterrupt:
            interrupts.exit_interrupted(argv if argv is not None else sys.argv[1:])
        cli_main(argv)
    finally:
        interrupts.restore(previous)
