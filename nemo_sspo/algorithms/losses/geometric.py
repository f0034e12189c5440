"""Geometric-mean sequence weights built from per-token transformed ratios: GMPO and Soft Sequence PO.

Both use the engine with one segment per response and no clip on the sequence weight; they differ
in the per-token transform phi applied to the log-ratio d_t before the mean:

    J_i = A_i * exp( (1/|y_i|) sum_t phi(d_t) )   (a geometric mean of the transformed token ratios)

GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673, the objective of section 3 with
token-level clipping): J_i = sgn(A_i) prod_t | min(rho_t A_i, clip(rho_t, e^-eps_low, e^eps_high)
A_i) |^(1/|y_i|). For A > 0 the min keeps the upper clip only, for A < 0 the lower one, so in log
space phi(d) = min(d, eps_high) for A > 0 and max(d, -eps_low) for A < 0, and J_i = A_i exp(mean phi).
The authors' verl example (verl examples/gmpo_trainer, README and run_qwen2_5-7b_math.sh:
``loss_mode=geo_mean``, ``clip_ratio_low=0.4``, ``clip_ratio_high=0.4``, read as log-space bounds)
uses the range (e^-0.4, e^0.4), our defaults. A clipped token gets no gradient; the other tokens
get A_i s_i / |y_i| each.

Soft Sequence PO (arXiv 2602.19327): soft gates over the token ratios inside a sequence-level
weight combined by a geometric mean, with sigmoid and arctan gate families (what we take from the
paper's public description). The paper's exact gate equations were not available to us, so the
following are OURS: the gate acts on the token log-ratio, phi(d) = g(d; tau); g is normalised to
g(0) = 0, g'(0) = 1 (``nemo_sspo.algorithms.losses.soft_gates``: sigmoid g = (2/tau) tanh(tau d /
2), arctan g = arctan(tau d) / tau); tau = tau_pos for A > 0 and tau_neg otherwise; and the
defaults gate "sigmoid", tau_pos = tau_neg = 1 (unconfirmed; the paper may default to arctan or
other temperatures). Each gated token ratio exp(g(d)) is 1 on-policy and bounded (e.g. within
e^(+-2/tau) for the sigmoid gate); token t's gradient is A_i w_i g'(d_t) / |y_i| with
w_i = exp(mean_t g(d_t)), so far-off-policy tokens fade smoothly instead of being cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.losses.base import PolicyLossConfig, config_error
from nemo_sspo.algorithms.losses.ratio_clip import RatioEngine, TokenTransform, unclipped
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss
from nemo_sspo.algorithms.losses.soft_gates import check_gate, gate_temperature, get_soft_gate


@dataclass
class GMPOLossConfig(PolicyLossConfig):
    """GMPO (arXiv 2507.20673): geometric mean of token ratios clipped in log space (defaults from
    the authors' verl example, examples/gmpo_trainer).
    """

    log_clip_low: float = 0.4
    """Token log-ratios of A < 0 responses are clipped below at -log_clip_low (ratio e^-0.4)."""
    log_clip_high: float = 0.4
    """Token log-ratios of A > 0 responses are clipped above at log_clip_high (ratio e^0.4)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_clip_low < 0.0 or self.log_clip_high < 0.0:
            raise config_error(self, f"log_clip_low={self.log_clip_low}, log_clip_high="
                                     f"{self.log_clip_high}: both must be >= 0")


@dataclass
class SoftSeqPOLossConfig(PolicyLossConfig):
    """Soft Sequence PO (arXiv 2602.19327): geometric mean of soft-gated token ratios.

    The gate's placement, normalisation and the defaults (sigmoid gate, tau_pos = tau_neg = 1) are
    ours (module docstring).
    """

    gate: str = "sigmoid"
    """Gate family (``soft_gate_names()``); ours."""
    tau_pos: float = 1.0
    """Gate temperature for A > 0; ours."""
    tau_neg: float = 1.0
    """Gate temperature for A <= 0; ours."""

    def __post_init__(self) -> None:
        """Check the shared fields, the gate and its temperatures."""
        super().__post_init__()
        check_gate(self)


@dataclass(frozen=True)
class LogSpaceClip:
    """GMPO's phi: min(d, log_clip_high) for A > 0, max(d, -log_clip_low) for A < 0."""

    config: GMPOLossConfig

    def __call__(self, log_ratio: torch.Tensor, adv: torch.Tensor) -> TokenTransform:
        """phi(d) clipped in log space on the side of the advantage's sign, with the clip flags."""
        low, high = self.config.log_clip_low, self.config.log_clip_high
        positive, negative = adv > 0, adv < 0
        clipped = torch.where(positive, log_ratio.clamp(max=high),
                              torch.where(negative, log_ratio.clamp(min=-low), log_ratio))
        with torch.no_grad():
            clip_high = positive & (log_ratio > high)
            clip_low = negative & (log_ratio < -low)
        return TokenTransform(clipped, clip_low=clip_low, clip_high=clip_high)


@dataclass(frozen=True)
class SoftGateTransform:
    """Soft Sequence PO's phi: g(d; tau), with the slope g'(d) reported as the gate weight."""

    config: SoftSeqPOLossConfig

    def __call__(self, log_ratio: torch.Tensor, adv: torch.Tensor) -> TokenTransform:
        """phi(d) = g(d; tau) and the gate's slope as the gradient factor."""
        gate, tau = get_soft_gate(self.config.gate), gate_temperature(self.config, adv)
        with torch.no_grad():
            weight = gate.slope(log_ratio, tau)
        return TokenTransform(gate.value(log_ratio, tau), gate_weight=weight)


register_policy_loss(LossRecord("gmpo", GMPOLossConfig,
                                lambda c: RatioEngine(unclipped, LogSpaceClip(c)), unit="response"))
register_policy_loss(LossRecord("soft_seq_po", SoftSeqPOLossConfig,
                                lambda c: RatioEngine(unclipped, SoftGateTransform(c)),
                                unit="response"))
