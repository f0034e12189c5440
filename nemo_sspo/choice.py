"""The base of every setting whose value is one of a fixed set of names.

Ours. A config field typed with a :class:`Choice` is checked by the config loader itself
(OmegaConf refuses any other value, and ``nemo_sspo.cli.load_config`` words that refusal as
``key='value' is unknown; valid: ...``). A member's name is its value, so YAML, overrides and the
saved ``config.yaml`` hold the plain name, and a member equals its string (``Placement.separate ==
"separate"``); only the plug-in points that user modules extend (losses, engines, rewards) keep
plain names checked against their registries.
"""

from __future__ import annotations

import enum

__all__ = ["Choice"]


class Choice(enum.StrEnum):
    """A fixed set of names; each member's name equals its (lower-case) value.

    ``str``, ``f"{x}"`` and ``repr`` give the plain value (``repr``: quoted, as ``repr`` of the
    string), so messages that write ``key={value!r}`` read the same for a member and a string.
    """

    def __repr__(self) -> str:
        return repr(self.value)
