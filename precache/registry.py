"""Names a user picks from: sharing methods, attention backends, model families, benchmarks.

Each kind is one :class:`Registry`, kept next to what it names (``precache.methods.METHOD_REGISTRY``,
``precache.cache.attention.BACKENDS``, ``precache.models.MODEL_REGISTRY``,
``precache.agents.benchmark.BENCHMARKS``). Every name a user gives goes through one, so a name is
normalised in one place (:func:`normalise`), the command line's choices are a registry's
``names`` or ``choices``, and an unknown name raises the kind's own error listing the valid
names, before any model loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def normalise(name: str) -> str:
    """The key a name is registered and looked up under: case, ``_`` against ``-`` and surrounding
    blanks do not matter (``"ReBaseShared_LP"`` -> ``"rebaseshared-lp"``)."""
    return name.strip().lower().replace("_", "-")


class Registry(Generic[T]):
    """Entries of one kind by name, in the order they were registered.

    ``kind`` names one entry in messages (``"sharing method"``), ``noun`` its short form
    (``"method"``, default ``kind``); an unknown name raises ``error`` with
    ``unknown sharing method 'x' (methods: a, b)``, several at once
    ``unknown method(s) x, y (methods: a, b)``. An alias is another spelling of a name
    (``rebaseshared`` for ``rebaseshared-lp``): looked up like the name, listed only in
    :attr:`choices`.
    """

    def __init__(self, kind: str, error: type[Exception] = ValueError, noun: str | None = None):
        self.kind, self.error, self.noun = kind, error, noun or kind
        self._entries: dict[str, tuple[str, T]] = {}  # normalised name -> (name as registered, entry)
        self._aliases: dict[str, str] = {}  # normalised alias -> normalised name

    def register(self, name: str, entry: T, aliases: Iterable[str] = ()) -> T:
        """Add ``entry`` under ``name`` (and ``aliases``), replacing one of the same name. Returns
        ``entry``, so that a class decorator can end with ``return registry.register(cls.name, cls)``."""
        key = normalise(name)
        self._entries[key] = (name, entry)
        for alias in aliases:
            self._aliases[normalise(alias)] = key
        return entry

    def __setitem__(self, name: str, entry: T) -> None:
        self.register(name, entry)

    def _known(self, name: str) -> str | None:
        key = normalise(name)
        key = self._aliases.get(key, key)
        return key if key in self._entries else None

    def _key(self, name: str) -> str:
        key = self._known(name)
        if key is None:
            raise self.error(f"unknown {self.kind} '{name}' ({self.noun}s: {', '.join(self.names)})")
        return key

    def canonical(self, name: str) -> str:
        """``name`` as registered (``"ReBaseShared"`` -> ``"rebaseshared-lp"``).

        Raises:
            error: no entry has that name; the message lists the names.
        """
        return self._entries[self._key(name)][0]

    def canonical_many(self, names: Iterable[str]) -> list[str]:
        """Each of ``names`` as registered, in order.

        Raises:
            error: some are unknown; the message names all of them and lists the valid names.
        """
        names = list(names)
        unknown = [n for n in names if self._known(n) is None]
        if unknown:
            raise self.error(
                f"unknown {self.noun}(s) {', '.join(unknown)} ({self.noun}s: {', '.join(self.names)})"
            )
        return [self.canonical(n) for n in names]

    def __getitem__(self, name: str) -> T:
        """The entry called ``name`` (any spelling :func:`normalise` maps to it, or an alias).

        Raises:
            error: unknown name (see :meth:`canonical`).
        """
        return self._entries[self._key(name)][1]

    def get(self, name: str, default: T | None = None) -> T | None:
        """The entry called ``name``, or ``default``."""
        key = self._known(name)
        return default if key is None else self._entries[key][1]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._known(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name as registered, in registration order."""
        return tuple(name for name, _ in self._entries.values())

    @property
    def choices(self) -> tuple[str, ...]:
        """:attr:`names` then the aliases: what an ``argparse`` ``choices=`` takes."""
        return (*self.names, *(a for a in self._aliases if a not in self._entries))

    def values(self) -> list[T]:
        """Every entry, in registration order."""
        return [entry for _, entry in self._entries.values()]

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs, in registration order."""
        return list(self._entries.values())
