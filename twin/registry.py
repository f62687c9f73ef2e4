"""One registry per family of pluggable parts (routers, admission policies, workloads, ...).

Each implementation registers itself with one decorator, under a snake_case key. Unknown and duplicate
keys raise with a did-you-mean. Pure Python: imported by ``twin.policies``, so it must stay light.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate registry key."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A named mapping from snake_case keys to implementations of one family."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._items: dict[str, T] = {}

    def register(self, key: str) -> Callable[[T], T]:
        """Decorator: ``@ROUTERS.register("round_robin")``."""

        def deco(obj: T) -> T:
            if key in self._items:
                raise RegistryError(f"{self.family}: key {key!r} is registered twice")
            if not key or key != key.lower() or " " in key:
                raise RegistryError(f"{self.family}: key {key!r} must be snake_case")
            self._items[key] = obj
            return obj

        return deco

    def get(self, key: str) -> T:
        try:
            return self._items[key]
        except KeyError:
            raise RegistryError(self.unknown_message(key)) from None

    def unknown_message(self, key: str) -> str:
        close = difflib.get_close_matches(key, list(self._items), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(self._items)) or "(none)"
        return f"unknown {self.family} {key!r}{hint} (known: {known})"

    def keys(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._items)
