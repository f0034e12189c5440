"""Soft gates replacing the hard clip, and SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347).

A gate ``g(x; tau)`` is a smooth, increasing, bounded function with ``g(0) = 0`` and ``g'(0) = 1``
(so that on-policy it passes the plain policy gradient), whose slope decays as |x| grows; the
temperature tau sets how fast. Gates are pluggable: :func:`register_soft_gate` adds one, by name,
as a pair of functions (value, slope) so that the metrics can report the slope without autograd.

- ``"sigmoid"``: g(x) = (4/tau) (sigmoid(tau x) - 1/2) = (2/tau) tanh(tau x / 2);
  g'(x) = 4 sigmoid(tau x) (1 - sigmoid(tau x)). |g| < 2/tau.
- ``"arctan"``: g(x) = (1/tau) arctan(tau x); g'(x) = 1 / (1 + (tau x)^2). |g| < pi / (2 tau).
  Polynomial rather than exponential decay of the slope (one of the gate families of the follow-up
  study arXiv 2602.19345; its exact parametrisation was not available to us, this one is ours).

SAPO (section 3 of the paper): the token objective is f(r_t) A with
f(r) = (4/tau) sigmoid(tau (r - 1)) and tau = tau_pos for A > 0, tau_neg otherwise (defaults
tau_pos = 1.0, tau_neg = 1.05: the paper's, and the defaults of TRL's GRPOConfig
``sapo_temperature_pos`` / ``sapo_temperature_neg`` and of verl's sapo loss). Its gradient is f'(r) r A grad log pi = 4 s (1 - s) r A grad log pi
(s = sigmoid(tau (r - 1))): the ratio's policy gradient scaled by a weight that is 1 on-policy and
decays smoothly off-policy, instead of PPO's hard cut. We write the objective as
psi = A (1 + g(r - 1)) with the gate g above: for the sigmoid gate this is the paper's f(r) A minus
the constant (2/tau - 1) A, which has no gradient; the loss then equals -A on-policy like every
other ratio loss, so loss values compare across methods. Gradients are the paper's exactly.
Aggregation: the paper's objective averages tokens per response then responses
("seq-mean-token-mean").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_sspo.algorithms.losses.base import PolicyLossConfig, config_error
from nemo_sspo.algorithms.losses.ratio_clip import BoundsContext, RatioEngine, Surrogate
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss
from nemo_sspo.registry import Registry

GateFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SoftGate:
    """A gate ``value(x, tau)`` and its derivative ``slope(x, tau)`` in x (tau broadcasts)."""

    value: GateFn
    slope: GateFn


_GATES: Registry[SoftGate] = Registry("soft gate", key="gate")


def register_soft_gate(name: str, gate: SoftGate) -> None:
    """Make ``gate`` selectable as ``gate: <name>`` in SAPO / Soft Sequence PO configs.

    Raises:
        ValueError: the name is taken.
    """
    _GATES.add(name, gate)


def unregister_soft_gate(name: str) -> SoftGate:
    """Remove and return the gate ``name`` (tests and plug-ins that register temporarily).

    Raises:
        ValueError: unknown name.
    """
    return _GATES.remove(name)


def get_soft_gate(name: str) -> SoftGate:
    """The gate registered under ``name``.

    Raises:
        ValueError: unknown name (lists the registered ones).
    """
    return _GATES.get(name)


def soft_gate_names() -> list[str]:
    """Sorted names of the registered gates."""
    return _GATES.names()


def _sigmoid_value(x, tau):
    return (2.0 / tau) * torch.tanh(0.5 * tau * x)


def _sigmoid_slope(x, tau):
    s = torch.sigmoid(tau * x)
    return 4.0 * s * (1.0 - s)


def _arctan_value(x, tau):
    return torch.atan(tau * x) / tau


def _arctan_slope(x, tau):
    return 1.0 / (1.0 + (tau * x).square())


register_soft_gate("sigmoid", SoftGate(_sigmoid_value, _sigmoid_slope))
register_soft_gate("arctan", SoftGate(_arctan_value, _arctan_slope))


def check_gate(config) -> None:
    """Check a gated loss's ``gate`` (a registered name) and temperatures ``tau_pos``, ``tau_neg``.

    Raises:
        ValueError: ``<ConfigClass>.gate=...`` unknown, or a temperature <= 0.
    """
    if config.gate not in _GATES:
        raise config_error(config, f"gate={config.gate!r}; registered: {soft_gate_names()}")
    if config.tau_pos <= 0.0 or config.tau_neg <= 0.0:
        raise config_error(config, f"tau_pos={config.tau_pos}, tau_neg={config.tau_neg}: both "
                                   "temperatures must be > 0")


class GatedConfig(Protocol):
    """What a soft gate reads from its loss's config (SAPO, Soft Sequence PO)."""

    gate: str
    tau_pos: float
    tau_neg: float


def gate_temperature(config: GatedConfig, adv: torch.Tensor) -> torch.Tensor:
    """The temperature tau per row: tau_pos where A > 0, else tau_neg (``adv`` ``[B, 1]``)."""
    return torch.where(adv > 0, torch.full_like(adv, config.tau_pos),
                       torch.full_like(adv, config.tau_neg))


@dataclass
class SAPOLossConfig(PolicyLossConfig):
    """SAPO (arXiv 2511.20347): token ratio through a soft gate instead of the clip."""

    gate: str = "sigmoid"
    """Gate family (``soft_gate_names()``); the paper's is "sigmoid"."""
    tau_pos: float = 1.0
    """Gate temperature for A > 0 (paper default 1.0)."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0 (paper default 1.05: negative tokens decay faster)."""

    def __post_init__(self) -> None:
        """Check the shared fields, the gate and its temperatures."""
        super().__post_init__()
        check_gate(self)


@dataclass(frozen=True)
class SoftGateSurrogate:
    """SAPO's psi = A (1 + g(r - 1)) with gate weight g'(r - 1) (module docstring)."""

    config: GatedConfig

    def __call__(self, ratio: torch.Tensor, adv: torch.Tensor, context: BoundsContext) -> Surrogate:
        """The surrogate psi = A (1 + g(r - 1)) at every token, with the gate's slope as gradient factor."""
        gate, tau = get_soft_gate(self.config.gate), gate_temperature(self.config, adv)
        none = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
        objective = adv * (1.0 + gate.value(ratio - 1.0, tau))
        with torch.no_grad():
            weight = gate.slope(ratio - 1.0, tau)
        return Surrogate(objective, none, none, none, gate_weight=weight)


register_policy_loss(LossRecord("sapo", SAPOLossConfig,
                                lambda c: RatioEngine(SoftGateSurrogate(c)), unit="token"))
