"""User modules that extend the registries before a config is composed.

A plugin is any Python module whose import registers something: a policy loss
(:func:`nemo_sspo.algorithms.losses.register_policy_loss`), a reward
(:func:`nemo_sspo.rewards.register_reward`), a rollout engine
(:func:`nemo_sspo.rollout.register_rollout_engine`), an advantage estimator
(:func:`nemo_sspo.algorithms.advantage_estimators.register_advantage_estimator`) or a prompt source. It is named by the config key
``plugins`` (a dotted module name on ``sys.path``, or the path of a ``.py`` file), or declared by an
installed package as an entry point of the group :data:`ENTRY_POINT_GROUP`; see docs/extending.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

__all__ = ["ENTRY_POINT_GROUP", "load_entry_point_plugins", "load_plugins"]

ENTRY_POINT_GROUP = "nemo_sspo.plugins"
"""Entry-point group whose modules are imported by every ``load_config`` call."""


def _import_file(path: Path) -> None:
    name = f"nemo_sspo_plugin_{path.stem}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def load_plugins(names: Iterable[str]) -> None:
    """Import each plugin once (a module already imported is not imported again).

    Args:
        names: dotted module names, or paths of ``.py`` files (absolute or relative to the
            working directory).

    Raises:
        ValueError: a name that is neither an importable module nor an existing ``.py`` file
            (``plugins`` entry named), or an ``ImportError`` raised inside the module.
    """
    for name in names:
        try:
            if name.endswith(".py"):
                path = Path(name).expanduser().resolve()
                if not path.is_file():
                    raise ValueError(f"plugins: {name!r} is not a file; give the path of a .py file or "
                                     "a dotted module name on sys.path (PYTHONPATH)")
                _import_file(path)
            else:
                importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"plugins: cannot import {name!r} ({err}); put its folder on PYTHONPATH or "
                             "give the path of the .py file") from err


def load_entry_point_plugins() -> list[str]:
    """Import every module declared in the entry-point group :data:`ENTRY_POINT_GROUP`.

    Returns:
        One line per entry point, ``"<name> = <module> (<distribution> <version>)"``, in name order:
        what :func:`nemo_sspo.cli.load_config` records as ``entry_point_plugins`` (the run's
        ``config.yaml`` then says which installed plugins it ran with).

    Raises:
        ValueError: an entry point that fails to import (names it and its package).
    """
    loaded = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: (p.name, p.value)):
        dist = f"{point.dist.name} {point.dist.version}" if point.dist is not None else "no distribution"
        try:
            point.load()
        except ImportError as err:
            raise ValueError(f"entry point {point.name!r} ({point.value}, {dist}) of group "
                             f"{ENTRY_POINT_GROUP!r} failed to import: {err}") from err
        loaded.append(f"{point.name} = {point.value} ({dist})")
    return loaded
