"""Registries of component kinds: each kind of a component (a norm, a position encoding, an
MLP, an attention mixer, a head, an MoE router) is registered once, in the module that
implements it, with everything the rest of the library asks of it — its tensor descriptions,
its function, its cost and memory terms and its config checks. The config's choices for a
component are its registry's names, and asking for a kind that is not registered is a
`ConfigError` that lists the registered ones: nothing falls back to a default kind.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from llama_jax.errors import ConfigError

Kind = TypeVar("Kind")


class Registry(Generic[Kind]):
    """The registered kinds of one component, by name, in registration order."""

    def __init__(self, component: str):
        self.component = component  # the config field that chooses a kind
        self._kinds: dict[str, Kind] = {}

    def register(self, name: str, kind: Kind) -> Kind:
        if name in self._kinds:
            raise ValueError(f"{self.component} kind {name!r} is registered twice")
        self._kinds[name] = kind
        return kind

    def names(self) -> tuple[str, ...]:
        return tuple(self._kinds)

    def __getitem__(self, name: str) -> Kind:
        if name not in self._kinds:
            raise ConfigError(f"{self.component}={name!r} is not one of {self.names()}")
        return self._kinds[name]

    def __contains__(self, name: object) -> bool:
        return name in self._kinds

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)
