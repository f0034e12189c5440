"""What every policy loss shares: the config base, input checks, the per-token terms a loss
produces, and the optional additive terms (reference KL, entropy bonus).

Every registered loss has the signature::

    fn(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy, config, *,
       ref_logprobs=None, entropy=None) -> (per_token_loss [B, T], metrics)

and returns a value TO MINIMISE. Optional additive per-token terms, usable by every loss (config
fields on :class:`PolicyLossConfig`):

    loss_t += kl_coef * k(log pi_ref(y_t) - log pi_theta(y_t)) - entropy_coef * H_theta(t)

with ``k`` the k1/k2/k3 estimator of KL(pi_theta || pi_ref) (:mod:`nemo_sspo.algorithms.kl`;
GRPO's penalty is k3, DeepSeekMath arXiv 2402.03300 eq. 4) and ``H_theta`` the current policy's
token entropy over the full vocabulary (with gradient). Both go through the loss's aggregation
mode like the policy term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from nemo_sspo.algorithms.aggregation import _RENAMED as RENAMED_AGGREGATIONS
from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES
from nemo_sspo.algorithms.kl import KL_ESTIMATORS, kl_estimate
from nemo_sspo.algorithms.losses.metrics import pair, policy_metrics
from nemo_sspo.algorithms.segmentation import SEGMENTATIONS, segment_ids_for_level


def config_error(config, message: str) -> ValueError:
    """``ValueError`` whose message starts with the config class name (``GRPOLossConfig.x=...``)."""
    return ValueError(f"{type(config).__name__}.{message}")


def check_numeric_fields(config) -> None:
    """Check every ``float`` / ``int`` dataclass field of ``config`` holds a real number.

    A ``float`` field must be a finite ``int``/``float`` (not ``bool``: ``true`` would silently
    become 1.0; not NaN: every comparison with NaN is False, so range checks pass and the term is
    silently disabled or poisons the loss; not +-inf). An ``int`` field must be an ``int`` (not
    ``bool``). Fields annotated ``... | None`` may be None. Called by
    :meth:`PolicyLossConfig.__post_init__`, so every subclass that calls ``super().__post_init__()``
    gets it for all of its own fields too.

    Raises:
        ValueError: ``<ConfigClass>.<field>=<value>`` and what to set instead.
    """
    for f in fields(config):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        parts = {part.strip() for part in str(kind).split("|")}
        if "float" in parts:
            expected = "float"
        elif "int" in parts:
            expected = "int"
        else:
            continue
        value = getattr(config, f.name)
        if value is None and "None" in parts:
            continue
        if expected == "float":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value))
            need = "a finite real number (not NaN/inf, not a bool)"
        else:
            ok = isinstance(value, int) and not isinstance(value, bool)
            need = "an integer (not a bool)"
        if not ok:
            optional = " or None" if "None" in parts else ""
            raise config_error(config, f"{f.name}={value!r} ({type(value).__name__}) must be "
                                       f"{need}{optional}; set {f.name} to a number in its "
                                       "documented range")


def check_eps(config, low_name: str, high_name: str) -> None:
    """Check ``0 <= config.<low_name> <= 1`` and ``config.<high_name> >= 0`` (ratio bounds
    ``1 - low`` >= 0 and ``1 + high``)."""
    low, high = getattr(config, low_name), getattr(config, high_name)
    if not 0.0 <= low <= 1.0 or high < 0.0:
        raise config_error(config, f"{low_name}={low}, {high_name}={high}: need 0 <= {low_name} "
                                   f"<= 1 and {high_name} >= 0 (bounds 1 - {low_name} and 1 + "
                                   f"{high_name})")


@dataclass
class PolicyLossConfig:
    """Fields shared by every loss's config (each loss subclasses this with its own fields).

    Class attributes (fixed by the loss, overridden by a field where a loss lets users choose):
    ``segmentation`` names the unit of the loss's ratio (see
    :data:`nemo_sspo.algorithms.segmentation.SEGMENTATIONS`; "token" and "response" are computed
    from the mask, the others are read from the ``segment_ids`` argument, which the trainer builds
    with :func:`nemo_sspo.algorithms.segmentation.segment_ids` using ``segmentation`` and
    ``segment_k``). ``advantage_source`` tells the trainer where the per-response advantages come
    from: ``"group"`` (group-relative, ``group_advantages``) or ``"critic"`` (SPPO:
    ``r - sigmoid(V(prompt))`` from a learned prompt-value critic).
    """

    segmentation: ClassVar[str] = "token"
    segment_k: ClassVar[int | None] = None
    advantage_source: ClassVar[str] = "group"

    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate`` (one of ``AGGREGATION_MODES``)."""
    advantage_std_normalisation: bool = True
    """Read by the trainer: divide group-centred rewards by the group std (GRPO) or not (Dr. GRPO);
    passed as ``group_advantages(..., normalize_std=...)``."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(pi_theta || pi_ref) penalty; > 0 needs ``ref_logprobs``."""
    kl_estimator: str = "k3"
    """KL estimator for the reference penalty and ``policy/kl_ref``: "k1", "k2" or "k3"."""
    entropy_coef: float = 0.0
    """Weight of the per-token entropy bonus (subtracted from the loss); > 0 needs ``entropy``."""

    def __post_init__(self) -> None:
        """Validate the shared fields; subclasses must call ``super().__post_init__()`` first.

        Every ``float`` field (this class's and the subclass's) must be a finite real number and
        every ``int`` field an integer, neither a bool (:func:`check_numeric_fields`).
        """
        check_numeric_fields(self)
        if self.aggregation not in AGGREGATION_MODES:
            renamed = RENAMED_AGGREGATIONS.get(self.aggregation)
            hint = (f" (this mode is called {renamed!r} here; set aggregation={renamed})"
                    if renamed else "")
            raise config_error(self, f"aggregation={self.aggregation!r}{hint}; valid modes: "
                                     f"{AGGREGATION_MODES}")
        if not isinstance(self.advantage_std_normalisation, bool):
            raise config_error(self, f"advantage_std_normalisation="
                                     f"{self.advantage_std_normalisation!r} must be true or false")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise config_error(self, f"kl_estimator={self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise config_error(self, f"kl_coef={self.kl_coef} and entropy_coef="
                                     f"{self.entropy_coef} must be >= 0 (0 disables the term)")
        self._check_segmentation()

    def _check_segmentation(self) -> None:
        if self.segmentation not in SEGMENTATIONS:
            raise config_error(self, f"segmentation={self.segmentation!r}; valid: {SEGMENTATIONS}")
        if self.segmentation == "fixed_k":
            if not isinstance(self.segment_k, int) or self.segment_k < 1:
                raise config_error(self, f"segment_k={self.segment_k!r}: segmentation 'fixed_k' "
                                         "needs an int segment_k >= 1")
        elif self.segment_k is not None:
            raise config_error(self, f"segment_k={self.segment_k!r} is only read by segmentation "
                                     f"'fixed_k', not {self.segmentation!r}; remove it")


