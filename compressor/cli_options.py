"""Pieces of the ``kvq`` command line's declarations that are not commands: choices read from the
registries, option ranges read from the options objects, the signature options several commands
share, and the one place an :class:`~compressor.commands.options.OptionError` becomes a usage error.

The lists of algorithms, formats and KV schemes are never written here: :class:`RegistryChoice`
asks the registry (:mod:`compressor.registry`, :mod:`compressor.kv_schemes`) when click needs
them (``--help``, or a value to check), so a newly registered one is a choice at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import click

from .cli_help import HELP
from .commands.options import OptionError, bounds
from .errors import InputError


class RegistryChoice(click.Choice):
    """A :class:`click.Choice` whose choices are ``names()``, asked for each time click needs them
    (the registries import torch; ``kvq --help`` and ``kvq verify --hashes-only`` never do). The
    import runs with SIGINT/SIGTERM held, as :func:`compressor.cli._quiet_libraries`' does."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names = names
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        from . import interrupts

        with interrupts.deferred():
            return tuple(self._names())

    @choices.setter
    def choices(self, _value) -> None:  # click.Choice.__init__ assigns its (empty) argument
        pass


def algorithm_names() -> list[str]:
    """The registered algorithms (``--algorithm``'s choices)."""
    from .registry import ALGORITHMS

    return ALGORITHMS.names()


def format_names() -> list[str]:
    """The registered on-disk formats, the default first (``--format``'s choices)."""
    from .registry import FORMATS

    return [f.name for f in FORMATS.entries()]


def kv_scheme_names() -> tuple[str, ...]:
    """The registered KV-cache schemes (``--kv-scheme``'s choices)."""
    from .kv_schemes import scheme_names

    return scheme_names()


def bounded(options, flat: str, kind=int):
    """The click type of option ``flat`` of ``options``: its range as the options object
    declares it (shown in ``--help`` and checked while parsing), else plain ``kind``."""
    b = bounds(options, flat)
    if b["min"] is None and b["max"] is None:
        return kind
    return (click.IntRange if kind is int else click.FloatRange)(**b)


#: options whose flag is not ``--`` + the option's name with dashes
_FLAGS = {"digest_algorithm": "--digest", "shard_bytes": "--shard-size", "eval_text": "--eval"}


def build_options(cls, **flat):
    """``cls(**flat)``; an :class:`OptionError` becomes click's usage error, named by flag.

    Raises:
        click.BadParameter: the options object refused a value or a combination.
    """
    try:
        return cls(**flat)
    except OptionError as e:
        hint = e.hint
        if hint is None and e.option is not None:
            hint = f"'{_FLAGS.get(e.option, '--' + e.option.replace('_', '-'))}'"
        raise click.BadParameter(e.reason, param_hint=hint) from None


def parse_settings(items: Iterable[str]) -> tuple[tuple[str, object], ...]:
    """``--set KEY=VALUE`` items as ``(key, value)`` pairs, each value read as YAML (``8``,
    ``true``, ``null``, ``[a, b]``); whether the key is a recipe field is the recipe's to say
    (:func:`compressor.recipe.apply_settings`, with its "did you mean").

    Raises:
        click.BadParameter: an item without ``=`` or a key, or a value that is not YAML.
    """
    import yaml

    parsed = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--set")
        try:
            parsed.append((key.strip(), yaml.safe_load(value)))
        except yaml.YAMLError:
            raise click.BadParameter(f"cannot parse the value of {item!r}", param_hint="--set") from None
    return tuple(parsed)


#: a file option (not a folder) passed on as a Path
FILE = click.Path(dir_okay=False, path_type=Path)
_SIGNATURE_OPTIONS = (
    click.option("--public-key", type=FILE, default=None, help=HELP["signature.public-key"]),
    click.option("--certificate-chain", type=FILE, multiple=True, help=HELP["signature.certificate-chain"]),
    click.option("--identity", default=None, help=HELP["signature.identity"]),
    click.option("--issuer", default=None, help=HELP["signature.issuer"]),
)


def signature_options(f):
    """--public-key / --certificate-chain / --identity + --issuer (verify, serve-smoke, serve):
    the command receives ``public_key``, ``certificate_chain``, ``identity``, ``issuer``."""
    for option in reversed(_SIGNATURE_OPTIONS):
        f = option(f)
    return f


def verify_keys(public_key, certificate_chain, identity, issuer):
    """The :class:`~compressor.signing.VerifyKeys` of :func:`signature_options`' values."""
    from .signing import VerifyKeys

    return VerifyKeys(public_key=public_key, certificate_chain=tuple(certificate_chain), identity=identity,
                      issuer=issuer)


def resolve_device(name: str) -> str:
    """``--device``'s value as a torch device name: ``auto`` is ``cuda`` where one is available, else ``cpu``.

    Raises:
        InputError: ``cuda`` asked for where no CUDA device is available.
    """
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda given but no CUDA device is available; use --device cpu")
    return name
