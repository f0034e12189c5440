"""Unknown keys: which key was meant (closest spelling, other trainers' names, the losses that have
a field), and the keys of earlier releases with what replaced them.
"""

from __future__ import annotations

import difflib

from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from nemo_sspo.algorithms.losses import build_policy_loss_config
from nemo_sspo.algorithms.losses.loss_registry import losses_with_field
from nemo_sspo.trainer.config.old_keys import MOVED_KEYS, RENAMED_KEYS
from nemo_sspo.trainer.config.options import OPTION_SECTIONS
from nemo_sspo.trainer.config.train_config import TrainConfig

__all__ = ["PEER_NAMES", "find_unknown_key", "unknown_key_message"]

PEER_NAMES = {"learning_rate": "lr", "max_lr": "lr", "warmup_steps": "lr_warmup_steps",
              "lr_warmup_iters": "lr_warmup_steps", "lr_decay_style": "lr_schedule", "lr_decay_iters": "lr_decay_steps"}
"""Names other trainers (HF, Megatron-LM, verl) give our settings, which spelling distance does not find
(``optim.learning_rate`` is far from ``lr``): suggested where the section has the key on the right."""


def unknown_key_message(path: str, loss_name: str | None) -> str:
    """Why ``path`` (e.g. ``trainer.max_stepz`` or ``loss.params.gamma``) is not a config key, with
    the closest valid key and, for loss params, which losses have that field.

    The loss config's own message is used for ``loss.params.*``
    (``nemo_sspo.algorithms.losses.build_policy_loss_config``).
    """
    parts = path.split(".")
    for depth in range(len(parts), 0, -1):  # the key, or a section it was in, of an earlier release
        old, below = ".".join(parts[:depth]), path[len(".".join(parts[:depth])):]
        if old not in RENAMED_KEYS or (below and MOVED_KEYS.get(old, "").startswith(f"{old}.")):
            continue  # not an old key, or an old value whose key is a section today (rollout.correction)
        return f"{path} moved to {MOVED_KEYS[old]}{below}" if below and old in MOVED_KEYS else RENAMED_KEYS[old]
    if parts[:2] == ["loss", "params"] and len(parts) == 3 and loss_name:
        try:
            build_policy_loss_config(loss_name, {parts[2]: None}, where="loss.params")
        except ValueError as err:
            owners = losses_with_field(parts[2], besides=loss_name)
            switch = (f". To switch to one of them, select its group (e.g. `loss={owners[0]}`), which replaces "
                      "loss.params with that loss's defaults, rather than setting loss.name" if owners else "")
            return f"{err}{switch}"
    options = _options_key_message(path)
    if options:
        return options
    node: Any = TrainConfig
    for depth, part in enumerate(parts):
        hints = get_type_hints(node) if is_dataclass(node) else {}
        if part not in hints:
            where = ".".join(parts[:depth]) or "the config"
            close = ([PEER_NAMES[part]] if PEER_NAMES.get(part) in hints
                     else difflib.get_close_matches(part, list(hints), n=1))
            guess = f"; did you mean {'.'.join([*parts[:depth], close[0]])!r}?" if close else ""
            valid = f" Valid keys of {where}: {', '.join(hints)}" if hints else ""
            return f"{path}: {where} has no key {part!r}{guess or '.'}{valid}"
        node = hints[part]
    return f"{path}: not a config key"


def _article(noun: str) -> str:
    """``"an engine"``, ``"a reward"``."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _options_key_message(path: str) -> str | None:
    """For ``<section>.options.<field>`` of a builder's options (``rollout.engine.options.dtype``): the
    groups whose options have the field (or the closest field), to select before setting it; else None.
    """
    for section in OPTION_SECTIONS:
        field = path.removeprefix(f"{section.path}.options.")
        if field == path or "." in field:
            continue
        declared = section.registry.declared_options()
        owners = [f"{section.group}={name}" for name, cls in declared.items() if field in {f.name for f in fields(cls)}]
        if owners:
            return (f"{path}: {section.path}.options has no key {field!r} until {_article(section.noun)} that has it is "
                    f"selected as a group: {', '.join(owners)} (e.g. {owners[0]} {path}=...; a config whose "
                    f"defaults list does not select a {section.group} group adds it with +{owners[0]}); setting "
                    f"{section.path}.{section.key} alone gives the options' defaults")
        close = difflib.get_close_matches(field, sorted({f.name for cls in declared.values() for f in fields(cls)}), n=1)
        guess = f"; did you mean {f'{section.path}.options.{close[0]}'!r}?" if close else "."
        valid = "; ".join(f"{section.group}={name}: {', '.join(f.name for f in fields(cls))}"
                          for name, cls in declared.items())
        return (f"{path}: no registered {section.noun}'s options have the key {field!r}{guess} Valid keys: {valid}. "
                f"{_article(section.noun).capitalize()} registered without an options dataclass takes its "
                f"options whole: {section.path}.options={{{field}: ...}}")
    return None


def find_unknown_key(raw: Any, typed: Any, prefix: str = "") -> str | None:
    """The first key path of the composed ``raw`` mapping that the typed config does not hold (a key
    added with Hydra's ``+`` that no dataclass field takes), or None.
    """
    if not isinstance(raw, dict):
        return None
    for key, value in raw.items():
        path = f"{prefix}{key}"
        # Field names, not attributes: OmegaConf.to_object sets extra keys as plain attributes.
        if is_dataclass(typed) and key not in {f.name for f in fields(typed)}:
            return path
        found = find_unknown_key(value, getattr(typed, key, None), f"{path}.")
        if found:
            return found
    return None

