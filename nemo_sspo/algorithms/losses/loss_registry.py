"""Name -> :class:`LossRecord` registry: how to build each loss and what it needs from its host.

A record holds the loss's config dataclass, a builder that turns a config into the loss's
objective (``objective(inputs, segments) -> LossTerms``), and what the loss fixes: its ratio unit
when users cannot change it (GRPO's "token"), where its advantages come from, whether it reads the
old-policy entropy. :meth:`LossRecord.requirements` turns a config into the one
:class:`LossRequirements` record a trainer or adapter reads (segmentation, advantage source, std
normalisation, reference model, entropies). :func:`make_policy_loss` binds a config into a
:class:`nemo_sspo.algorithms.losses.PolicyLoss`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nemo_sspo.algorithms.losses.base import (
    LossTerms,
    PolicyLossConfig,
    check_optional_inputs,
    finish_policy_loss,
    resolve_segments,
)
from nemo_sspo.algorithms.losses.inputs import LossInputs, LossOutput, LossRequirements
from nemo_sspo.registry import Registry

class Objective(Protocol):
    """What a loss's builder returns: ``objective(inputs, segments) -> LossTerms``."""

    def __call__(self, inputs: LossInputs, segments: torch.Tensor) -> LossTerms:
        """The per-token term of one micro-batch (no KL or entropy term: those are shared).

        Args:
            inputs: the micro-batch.
            segments: ``[B, T]`` int64 ratio-segment ids of the loss's unit (-1 masked).
        """
        ...

ADVANTAGE_SOURCES = ("group", "critic")


@dataclass(frozen=True)
class LossRecord:
    """One registered loss (module docstring).

    Attributes:
        name: registry name.
        config_cls: its config dataclass (subclass of ``PolicyLossConfig``).
        build: ``build(config) -> objective``.
        unit: the fixed ratio unit, or None when ``config_cls`` has a ``segmentation`` field.
        advantage_source: one of :data:`ADVANTAGE_SOURCES`.
        reads_old_entropy: the objective reads ``LossInputs.old_entropy``.
        dynamic_sampling: the method refills zero-variance prompt groups (DAPO).
        normalize_std: the method divides group-centred rewards by the group std (GRPO: True;
            Dr. GRPO: False); the host's default for its advantage estimator's std switch.
    """

    name: str
    config_cls: type
    build: Callable[[Any], Objective]
    unit: str | None = None
    advantage_source: str = "group"
    reads_old_entropy: bool = False
    dynamic_sampling: bool = False
    normalize_std: bool = True

    def requirements(self, config: PolicyLossConfig) -> LossRequirements:
        """The host-facing needs of this loss under ``config``."""
        return LossRequirements(
            segmentation=self.unit or config.segmentation,
            segment_k=getattr(config, "segment_k", None),
            advantage_source=self.advantage_source,
            normalize_std=self.normalize_std,
            reference_policy=config.kl_coef > 0,
            current_entropy=config.entropy_coef > 0,
            old_entropy=self.reads_old_entropy,
            dynamic_sampling=self.dynamic_sampling,
        )


class BoundPolicyLoss:
    """A registered loss bound to its config: ``loss(inputs) -> LossOutput`` (``PolicyLoss``).

    Attributes:
        name, config: the registered name and the config instance.
        requirements: :meth:`LossRecord.requirements` of the config.
    """

    def __init__(self, record: LossRecord, config: PolicyLossConfig) -> None:
        if not isinstance(config, record.config_cls):
            raise ValueError(f"loss {record.name!r} needs a {record.config_cls.__name__}, got "
                             f"{type(config).__name__}")
        self.name, self.config = record.name, config
        self.requirements = record.requirements(config)
        self._objective = record.build(config)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        """Per-token loss (value to minimise) and metrics of one micro-batch.

        Raises:
            ValueError: an input this config needs is None (``segment_ids``, ``old_entropy``,
                ``ref_logprobs``, ``entropy``: the message names it), segment ids out of range,
                or an objective whose ``LossTerms.response_mask`` differs from
                ``LossInputs.response_mask`` (:func:`_check_terms_mask`).
        """
        check_optional_inputs(self.config, inputs)
        if self.requirements.old_entropy and inputs.old_entropy is None:
            raise ValueError(f"loss {self.name!r} reads LossInputs.old_entropy (its clip bounds "
                             "depend on the old policy's token entropy); pass it")
        segments = resolve_segments(self.requirements.segmentation, inputs)
        terms = self._objective(inputs, segments)
        _check_terms_mask(self.name, terms, inputs)
        per_token, metrics = finish_policy_loss(terms, self.config, inputs)
        return LossOutput(per_token, metrics)

    def __repr__(self) -> str:
        return f"BoundPolicyLoss({self.name!r}, {self.config!r})"


