"""A name -> entry table for each plug-in point: policy losses, soft gates, rewards, rollout engines.

Ours. Every plug-in point keeps one :class:`Registry`, and its public functions
(``register_reward``, ``get_policy_loss``, ...) are thin names over it, so the rules (a name is
taken once; removing or looking up an unknown name fails, listing what is registered) and the
messages are the same everywhere. The messages name the caller's argument (``key``), so the config
layer's ``at_key`` turns them into YAML keys.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


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
