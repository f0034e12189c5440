"""A name -> entry table for each plug-in point: policy losses, soft gates, rewards, rollout engines.

Ours. Every plug-in point keeps one :class:`Registry`, and its public functions
(``register_reward``, ``get_policy_loss``, ...) are its methods or thin names over them, so the
rules (a name is taken once; removing or looking up an unknown name fails, listing what is
registered) and the messages are the same everywhere. A plug-in point of builders (rewards,
rollout engines) is a :class:`BuilderRegistry`, whose ``build`` calls the chosen builder and whose
entries may declare an options dataclass (the schema of their section's ``options``). The messages
name the caller's argument (``key``), so the config layer's ``at_key`` turns them into YAML keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import is_dataclass
from typing import Any, Generic, TypeVar

__all__ = ["PLUGINS_HINT", "BuilderRegistry", "Registry"]

T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")

PLUGINS_HINT = " (a module that registers one is loaded with the config key plugins)"
"""The unknown-name hint of the plug-in points a user module can extend."""


class Registry(Generic[T]):
    """Entries of one kind by name.

    Args:
        kind: what an entry is, for messages (``"reward"``, ``"rollout engine"``).
        key: the argument that names an entry where it is chosen (``"name"``, ``"backend"``).
        hint: appended to the unknown-name message (e.g. how a user's module gets loaded).
    """

    def __init__(self, kind: str, *, key: str = "name", hint: str = "") -> None:  # noqa: D107 - on the class
        self.kind, self.key, self.hint = kind, key, hint
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Registers ``entry`` as ``name``; returns it.

        Raises:
            ValueError: the name is taken.
        """
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Removes and returns the entry of ``name`` (tests and plug-ins that register temporarily).

        Raises:
            ValueError: unknown name.
        """
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            ValueError: naming ``key``: unknown name; the message lists the registered names.
        """
        if name not in self._entries:
            raise ValueError(f"{self.key}={name!r} is not a registered {self.kind}; registered: "
                             f"{self.names()}{self.hint}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Sorted names of the registered entries."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs in name order."""
        return sorted(self._entries.items())


class BuilderRegistry(Registry[Callable[[A], R]]):
    """A :class:`Registry` of builders ``build(arg) -> R``, for a plug-in point whose config section
    names what to build (``reward.name``, ``rollout.engine.backend``); unknown names get :data:`PLUGINS_HINT`.

    A builder may be registered with an options dataclass (:meth:`add`'s ``options``): the schema of
    its section's ``options`` (``reward.options``, ``rollout.engine.options``), which the config layer
    stores as a selectable group node with the dataclass's defaults and checks by type. A builder
    registered without one takes its ``options`` as an untyped mapping or None.

    Args:
        kind: as :class:`Registry`.
        key: as :class:`Registry`.
    """

    def __init__(self, kind: str, *, key: str = "name") -> None:  # noqa: D107 - on the class
        super().__init__(kind, key=key, hint=PLUGINS_HINT)
        self._options: dict[str, type | None] = {}

    def add(self, name: str, entry: Callable[[A], R], options: type | None = None) -> Callable[[A], R]:
        """Registers the builder ``entry`` as ``name``, with its options dataclass (None: untyped
        options); returns ``entry``.

        Raises:
            ValueError: the name is taken.
            TypeError: ``options`` is neither None nor a dataclass type.
        """
        if options is not None and not (isinstance(options, type) and is_dataclass(options)):
            raise TypeError(f"options={options!r} of {self.kind} {name!r} must be a dataclass type (its fields "
                            "are the options and their defaults) or None for untyped options")
        super().add(name, entry)
        self._options[name] = options
        return entry

    def remove(self, name: str) -> Callable[[A], R]:
        """Removes and returns the builder of ``name``, and its options dataclass.

        Raises:
            ValueError: unknown name.
        """
        entry = super().remove(name)
        del self._options[name]
        return entry

    def options_of(self, name: str) -> type | None:
        """The options dataclass ``name`` was registered with, or None (untyped options).

        Raises:
            ValueError: unknown name (as :meth:`Registry.get`).
        """
        self.get(name)
        return self._options[name]

    def declared_options(self) -> dict[str, Any]:
        """``{name: options dataclass}`` of the builders registered with one, in name order."""
        return {name: self._options[name] for name in self.names() if self._options[name] is not None}

    def build(self, name: str, arg: A) -> R:
        """What the builder registered as ``name`` returns for ``arg``.

        Raises:
            ValueError: unknown ``name`` (as :meth:`Registry.get`), or the builder's own checks.
        """
        return self.get(name)(arg)
