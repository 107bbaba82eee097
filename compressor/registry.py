"""Named registries: the one home of every algorithm and on-disk format name.

A :class:`Registry` maps a name (a recipe's ``algorithm``, a ``--format`` value) to the object
registered under it. Entries register themselves when their module is imported (a class
decorator in :mod:`compressor.quant.algorithms`, a subclass of
:class:`compressor.formats.base.WeightFormat`); the first lookup imports every module of the
registry's home package (:func:`pkgutil.iter_modules`), so a new algorithm or format is one new
file in that package and nothing else: the command line's choices (:mod:`compressor.cli`) and the
recipe's validation (:mod:`compressor.recipe`) read the names here.

This module sits at the bottom of the import layers (docs/architecture.md) and imports nothing of
kvq's but :mod:`compressor.errors`; the home packages are named as strings and imported on
first use, never at module level.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Generic, TypeVar

from .errors import InputError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry, filled by the modules of ``home`` (a package name) on first lookup.

    Args:
        kind: what an entry is, for messages (``algorithm``, ``format``).
        home: the package whose modules hold the built-in entries (``compressor.quant``).
    """

    def __init__(self, kind: str, home: str):
        self.kind, self.home = kind, home
        self._entries: dict[str, T] = {}
        self._discovered = False

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``.

        Raises:
            ValueError: ``name`` is empty or already registered (a programming error).
        """
        if not name or name in self._entries:
            raise ValueError(f"{self.kind} {name!r}: the name is empty or already registered")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's entry once the test is done); unknown names are ignored."""
        self._entries.pop(name, None)

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        package = importlib.import_module(self.home)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.home}.{info.name}")

    def find(self, name: str | None) -> T | None:
        """The entry of ``name``, or ``None`` (e.g. ``"unknown"`` in a foreign artifact)."""
        self._discover()
        return self._entries.get(name) if name is not None else None

    def get(self, name: str) -> T:
        """The entry of ``name``.

        Raises:
            InputError: no entry of that name (the message lists the registered ones).
        """
        entry = self.find(name)
        if entry is None:
            raise InputError(f"unknown {self.kind} {name!r} (choose from {', '.join(self.names())})")
        return entry

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._discover()
        return sorted(self._entries)

    def entries(self) -> list[T]:
        """The registered entries, in registration order."""
        self._discover()
        return list(self._entries.values())


#: recipe ``algorithm`` values -> :class:`compressor.quant.algorithms.Algorithm` instances
ALGORITHMS: Registry = Registry("algorithm", "compressor.quant")
#: ``--format`` values -> :class:`compressor.formats.base.WeightFormat` instances
FORMATS: Registry = Registry("format", "compressor.formats")
