"""A name -> entry table for each plug-in point: policy losses, soft gates, rewards, rollout engines.

Ours. Every plug-in point keeps one :class:`Registry`, and its public functions
(``register_reward``, ``get_policy_loss``, ...) are its methods or thin names over them, so the
rules (a name is taken once; removing or looking up an unknown name fails, listing what is
registered) and the messages are the same everywhere. A plug-in point of builders (rewards,
rollout engines) is a :class:`BuilderRegistry`, whose ``build`` calls the chosen builder. The messages name the caller's argument (``key``), so the config
layer's ``at_key`` turns them into YAML keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

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

    Args:
        kind: as :class:`Registry`.
        key: as :class:`Registry`.
    """

    def __init__(self, kind: str, *, key: str = "name") -> None:  # noqa: D107 - on the class
        super().__init__(kind, key=key, hint=PLUGINS_HINT)

    def build(self, name: str, arg: A) -> R:
        """What the builder registered as ``name`` returns for ``arg``.

        Raises:
            ValueError: unknown ``name`` (as :meth:`Registry.get`), or the builder's own checks.
        """
        return self.get(name)(arg)
