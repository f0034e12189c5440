"""Name -> (policy loss function, config dataclass) registry.

Every registered loss has the signature
``fn(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy, config, *,
ref_logprobs=None, entropy=None) -> (per_token_loss [B, T], metrics: dict[str, Tensor [2]])`` and
returns a value to minimise (see ``nemo_sspo.algorithms.losses.base``). Each config class
subclasses ``PolicyLossConfig``. Configs validate the name at load time through
:func:`get_policy_loss`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

PolicyLossFn = Callable[..., tuple]

_REGISTRY: dict[str, tuple[PolicyLossFn, type]] = {}


def register_policy_loss(name: str, config_cls: type) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering ``fn`` under ``name`` with its config dataclass ``config_cls``.

    One function may be registered under several names (stack the decorators), each with its own
    config class. Returns ``fn`` unchanged.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered; pick another name")
        _REGISTRY[name] = (fn, config_cls)
        return fn

    return decorate


def get_policy_loss(name: str) -> tuple[PolicyLossFn, type]:
    """Return ``(fn, config_cls)`` registered under ``name``.

    Raises:
        ValueError: ``name`` is unknown; the message lists the registered names.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; registered: {policy_loss_names()}")
    return _REGISTRY[name]


def policy_loss_names() -> list[str]:
    """Sorted names of all registered policy losses."""
    return sorted(_REGISTRY)


def _field_names(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls)] if dataclasses.is_dataclass(
        config_cls) else []


def build_policy_loss_config(name: str, params: Mapping[str, Any] | None = None, *,
                             where: str = "loss.params") -> Any:
    """Instantiate the config dataclass registered under ``name`` from the mapping ``params``.

    Unknown keys are reported before the class is built, so the message names the key itself:

    - ``segmentation`` / ``segment_k`` on a loss whose ratio unit is fixed (a class attribute, e.g.
      GRPO's "token") when it is the only kind of unknown key: says the unit is fixed and names
      the losses where it is a field;
    - any other unknown key: lists the config's fields (``dataclasses.fields``) with a close-match
      suggestion (``difflib``), and, only when the key is a field of another registered loss's
      config, the hint to select the loss as a group (``loss=<name>``) rather than setting
      ``loss.name`` (the params of the previous loss were left in place).

    Values are then checked by the config's own ``__post_init__`` (wrong types and non-finite
    numbers name the field, e.g. ``GRPOLossConfig.eps_low='abc'``).

    Args:
        name: registered loss name.
        params: field overrides; None or empty for the class defaults.
        where: how the caller's user spells the mapping (``loss.params`` in the trainer's YAML,
            ``loss_config`` in an adapter), used in the messages.

    Raises:
        ValueError: unknown loss name, unknown key, or the config's own validation.
    """
    _, config_cls = get_policy_loss(name)
    params = dict(params or {})
    valid = _field_names(config_cls)
    unknown = [key for key in params if key not in valid]
    if unknown:
        # A key other than segmentation/segment_k says more (e.g. SSPO's params left under GRPO).
        key = next((k for k in unknown if k not in ("segmentation", "segment_k")), unknown[0])
        others = {other: _field_names(cls) for other, (_, cls) in _REGISTRY.items()
                  if other != name}
        if key in ("segmentation", "segment_k"):
            configurable = sorted(o for o, names in others.items() if key in names)
            unit = getattr(config_cls, "segmentation", "?")
            raise ValueError(
                f"{where}.{key}: the ratio unit of loss {name!r} ({config_cls.__name__}) is fixed "
                f"(segmentation {unit!r}) and cannot be set; {key} is configurable only in the "
                f"losses {configurable} (select one, e.g. `loss={configurable[0]}`)"
                if configurable else
                f"{where}.{key}: the ratio unit of loss {name!r} is fixed ({unit!r})")
        close = difflib.get_close_matches(key, valid, n=1)
        message = (f"{where}.{key}: {config_cls.__name__} (loss {name!r}) has no field {key!r}"
                   + (f"; did you mean {close[0]!r}?" if close else ".")
                   + f" Valid fields: {', '.join(valid)}")
        if len(unknown) > 1:
            message += f". Other unknown keys: {[k for k in unknown if k != key]}"
        owners = sorted(o for o, names in others.items() if key in names)
        if owners:
            message += (f". {key!r} is a field of the losses {owners}, not of {name!r}: to switch "
                        f"to loss {name!r} select its group (`loss={name}`), which replaces "
                        f"{where} with its defaults, rather than setting loss.name")
        raise ValueError(message)
    return config_cls(**params)
