"""Name -> (policy loss function, config dataclass) registry.

Every registered loss has the signature
``fn(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy, config, *,
ref_logprobs=None, entropy=None) -> (per_token_loss [B, T], metrics: dict[str, Tensor [2]])`` and
returns a value to minimise (see ``nemo_sspo.algorithms.losses.base``). Each config class
subclasses ``PolicyLossConfig``. Configs validate the name at load time through
:func:`get_policy_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

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
