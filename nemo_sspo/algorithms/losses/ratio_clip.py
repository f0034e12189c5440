"""The shared segment-ratio engine and the losses that differ from SSPO only in segments and bounds.

Objective (SSPO, arXiv 2511.04256, eq. 16; every loss of the engine changes only the pieces below):

    J = (1/G) sum_i (1/|y_i|) sum_j |y_ij| * psi( s_ij, A_i )

- y_ij: segment j of response i (the config's ``segmentation``), |y_ij| its token count; A_i the
  response's advantage (eq. 8).
- s_ij = exp( mean_{t in y_ij} phi(d_t) ) with d_t = log pi_theta(y_t) - log pi_old(y_t) (eq. 9
  when phi is the identity). phi is the engine's *transform*: identity here, a log-space clip for
  GMPO, a soft gate for Soft Sequence PO.
- psi: the engine's *surrogate*. :class:`HardClip`: psi = min(s A, clip(s, b_low, b_high) A), its
  *bounds* giving (b_low, b_high) (:class:`FixedBounds` here; entropy- and probability-dependent
  ones in ``adaptive_bounds``), and for A < 0 the dual clip max(psi, c A) (Ye et al. 2020, arXiv
  1912.09729) when ``dual_clip_c`` is set. :class:`Unclipped`: psi = s A. Soft gate (SAPO,
  ``soft_gates``): psi = A (1 + g(s - 1)).
- ``token_gradient`` (GSPO-token, arXiv 2507.18071 section 4.3): the ratio takes the value of s_ij
  but the gradient of each token's own log-prob, s_ij,t = sg[s_ij] pi(y_t) / sg[pi(y_t)].

The three are small strategy objects composed into a :class:`RatioEngine` when a loss is bound to
its config (each module's ``register_policy_loss`` call shows the composition); configs are data.

The per-token loss is the value TO MINIMISE: -psi at every token of the segment, 0 at masked
positions. A segment's tokens sum to |y_ij| psi, so ``aggregate(..., "seq-mean-token-mean")``
yields exactly -J and every token of a segment gets the gradient weight s_ij A_i / |y_i| of eq. 10.

Losses on this engine (segment unit / bounds / aggregation):

- ``grpo`` (DeepSeekMath arXiv 2402.03300 eq. 3): token / [1 - eps_low, 1 + eps_high] (+ dual clip)
  / seq-mean-token-mean.
- ``dr_grpo`` (arXiv 2503.20783 section 3.2): as grpo with the constant denominator L_max
  ("constant-denominator") and advantages without std normalisation
  (its record's ``normalize_std=False``, the host's default for the advantage's std switch).
- ``dapo`` (arXiv 2503.14476 eq. 8): token / clip-higher [0.8, 1.28] / token-mean. Its record
  asks the host for dynamic sampling (``LossRequirements.dynamic_sampling``); the refill and the
  overlong shaping are in ``nemo_sspo.algorithms.dynamic_sampling`` and
  ``nemo_sspo.algorithms.reward_shaping``.
- ``gspo`` (arXiv 2507.18071 eqs. 5-7): response / [1 - 3e-4, 1 + 4e-4]; ``gspo_token``: the same
  with ``token_gradient`` (equal to gspo whenever the advantage is constant over a response, as it
  is here; the paper states this equivalence).
- ``sspo_fixed_clip``: SSPO's segments with a fixed clip (the paper's "w/o entropy clip").
- ``sppo`` (sequence-level PPO, arXiv 2604.08865; official code sustech-nlp/SPPO): PPO's token
  ratio, fixed clip [0.8, 1.2], dual clip c = 3, token-mean; its advantage r - sigmoid(V(prompt))
  comes from the trainer's critic (``advantage_source``).
- ``lpo`` (Linguistic-unit Policy Optimization, Ling 2.0 report arXiv 2510.22115 section 4.2.2):
  sentence ratio (segments end at pause punctuation after detokenisation, segmentation
  "pause_punctuation"), symmetric clip [1 - 0.03, 1 + 0.03], token-mean (the objective's
  1 / sum_i |y_i| with each sentence weighted by its token count |s_ik|).
- ``sspo`` and ``dcpo`` (entropy- and probability-dependent bounds) are in ``adaptive_bounds``;
  ``gmpo`` and ``soft_seq_po`` in ``geometric``; ``sapo`` in ``soft_gates``.

A token counts as *clipped* when the clip cuts its gradient: the min picks the clipped term with the
ratio outside the bounds (A > 0 and s > b_high: ``clip_high``; A < 0 and s < b_low: ``clip_low``),
or the dual clip is active (``clip_dual``). The mean log-ratio is clamped to +-20 before exp so that
a runaway ratio gives finite losses and gradients (docs/pitfalls.md#p3); beyond the clamp the
gradient is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_sspo.algorithms.losses.base import (
    LossTerms,
    PolicyLossConfig,
    check_eps,
    check_segmentation,
    config_error,
)
from nemo_sspo.algorithms.losses.inputs import LossInputs
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP, segment_mean


@dataclass(frozen=True)
class TokenTransform:
    """phi(d_t) of the engine, ``[B, T]``: transformed log-ratio (differentiable), tokens whose
    log-ratio was clipped below / above (bool or None), and the gate's gradient factor (or None).
    """

    log_ratio: torch.Tensor
    clip_low: torch.Tensor | None = None
    clip_high: torch.Tensor | None = None
    gate_weight: torch.Tensor | None = None


@dataclass(frozen=True)
class Surrogate:
    """psi of the engine, ``[B, T]``: objective (differentiable, to maximise), clip flags, bounds
    (None when the surrogate has none) and the soft gate's gradient factor (or None).
    """

    objective: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_dual: torch.Tensor
    b_low: torch.Tensor | None = None
    b_high: torch.Tensor | None = None
    gate_weight: torch.Tensor | None = None


@dataclass(frozen=True)
class BoundsContext:
    """What bounds may depend on, ``[B, T]``, no gradient: the segment's mean old-policy entropy
    H_ij (SSPO eq. 13; None without old entropy) and the token's old log-prob (DCPO).
    """

    segment_entropy: torch.Tensor | None
    old_logprobs: torch.Tensor


class Transform(Protocol):
    """phi, the engine's per-token transform: ``transform(log_ratio [B, T], adv [B, 1])``."""

    def __call__(self, log_ratio: torch.Tensor, adv: torch.Tensor) -> TokenTransform:
        """The transformed log-ratio of every token (differentiable) and its flags."""
        ...


