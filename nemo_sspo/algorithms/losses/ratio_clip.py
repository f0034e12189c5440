"""Ratio-clip policy losses on one code path: GRPO, GSPO, SSPO and SSPO with a fixed clip.

Objective (SSPO, arXiv 2511.04256, eq. 16; the other losses change only the segments and bounds):

    J = (1/G) sum_i (1/|y_i|) sum_j |y_ij| * min( s_ij A_i, clip(s_ij, b_low, b_high) A_i )

- y_ij: segment j of response i, |y_ij| its token count; A_i the response's advantage (eq. 8).
- s_ij = exp( mean_{t in y_ij} (log pi_theta(y_t) - log pi_old(y_t)) ) (eq. 9).
- Segments by loss: ``grpo`` one token each (token ratio), ``gspo`` the whole response (sequence
  ratio, arXiv 2507.18071), ``sspo`` / ``sspo_fixed_clip`` line-break segments.
- Bounds: ``sspo`` uses the entropy-adaptive bounds of eqs. 13-15 (H_ij = mean old-policy token
  entropy of the segment, no gradient); the others use fixed ``[1 - eps_low, 1 + eps_high]``.
- ``grpo`` with ``dual_clip_c = c``: for A_i < 0 the objective is max(min(...), c A_i)
  (dual-clip PPO, Ye et al. 2020, arXiv 1912.09729).

The per-token loss is the value TO MINIMISE: ``-min(s A, clip(s) A)`` at every token of the
segment, 0 at masked positions. Summing a segment's tokens gives |y_ij| times the segment term,
so ``aggregate(..., "seq-mean-token-mean")`` yields exactly -J, and every token of a segment gets
the same gradient weight s_ij A_i / |y_i| (eq. 10).

A token counts as *clipped* when its clip cuts the gradient: the min picks the clipped term with
the ratio outside the bounds (A > 0 and s > b_high, or A < 0 and s < b_low), or the dual clip is
active. The mean log-ratio is clamped to +-20 before exp so that a runaway ratio gives finite
losses and gradients (pitfall P3); beyond the clamp the gradient is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES
from nemo_sspo.algorithms.bounds import LOWER_BOUND_RULES, entropy_adaptive_bounds
from nemo_sspo.algorithms.losses.registry import register_policy_loss
from nemo_sspo.algorithms.ratios import segment_mean
from nemo_sspo.algorithms.segmentation import segment_ids_for_level

LOG_RATIO_CLAMP = 20.0
"""|mean log-ratio| cap before exp: exp(20) ~ 4.9e8 stays finite in float32 and bf16."""


class _RatioClipConfig:
    """Behaviour shared by the configs of this module: segment level, bounds, validation."""

    level: ClassVar[str]
    dual_clip_c: ClassVar[float | None] = None

    def clip_bounds(self, segment_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed bounds ``(1 - eps_low, 1 + eps_high)`` broadcast like ``segment_entropy``."""
        return (
            torch.full_like(segment_entropy, 1.0 - self.eps_low),
            torch.full_like(segment_entropy, 1.0 + self.eps_high),
        )

    def _validate_aggregation(self) -> None:
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(
                f"{type(self).__name__}.aggregation={self.aggregation!r}; valid modes: "
                f"{AGGREGATION_MODES}"
            )

    def _validate_eps(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(
                f"{type(self).__name__} needs 0 <= eps_low < 1 and eps_high >= 0, got "
                f"eps_low={self.eps_low}, eps_high={self.eps_high}"
            )


@dataclass
class GRPOLossConfig(_RatioClipConfig):
    """GRPO (DeepSeekMath, arXiv 2402.03300): token ratio, PPO clip, optional dual clip."""

    level: ClassVar[str] = "token"
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: the ratio is clipped above at 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""
    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate`` (one of ``AGGREGATION_MODES``)."""

    def __post_init__(self) -> None:
        self._validate_eps()
        self._validate_aggregation()
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"GRPOLossConfig.dual_clip_c must be > 1, got {self.dual_clip_c}")


@dataclass
class GSPOLossConfig(_RatioClipConfig):
    """GSPO (arXiv 2507.18071): sequence ratio exp(mean_t d_t) with a tight fixed clip."""

    level: ClassVar[str] = "sequence"
    eps_low: float = 3e-4
    """Lower clip of the sequence ratio: 1 - eps_low (sequence ratios stay near 1, pitfall P5)."""
    eps_high: float = 4e-4
    """Upper clip of the sequence ratio: 1 + eps_high."""
    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate`` (one of ``AGGREGATION_MODES``)."""

    def __post_init__(self) -> None:
        self._validate_eps()
        self._validate_aggregation()


@dataclass
class SSPOLossConfig(_RatioClipConfig):
    """SSPO (arXiv 2511.04256): subsentence ratio (eq. 9), entropy-adaptive bounds (eqs. 13-15).

    Paper settings: 1.5B alpha=0, beta=0.8, gamma=1.75; 7B alpha=0.1, beta=0.8, gamma=2.2.
    """

    level: ClassVar[str] = "subsentence"
    alpha: float = 0.0
    """Upper-bound headroom: b_high = min(1 + alpha + H, gamma) (eq. 14)."""
    beta: float = 0.8
    """Lower-bound cap: b_low = max(0, min(1 - H, beta)) (eq. 15)."""
    gamma: float = 1.75
    """Upper-bound cap (eq. 14)."""
    lower_bound: str = "eq15"
    """Lower-bound rule: "eq15" or "piecewise" (clip(1.3 - H, 0.3, beta))."""
    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate``; eq. 16 is "seq-mean-token-mean"."""

    def __post_init__(self) -> None:
        self._validate_aggregation()
        if self.lower_bound not in LOWER_BOUND_RULES:
            raise ValueError(
                f"SSPOLossConfig.lower_bound={self.lower_bound!r}; valid: {LOWER_BOUND_RULES}"
            )
        if self.alpha < 0.0 or not 0.0 <= self.beta <= 1.0 or self.gamma < 1.0:
            raise ValueError(
                "SSPOLossConfig needs alpha >= 0, 0 <= beta <= 1 and gamma >= 1 (so that "
                f"b_low <= 1 <= b_high), got alpha={self.alpha}, beta={self.beta}, "
                f"gamma={self.gamma}"
            )

    def clip_bounds(self, segment_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entropy-adaptive bounds of eqs. 14-15 from the segment entropy H_ij."""
        return entropy_adaptive_bounds(
            segment_entropy,
            alpha=self.alpha,
            beta=self.beta,
            gamma=self.gamma,
            lower=self.lower_bound,
        )


@dataclass
class SSPOFixedClipConfig(_RatioClipConfig):
    """SSPO ratio with a fixed clip: the paper's "SSPO w/o entropy clip" ablation."""

    level: ClassVar[str] = "subsentence"
    eps_low: float = 0.2
    """Lower clip of the subsentence ratio: 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip of the subsentence ratio: 1 + eps_high."""
    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate`` (one of ``AGGREGATION_MODES``)."""

    def __post_init__(self) -> None:
        self._validate_eps()
        self._validate_aggregation()


def _check_inputs(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy,
                  config) -> None:
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a float [B, T] tensor, got {tuple(logprobs.shape)} "
                         f"{logprobs.dtype}")
    named = {"old_logprobs": old_logprobs, "response_mask": response_mask,
             "segment_ids": segment_ids, "old_entropy": old_entropy}
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logprobs has shape "
                             f"{tuple(logprobs.shape)}; both must be [B, T]")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)} but logprobs has shape "
                         f"{tuple(logprobs.shape)}; advantages must be [B]")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be torch.bool, got {response_mask.dtype}")
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor, got {segment_ids.dtype}")
    if not isinstance(config, _RatioClipConfig):
        raise ValueError(f"config must be a ratio-clip loss config (e.g. SSPOLossConfig), got "
                         f"{type(config).__name__}")


def _metrics(response_mask, segment_length, ratio, b_low, b_high, is_clipped, old_entropy):
    """(sum, count) float32 pairs; the trainer all-reduces them and divides."""
    f32 = torch.float32
    valid = response_mask.to(f32)
    # Weight 1/|segment| per token: a per-segment quantity summed over tokens counts each segment
    # once, with no extra scatter.
    per_segment = valid / segment_length.to(f32).clamp(min=1)
    tokens, segments = valid.sum(), per_segment.sum()
    responses = response_mask.any(dim=1).sum().to(f32)
    clipped = is_clipped.to(f32)

    def pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return torch.stack([total.to(f32), count])

    zero = torch.zeros((), dtype=old_entropy.dtype, device=old_entropy.device)
    return {
        "policy/clipfrac_tokens": pair((clipped * valid).sum(), tokens),
        "policy/clipfrac_segments": pair((clipped * per_segment).sum(), segments),
        "policy/b_low": pair((b_low.to(f32) * per_segment).sum(), segments),
        "policy/b_high": pair((b_high.to(f32) * per_segment).sum(), segments),
        "policy/ratio": pair((ratio.to(f32) * per_segment).sum(), segments),
        "policy/segments_per_response": pair(segments, responses),
        "policy/entropy": pair(torch.where(response_mask, old_entropy, zero).sum(), tokens),
    }


@register_policy_loss("sspo_fixed_clip", SSPOFixedClipConfig)
@register_policy_loss("sspo", SSPOLossConfig)
@register_policy_loss("gspo", GSPOLossConfig)
@register_policy_loss("grpo", GRPOLossConfig)
def ratio_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    segment_ids: torch.Tensor,
    old_entropy: torch.Tensor,
    config: _RatioClipConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped-ratio loss (value to minimise) for GRPO / GSPO / SSPO (module docstring).

    Args:
        logprobs: ``[B, T]`` float32, natural-log probs of the sampled tokens under pi_theta
            (requires grad).
        old_logprobs: ``[B, T]`` float32, the same under the behaviour policy pi_old (constant).
        advantages: ``[B]`` float32, A_i per response (eq. 8; constant).
        response_mask: ``[B, T]`` bool, True at response tokens in the loss.
        segment_ids: ``[B, T]`` int64 newline segments from ``newline_segment_ids``; read only by
            the subsentence-level losses (``sspo``, ``sspo_fixed_clip``).
        old_entropy: ``[B, T]`` float32, old-policy token entropy H_t in nats over the full
            vocabulary (eq. 12; constant). Sets the SSPO bounds; reported by every loss.
        config: one of ``GRPOLossConfig``, ``GSPOLossConfig``, ``SSPOLossConfig``,
            ``SSPOFixedClipConfig``; it selects the segment level and the bounds.

    Returns:
        ``(per_token_loss [B, T], metrics)``: the loss is 0 at masked positions; metrics map
        ``policy/*`` keys to detached float32 ``[2]`` tensors ``(sum, count)``: clipfrac_tokens,
        clipfrac_segments, b_low, b_high, ratio (per segment), segments_per_response, entropy.

    Raises:
        ValueError: any shape mismatch (names both shapes), wrong mask/id dtype or config type.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy,
                  config)
    segments = segment_ids_for_level(config.level, response_mask, segment_ids)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), zero)
    mean_log_ratio, segment_length = segment_mean(log_ratio, segments, response_mask)
    ratio = torch.exp(mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    with torch.no_grad():
        segment_entropy, _ = segment_mean(old_entropy, segments, response_mask)
        b_low, b_high = config.clip_bounds(segment_entropy.to(ratio.dtype))
    adv = advantages.detach().to(ratio.dtype).unsqueeze(1)
    objective = torch.minimum(ratio * adv, torch.clamp(ratio, b_low, b_high) * adv)
    with torch.no_grad():
        is_clipped = ((adv > 0) & (ratio > b_high)) | ((adv < 0) & (ratio < b_low))
    if config.dual_clip_c is not None:
        floor = config.dual_clip_c * adv
        dual_active = (adv < 0) & (objective < floor)
        objective = torch.where(dual_active, floor, objective)
        is_clipped = is_clipped | dual_active
    per_token_loss = torch.where(response_mask, -objective, zero.to(objective.dtype))
    with torch.no_grad():
        metrics = _metrics(response_mask, segment_length, ratio, b_low, b_high,
                           is_clipped & response_mask, old_entropy.detach())
    return per_token_loss, metrics