def _check_terms_mask(name: str, terms: LossTerms, inputs: LossInputs) -> None:
    """Refuses a ``LossTerms.response_mask`` other than the input's.

    The aggregation's denominator (tokens or responses) counts ``LossInputs.response_mask``, and a
    host (the trainer, verl, NeMo-RL) reduces with its own copy of that mask, so a narrower mask
    returned by an objective could not change the denominator; only the metrics would read it.
    The usual case, the input's own tensor, costs nothing; another tensor is compared (one sync).

    Raises:
        ValueError: naming the loss and how to leave a token out instead.
    """
    mask = inputs.response_mask
    if terms.response_mask is mask or (terms.response_mask.shape == mask.shape
                                       and torch.equal(terms.response_mask.bool(), mask.bool())):
        return
    raise ValueError(f"loss {name!r}: LossTerms.response_mask differs from LossInputs.response_mask; "
                     "return the input's mask (the aggregation's denominator counts it). To leave a "
                     "valid token out of the loss, set its per_token_loss to 0 and its grad_zero flag")


_REGISTRY: Registry[LossRecord] = Registry(
    "policy loss", hint=" (a module that registers one is loaded with the config key plugins, e.g. "
                        "plugins=[my_loss.py] loss=my_loss; see docs/extending.md)")


def register_policy_loss(record: LossRecord) -> LossRecord:
    """Add ``record`` to the registry; returns it.

    Raises:
        ValueError: the name is taken, the config class is not a dataclass whose only base is
            ``PolicyLossConfig``, the advantage source is unknown, or ``unit`` is None for a
            config class without a ``segmentation`` field.
    """
    if record.config_cls.__bases__ != (PolicyLossConfig,) or not dataclasses.is_dataclass(
            record.config_cls):
        raise ValueError(f"loss {record.name!r}: {record.config_cls.__name__} must be a dataclass "
                         "whose only base is PolicyLossConfig (list every field the loss reads "
                         "in it, even those another loss has too)")
    if record.advantage_source not in ADVANTAGE_SOURCES:
        raise ValueError(f"advantage_source={record.advantage_source!r}; valid: "
                         f"{ADVANTAGE_SOURCES}")
    if record.unit is None and "segmentation" not in _field_names(record.config_cls):
        raise ValueError(f"loss {record.name!r}: give unit= or a segmentation field in "
                         f"{record.config_cls.__name__}")
    return _REGISTRY.add(record.name, record)


def unregister_policy_loss(name: str) -> LossRecord:
    """Remove and return the record of ``name`` (tests and plug-ins that register temporarily).

    Raises:
        ValueError: ``name`` is not registered.
    """
    return _REGISTRY.remove(name)


def get_policy_loss(name: str) -> LossRecord:
    """The :class:`LossRecord` registered under ``name``.

    Raises:
        ValueError: ``name`` is unknown; the message lists the registered names.
    """
    return _REGISTRY.get(name)


def make_policy_loss(name: str, config: PolicyLossConfig | None = None) -> BoundPolicyLoss:
    """The loss ``name`` bound to ``config`` (the config class's defaults when None).

    Raises:
        ValueError: unknown name, or a config of another class.
    """
    record = get_policy_loss(name)
    return BoundPolicyLoss(record, record.config_cls() if config is None else config)


def policy_loss_names() -> list[str]:
    """Sorted names of all registered policy losses."""
    return _REGISTRY.names()


def _field_names(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls)] if dataclasses.is_dataclass(
        config_cls) else []


def losses_with_field(field_name: str, *, besides: str | None = None) -> list[str]:
    """Sorted names of the registered losses whose config class has ``field_name`` (``besides`` left out)."""
    return sorted(name for name, record in _REGISTRY.items()
                  if name != besides and field_name in _field_names(record.config_cls))


def build_policy_loss_config(name: str, params: Mapping[str, Any] | None = None, *,
                             where: str = "params") -> Any:
    """Instantiate the config dataclass registered under ``name`` from the mapping ``params``.

    Unknown keys are reported before the class is built, so the message names the key itself:

    - ``segmentation`` / ``segment_k`` on a loss whose ratio unit is fixed (a class attribute, e.g.
      GRPO's "token") when it is the only kind of unknown key: says the unit is fixed and names
      the losses where it is a field;
    - any other unknown key: lists the config's fields (``dataclasses.fields``) with a close-match
      suggestion (``difflib``), and, when the key is a field of other registered losses' configs,
      names them (the params of another loss were kept: the config layer adds how to switch).

    Values are then checked by the config's own ``__post_init__`` (wrong types and non-finite
    numbers name the field, e.g. ``GRPOLossConfig.eps_low='abc'``).

    Args:
        name: registered loss name.
        params: field overrides; None or empty for the class defaults.
        where: how the caller's user spells the mapping (the trainer's config passes its YAML key,
            an adapter ``loss_config``), used in the messages.

    Raises:
        ValueError: unknown loss name, unknown key, or the config's own validation.
    """
    record = get_policy_loss(name)
    config_cls = record.config_cls
    params = dict(params or {})
    valid = _field_names(config_cls)
    unknown = [key for key in params if key not in valid]
    if unknown:
        # A key other than segmentation/segment_k says more (e.g. SSPO's params left under GRPO).
        key = next((k for k in unknown if k not in ("segmentation", "segment_k")), unknown[0])
        if key in ("segmentation", "segment_k"):
            configurable = losses_with_field(key, besides=name)
            unit = record.unit
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
        owners = losses_with_field(key, besides=name)
        if owners:
            message += f". {key!r} is a field of the losses {owners}, not of {name!r}"
        raise ValueError(message)
    return config_cls(**params)