class Bounds(Protocol):
    """Clip bounds of :class:`HardClip`: ``bounds(context) -> (b_low, b_high)``, each ``[B, T]``."""

    def __call__(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Lower and upper ratio bound at every token (no gradient)."""
        ...


class SurrogateFn(Protocol):
    """psi, the engine's surrogate: ``surrogate(ratio [B, T], adv [B, 1], context) -> Surrogate``."""

    def __call__(self, ratio: torch.Tensor, adv: torch.Tensor, context: BoundsContext) -> Surrogate:
        """The per-token objective to maximise (differentiable) and its clip flags."""
        ...


def identity_transform(log_ratio: torch.Tensor, adv: torch.Tensor) -> TokenTransform:
    """phi(d) = d (every loss but GMPO and Soft Sequence PO)."""
    return TokenTransform(log_ratio)


@dataclass(frozen=True)
class FixedBounds:
    """Bounds ``(1 - eps_low, 1 + eps_high)`` at every token."""

    eps_low: float
    eps_high: float

    def __call__(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1 - eps_low, 1 + eps_high)`` broadcast to ``[B, T]``."""
        shape = context.old_logprobs
        return torch.full_like(shape, 1.0 - self.eps_low), torch.full_like(shape, 1.0 + self.eps_high)


@dataclass(frozen=True)
class HardClip:
    """psi = min(s A, clip(s, b_low, b_high) A), then max(psi, c A) for A < 0 if c is set.

    ``bounds(context) -> (b_low, b_high)`` ``[B, T]``.
    """

    bounds: Bounds
    dual_clip_c: float | None = None

    def __call__(self, ratio: torch.Tensor, adv: torch.Tensor, context: BoundsContext) -> Surrogate:
        """The clipped objective (and dual clip) at every token, with its clip flags and bounds."""
        b_low, b_high = (b.to(ratio.dtype) for b in self.bounds(context))
        objective = torch.minimum(ratio * adv, torch.clamp(ratio, b_low, b_high) * adv)
        with torch.no_grad():
            clip_high = (adv > 0) & (ratio > b_high)
            clip_low = (adv < 0) & (ratio < b_low)
            dual = torch.zeros_like(clip_low)
        if self.dual_clip_c is not None:
            floor = self.dual_clip_c * adv
            dual = (adv < 0) & (objective.detach() < floor)
            objective = torch.where(dual, floor.expand_as(objective), objective)
        return Surrogate(objective, clip_low, clip_high, dual, b_low, b_high)


def unclipped(ratio: torch.Tensor, adv: torch.Tensor, context: BoundsContext) -> Surrogate:
    """The surrogate psi = s A with no clip (GMPO and Soft Sequence PO clip or gate inside phi instead)."""
    none = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
    return Surrogate(ratio * adv, none, none, none)


@dataclass(frozen=True)
class RatioEngine:
    """The shared objective (module docstring): ``engine(inputs, segments) -> LossTerms``.

    Attributes:
        surrogate: ``surrogate(ratio, adv, context) -> Surrogate`` (:class:`HardClip`,
            :func:`unclipped`, a soft gate).
        transform: ``transform(log_ratio, adv) -> TokenTransform`` (phi).
        token_gradient: GSPO-token's per-token gradient through the segment ratio.
    """

    surrogate: SurrogateFn
    transform: Transform = identity_transform
    token_gradient: bool = False

    def __call__(self, inputs: LossInputs, segments: torch.Tensor) -> LossTerms:
        """The shared objective's per-token terms of one micro-batch (module docstring)."""
        logprobs, mask = inputs.logprobs, inputs.response_mask
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        log_ratio = torch.where(mask, logprobs - inputs.old_logprobs.detach(), zero)
        adv = inputs.advantages.detach().to(logprobs.dtype).unsqueeze(1)
        token = self.transform(log_ratio, adv)
        mean_log_ratio, segment_length = segment_mean(token.log_ratio, segments, mask,
                                                     cp=inputs.context_parallel)
        clamped = mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        beyond_clamp = mean_log_ratio.detach().abs() > LOG_RATIO_CLAMP
        if self.token_gradient:
            # Past the clamp the token path is cut too, as for every ratio (docs/pitfalls.md#p3).
            own = torch.where(mask & ~beyond_clamp, logprobs - logprobs.detach(), zero)
            clamped = clamped.detach() + own
        ratio = torch.exp(clamped)
        context = _bounds_context(inputs, segments, ratio.dtype)
        psi = self.surrogate(ratio, adv, context)
        clip_low, clip_high = psi.clip_low, psi.clip_high
        if token.clip_low is not None:
            clip_low, clip_high = clip_low | token.clip_low, clip_high | token.clip_high
        grad_zero = clip_low | clip_high | psi.clip_dual | beyond_clamp
        return LossTerms(
            per_token_loss=torch.where(mask, -psi.objective, zero.to(psi.objective.dtype)),
            response_mask=mask,
            segments=segments,
            segment_length=segment_length,
            segment_entropy=context.segment_entropy,
            log_ratio=log_ratio.detach(),
            ratio=ratio.detach(),
            clip_low=clip_low & mask,
            clip_high=clip_high & mask,
            clip_dual=psi.clip_dual & mask,
            grad_zero=grad_zero & mask,
            b_low=psi.b_low,
            b_high=psi.b_high,
            gate_weight=token.gate_weight if token.gate_weight is not None else psi.gate_weight,
        )


@torch.no_grad()
def _bounds_context(inputs: LossInputs, segments: torch.Tensor, dtype) -> BoundsContext:
    mask = inputs.response_mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    segment_entropy = None
    if inputs.old_entropy is not None:
        segment_entropy, _ = segment_mean(inputs.old_entropy, segments, mask,
                                           cp=inputs.context_parallel)
        segment_entropy = segment_entropy.to(dtype)
    return BoundsContext(segment_entropy, torch.where(mask, inputs.old_logprobs.detach().to(dtype), zero))


def check_dual_clip(config) -> None:
    """Check ``config.dual_clip_c`` is None or > 1 (a floor c A below A for A < 0).

    Raises:
        ValueError: ``<ConfigClass>.dual_clip_c=<value> must be > 1 (or None)``.
    """
    if config.dual_clip_c is not None and config.dual_clip_c <= 1.0:
        raise config_error(config, f"dual_clip_c={config.dual_clip_c} must be > 1 (or None)")


@dataclass
class GRPOLossConfig(PolicyLossConfig):
    """GRPO (DeepSeekMath, arXiv 2402.03300): token ratio, PPO clip, optional dual clip."""

    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)


