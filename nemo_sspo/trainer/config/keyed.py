"""How the config layer puts YAML key paths on problems: :func:`at_key` for a lower layer's check,
:func:`failed` for a section's own list of checks.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["at_key", "failed", "problems_at_key"]


def at_key(prefix: str, call: Callable[[], Any]) -> Any:
    """Runs a lower layer's call; its ``ValueError`` (or ``FileNotFoundError``), which names the layer's
    own argument, is re-raised as the same type with the config key path in front (``at_key("model.",
    ...)``: ``precision='x'`` becomes ``model.precision='x'``).

    The one place where lower layers' messages get YAML keys (tests/unit/repo/test_config_keys_below.py
    keeps the layers below the trainer free of them).

    Args:
        prefix: the key path to put in front, with its trailing dot (``"model."``).
        call: the lower layer's check or lookup.

    Returns:
        What ``call`` returns.

    Raises:
        ValueError: ``call``'s, with ``prefix`` in front (``FileNotFoundError`` likewise).
    """
    try:
        return call()
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{prefix}{err}") from None


def problems_at_key(prefix: str, call: Callable[[], Any]) -> list[str]:
    """:func:`at_key`'s message as a one-item list when ``call`` raises ``ValueError``, else ``[]``.

    Args:
        prefix: as :func:`at_key`.
        call: as :func:`at_key`.

    Returns:
        The problems (none or one).
    """
    try:
        at_key(prefix, call)
    except ValueError as err:
        return [str(err)]
    return []


def failed(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the checks that do not hold, in order.

    Args:
        checks: ``(holds, message)`` pairs; the message names the full key path and the fix.

    Returns:
        The messages of the pairs whose ``holds`` is false.
    """
    return [message for holds, message in checks if not holds]
