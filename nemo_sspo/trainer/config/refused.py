"""What the schema refuses in a composed but untyped config: every unknown key and every value of the
wrong type or outside its choices, each reported and taken out, so that the rest can be typed and checked
too (OmegaConf, merging onto the typed schema, stops at the first).
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_sspo.trainer.config.old_keys import RENAMED_KEYS
from nemo_sspo.trainer.config.train_config import TrainConfig, schema
from nemo_sspo.trainer.config.unknown_keys import unknown_key_message

__all__ = ["omegaconf_problem", "refused_keys_and_values", "refused_value_message", "typed_config"]


def refused_value_message(path: str, value: Any, err: OmegaConfBaseException) -> str:
    """The problem of a value OmegaConf refused for the key ``path``.

    Args:
        path: the full key path (``trainer.max_steps``).
        value: the refused value.
        err: OmegaConf's error (its first line is the reason).

    Returns:
        ``"<path>=<value> is unknown; valid: <names>"`` for a :class:`~nemo_sspo.choice.Choice` field,
        the message of :data:`~nemo_sspo.trainer.config.old_keys.RENAMED_KEYS` for a value given where a
        section of today stands (``rollout.correction=token_tis``), else ``"<path>=<value>: <reason>"``
        (``Value 'two' of type 'str' could not be converted to Integer``).
    """
    reason = _reason(err)
    choice = re.match(r"Invalid value '.*', expected one of \[(.*)\]", reason)
    if choice:
        return f"{path}={value!r} is unknown; valid: {choice.group(1)}"
    if path in RENAMED_KEYS:
        return RENAMED_KEYS[path]
    return f"{path}={value!r}: {reason}"


def refused_keys_and_values(raw: DictConfig) -> list[str]:
    """Every key of ``raw`` that no schema field takes and every value its field refuses, each removed
    from ``raw`` in place, so that ``raw`` then merges onto the typed schema (with those keys at their
    defaults) and the config's other problems can be found too.

    Ours. Each level of ``raw`` is checked against the dataclass of the same level of
    :func:`~nemo_sspo.trainer.config.train_config.schema`: a value by assigning it to that dataclass's
    structured config, which converts or refuses it as the merge would. A level that came typed from its
    group node (``loss.params``: the selected loss's dataclass, whose values Hydra already converted) is
    checked for keys only (a key added with ``+``).

    Args:
        raw: Hydra's composition over an untyped ``train_schema`` (the group nodes keep their dataclass
            types).

    Returns:
        One message per refused key or value, in ``raw``'s order, each naming the full key path (the
        closest key or the key that replaced an old one, as
        :func:`~nemo_sspo.trainer.config.unknown_keys.unknown_key_message`).
    """
    OmegaConf.set_struct(raw, False)
    loss_name = OmegaConf.select(raw, "loss.name", default=None)
    return _refused(raw, OmegaConf.structured(schema()), "", loss_name if isinstance(loss_name, str) else None)


def _refused(raw: DictConfig, typed: DictConfig, prefix: str, loss_name: str | None) -> list[str]:
    """:func:`refused_keys_and_values` for one level: ``typed`` is the schema's structured config there."""
    names = {item.name for item in fields(OmegaConf.get_type(typed))}
    plain = OmegaConf.to_container(raw, resolve=False, enum_to_str=True)
    found: list[str] = []
    for key in list(raw.keys()):
        path = f"{prefix}{key}"
        if key not in names:
            found.append(unknown_key_message(path, loss_name))
            del raw[key]
            continue
        value, slot = raw._get_node(key), typed._get_node(key)
        if isinstance(value, DictConfig) and isinstance(slot, DictConfig) and is_dataclass(OmegaConf.get_type(slot)):
            found += _refused(value, slot, f"{path}.", loss_name)  # a section of the schema
            continue
        if isinstance(value, DictConfig) and is_dataclass(OmegaConf.get_type(value)):
            # a group's dataclass (loss.params): its values are converted, its keys may not be
            own = {item.name for item in fields(OmegaConf.get_type(value))}
            extra = [name for name in value.keys() if name not in own]
            found += [unknown_key_message(f"{path}.{name}", loss_name) for name in extra]
            if extra:  # a structured config deletes no key: the same dataclass with the others
                raw[key] = OmegaConf.merge(OmegaConf.structured(OmegaConf.get_type(value)),
                                           OmegaConf.masked_copy(value, [name for name in value.keys() if name in own]))
            continue
        try:
            typed[key] = plain[key]
        except OmegaConfBaseException as err:
            found.append(refused_value_message(path, plain[key], err))
            del raw[key]
    return found


def typed_config(raw: DictConfig) -> tuple[TrainConfig | None, list[str]]:
    """``raw`` (cleaned by :func:`refused_keys_and_values`) merged onto the typed schema and built, with
    the problem of each dataclass whose own check refuses its values when built (a loss config's
    ``__post_init__``: ``SSPOLossConfig.gamma=...``), named by its key path and then built from its
    defaults, so that the rest of the config can still be checked.

    Args:
        raw: the composed config.

    Returns:
        The typed config (None where it cannot be built: a mandatory value left unset, an interpolation
        that does not resolve, a check whose dataclass is not found), and the problems found building it.
    """
    merged = OmegaConf.merge(OmegaConf.structured(schema()), raw)
    found: list[str] = []
    reset: set[str] = set()
    while True:
        try:
            return OmegaConf.to_object(merged), found
        except OmegaConfBaseException as err:  # e.g. "Interpolation key 'x' not found" (some are ValueErrors)
            return None, [*found, omegaconf_problem(err)]
        except ValueError as err:  # "<Class>.<field>=...": the class's own check
            name, _, rest = str(err).partition(".")
            path = _path_of_class(merged, name, "")
            if path is None or path in reset:
                return None, [*found, str(err)]
            found.append(f"{path}.{rest}")
            reset.add(path)
            OmegaConf.update(merged, path, OmegaConf.structured(OmegaConf.get_type(OmegaConf.select(merged, path))),
                             merge=False)


def omegaconf_problem(err: BaseException) -> str:
    """The problem of an OmegaConf error (or of the first one under a Hydra error) on one line: its
    reason under its key path (``trainer.max_steps: Interpolation key 'x' not found``), without the
    lines naming OmegaConf's internal types; Hydra's own first line where no OmegaConf error is under it.

    Args:
        err: the error.

    Returns:
        The message.
    """
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return str(err).splitlines()[0]
    reason = _reason(cause)
    key = getattr(cause, "full_key", None)
    return f"{key}: {reason}" if key and key not in reason else reason


def _path_of_class(node: DictConfig, name: str, prefix: str) -> str | None:
    """The key path of the first node below ``node`` whose dataclass is called ``name``, or None."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            path = f"{prefix}{key}"
            if getattr(OmegaConf.get_type(child), "__name__", None) == name:
                return path
            found = _path_of_class(child, name, f"{path}.")
            if found is not None:
                return found
    return None


def _reason(err: BaseException) -> str:
    """An OmegaConf error's reason: the first line of its message (the rest names its key and types)."""
    return str(getattr(err, "msg", None) or err).splitlines()[0]
