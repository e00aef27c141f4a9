"""A named registry (Tunix-style), so configs can swap estimators, losses and aggregations by name."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """`register(*names)` is a decorator; `get(name)` fails with the list of registered names."""

    def __init__(self, kind: str):
        self.kind = kind
        self.table: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                if name in self.table:
                    raise ValueError(f"{self.kind} {name!r} is already registered.")
                self.table[name] = fn
            return fn
        return deco

    def get(self, name: str) -> F:
        try:
            return self.table[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self.table)}") from None