@dataclass
class DrGRPOLossConfig(PolicyLossConfig):
    """Dr. GRPO (arXiv 2503.20783): GRPO's clip, constant denominator L_max, advantages r - mean."""

    aggregation: str = "constant-denominator"
    """Sum of token losses / L_max per response, averaged over responses (section 3.2)."""
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - eps_low (GRPO's)."""
    eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + eps_high (GRPO's)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""

    def __post_init__(self) -> None:
        """Check the shared fields, the clip range and the dual clip."""
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)


@dataclass
class DAPOLossConfig(PolicyLossConfig):
    """DAPO (arXiv 2503.14476 eq. 8): decoupled clip-higher bounds, token-level mean."""

    aggregation: str = "token-mean"
    """Token-level policy-gradient loss (section 3.3)."""
    eps_low: float = 0.2
    """Lower clip 1 - eps_low (section 3.1 keeps GRPO's 0.2)."""
    eps_high: float = 0.28
    """Upper clip 1 + eps_high ("clip-higher", section 3.1)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""

    def __post_init__(self) -> None:
        """Check the shared fields, the clip range and the dual clip."""
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)


@dataclass
class GSPOLossConfig(PolicyLossConfig):
    """GSPO and GSPO-token (arXiv 2507.18071): sequence ratio exp(mean_t d_t) with a tight fixed
    clip (GSPO-token differs only in its gradient path, fixed at registration).
    """

    eps_low: float = 3e-4
    """Lower clip of the sequence ratio: 1 - eps_low (sequence ratios stay near 1,
    docs/pitfalls.md#p5)."""
    eps_high: float = 4e-4
    """Upper clip of the sequence ratio: 1 + eps_high."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")


@dataclass
class SSPOFixedClipConfig(PolicyLossConfig):
    """SSPO (arXiv 2511.04256) ratio with a fixed clip: the paper's "w/o entropy clip" ablation."""

    segmentation: str = "newline"
    """Segment unit of the ratio (``nemo_sspo.algorithms.segmentation.SEGMENTATIONS``)."""
    segment_k: int | None = None
    """Tokens per segment for segmentation "fixed_k"; None otherwise."""
    eps_low: float = 0.2
    """Lower clip of the segment ratio: 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip of the segment ratio: 1 + eps_high."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_segmentation(self)
        check_eps(self, "eps_low", "eps_high")


@dataclass
class LPOLossConfig(PolicyLossConfig):
    """LPO (Ling 2.0 report, arXiv 2510.22115, section 4.2.2): sentence ratio, clip 1 -/+ 0.03,
    token-mean aggregation.

    The report's objective: J = 1 / (sum_i |y_i|) sum_i sum_k |s_ik| min(r_ik A_i,
    clip(r_ik, 1 - eps, 1 + eps) A_i), r_ik = exp(mean of the token log-ratios of sentence s_ik),
    sentences "segmented by common pause punctuation marks after detokenization", eps = 0.03 "in
    our training setting". The mark list is ours (``segmentation`` "pause_punctuation"). The
    earlier line-segment variant stays reachable: ``segmentation=newline eps_low=0.2
    eps_high=0.2``.
    """

    aggregation: str = "token-mean"
    """The report's 1 / sum_i |y_i| normalisation: every token weighs the same across the batch."""
    segmentation: str = "pause_punctuation"
    """Sentence unit: split after pause punctuation (report section 4.2.2)."""
    segment_k: int | None = None
    """Tokens per segment for segmentation "fixed_k"; None otherwise."""
    eps_low: float = 0.03
    """Lower clip of the sentence ratio: 1 - eps (report: eps = 0.03)."""
    eps_high: float = 0.03
    """Upper clip of the sentence ratio: 1 + eps (symmetric, report: eps = 0.03)."""

    def __post_init__(self) -> None:
        """Check the shared fields, the segment unit and the clip range."""
        super().__post_init__()
        check_segmentation(self)
        check_eps(self, "eps_low", "eps_high")


@dataclass
class SequencePPOLossConfig(PolicyLossConfig):
    """SPPO, sequence-level PPO (arXiv 2604.08865): PPO's clipped ratio objective whose advantage is
    one scalar per response, A_i = r_i - sigmoid(V(x_i)), with V a learned value of the prompt alone
    (a critic trained by binary cross-entropy on the 0/1 reward; the trainer computes A_i because
    ``advantage_source = "critic"``). The critic is the baseline, so one sample per prompt is enough.

    Defaults are those of the official code (sustech-nlp/SPPO, run_scripts/*.sh on verl): the runs
    set no clip, aggregation or dual clip, so verl's actor defaults apply: the "vanilla" PPO loss on
    the token ratio with clip 1 -/+ 0.2, dual clip c = 3 for A < 0, "token-mean" aggregation.
    ``segmentation: response`` (one sequence ratio per response; then use GSPO-sized eps,
    docs/pitfalls.md#p5) is our variant.
    """

    aggregation: str = "token-mean"
    """verl's default loss_agg_mode, kept by the official runs."""
    segmentation: str = "token"
    """Ratio unit (``nemo_sspo.algorithms.segmentation.SEGMENTATIONS``): "token" (PPO) or "response"."""
    segment_k: int | None = None
    """Tokens per segment for segmentation "fixed_k"; None otherwise."""
    eps_low: float = 0.2
    """Lower clip: 1 - eps_low (verl's clip_ratio_low default)."""
    eps_high: float = 0.2
    """Upper clip: 1 + eps_high (verl's clip_ratio_high default)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip constant c > 1: the loss of an A < 0 token is at most -c A (verl's clip_ratio_c
    default, which the official runs keep); None disables."""

    def __post_init__(self) -> None:
        """Check the shared fields, the segment unit, the clip range and the dual clip."""
        super().__post_init__()
        check_segmentation(self)
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)