def resolve_segments(config: PolicyLossConfig, response_mask, segment_ids) -> torch.Tensor:
    """The loss's segments: computed from the mask for "token"/"response", else ``segment_ids``."""
    if config.segmentation == "token":
        return segment_ids_for_level("token", response_mask)
    if config.segmentation == "response":
        return segment_ids_for_level("sequence", response_mask)
    return segment_ids_for_level("subsentence", response_mask, segment_ids)


def check_segment_id_range(segment_ids: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Check ``0 <= segment_ids < T`` at valid positions (``[B, T]``; masked ones are not read).

    Segments are numbered within a row, so a row has at most T of them: an id >= T would be
    merged with a segment of the next row, and -1 at a valid token would be folded into another
    segment, both silently. One device-to-host sync (min and max together).

    Raises:
        ValueError: naming ``segment_ids``, the offending value and the expected range.
    """
    if not bool(response_mask.any()):
        return
    length = segment_ids.shape[-1]
    ids = segment_ids[response_mask]
    low, high = torch.stack([ids.min(), ids.max()]).tolist()
    if low < 0 or high >= length:
        raise ValueError(f"segment_ids at valid tokens range over [{low}, {high}] but must lie in "
                         f"[0, T - 1] = [0, {length - 1}] (per-row segment numbers; -1 only at "
                         "masked positions): build them with "
                         "nemo_sspo.algorithms.segmentation.segment_ids")


def check_loss_inputs(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy,
                      config, config_type: type, *, ref_logprobs, entropy) -> None:
    """Shapes, dtypes, config type, and the optional tensors the config's coefficients need.

    When the config's segmentation reads ``segment_ids`` (not "token"/"response"), their range at
    valid positions is checked too (:func:`check_segment_id_range`, one host sync).

    Raises:
        ValueError: naming the argument, both shapes, or the config field and the fix.
    """
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a float [B, T] tensor, got {tuple(logprobs.shape)} "
                         f"{logprobs.dtype}")
    named = {"old_logprobs": old_logprobs, "response_mask": response_mask,
             "segment_ids": segment_ids, "old_entropy": old_entropy,
             "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logprobs has shape "
                             f"{tuple(logprobs.shape)}; both must be [B, T]")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)} but logprobs has shape "
                         f"{tuple(logprobs.shape)}; advantages must be [B]")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be torch.bool, got {response_mask.dtype}")
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor, got {segment_ids.dtype}")
    if not isinstance(config, config_type):
        raise ValueError(f"config must be a {config_type.__name__} (the config class registered "
                         f"with this loss), got {type(config).__name__}")
    if config.segmentation not in ("token", "response"):
        check_segment_id_range(segment_ids, response_mask)
    if config.kl_coef > 0 and ref_logprobs is None:
        raise config_error(config, f"kl_coef={config.kl_coef} needs ref_logprobs= ([B, T] log-probs "
                                   "of the reference policy); pass them or set kl_coef=0")
    if config.entropy_coef > 0 and entropy is None:
        raise config_error(config, f"entropy_coef={config.entropy_coef} needs entropy= ([B, T] "
                                   "current-policy token entropy); pass it or set entropy_coef=0")


@dataclass(frozen=True)
class LossTerms:
    """A loss's per-token result before the additive terms; all ``[B, T]``.

    Attributes:
        per_token_loss: value to minimise (differentiable), 0 at masked positions.
        response_mask: bool, valid tokens.
        segments: int64 ids of the loss's ratio segments (-1 masked).
        segment_length: float, token count of each token's segment (0 masked).
        segment_entropy: float, mean old-policy entropy over each token's segment (eq. 13).
        log_ratio: detached token log-ratio d_t = log pi_theta - log pi_old (0 masked).
        ratio: detached ratio the loss applies to each token (segment/sequence/token ratio).
        clip_low / clip_high / clip_dual: bool, the token's ratio (or its IS weight) was clipped
            at the lower / upper bound, or the dual clip was active.
        grad_zero: bool, the loss's clip/selection removed the token's gradient.
        b_low / b_high: clip bounds at each token, or None for losses without bounds.
        gate_weight: factor by which a soft gate scales the token's gradient, or None.
        extra_metrics: loss-specific (sum, count) pairs.
    """

    per_token_loss: torch.Tensor
    response_mask: torch.Tensor
    segments: torch.Tensor
    segment_length: torch.Tensor
    segment_entropy: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_dual: torch.Tensor
    grad_zero: torch.Tensor
    b_low: torch.Tensor | None = None
    b_high: torch.Tensor | None = None
    gate_weight: torch.Tensor | None = None
    extra_metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def finish_policy_loss(terms: LossTerms, config: PolicyLossConfig, *, logprobs, old_entropy,
                       ref_logprobs, entropy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the reference-KL and entropy terms and build the metrics (module docstring).

    ``ref_logprobs`` / ``entropy`` given with a zero coefficient are still reported
    (``policy/kl_ref``, ``policy/entropy_current``).
    """
    mask = terms.response_mask
    per_token = terms.per_token_loss
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    metrics = policy_metrics(terms, old_entropy.detach())
    tokens = mask.sum()
    if ref_logprobs is not None:
        # Mask before the estimator: NaN padding must not reach exp (0 * NaN in backward).
        log_ref_ratio = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs,
                                    zero.to(logprobs.dtype))
        kl = kl_estimate(log_ref_ratio, config.kl_estimator)  # 0 at masked positions
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
        metrics["policy/kl_ref"] = pair(kl.detach().sum(), tokens)
    if entropy is not None:
        bonus = torch.where(mask, entropy.to(per_token.dtype), zero)
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * bonus
        metrics["policy/entropy_current"] = pair(bonus.detach().sum(), tokens)
    return per_token, metrics