def _fixed_clip(config) -> RatioEngine:
    return RatioEngine(HardClip(FixedBounds(config.eps_low, config.eps_high)))


def _fixed_clip_dual(config) -> RatioEngine:
    return RatioEngine(HardClip(FixedBounds(config.eps_low, config.eps_high), config.dual_clip_c))


for _record in (
    LossRecord("grpo", GRPOLossConfig, _fixed_clip_dual, unit="token"),
    LossRecord("dr_grpo", DrGRPOLossConfig, _fixed_clip_dual, unit="token", normalize_std=False),
    LossRecord("dapo", DAPOLossConfig, _fixed_clip_dual, unit="token", dynamic_sampling=True),
    LossRecord("gspo", GSPOLossConfig, _fixed_clip, unit="response"),
    LossRecord("gspo_token", GSPOLossConfig,
               lambda c: RatioEngine(HardClip(FixedBounds(c.eps_low, c.eps_high)), token_gradient=True),
               unit="response"),
    LossRecord("sspo_fixed_clip", SSPOFixedClipConfig, _fixed_clip),
    LossRecord("lpo", LPOLossConfig, _fixed_clip),
    LossRecord("sppo", SequencePPOLossConfig, _fixed_clip_dual, advantage_source="critic"),
):
    register_policy_loss(_record)
