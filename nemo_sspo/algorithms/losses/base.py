"""What every policy loss shares: the config base, the per-token terms a loss produces, and the
optional additive terms (reference KL, entropy bonus).

A registered loss is a :class:`nemo_sspo.algorithms.losses.PolicyLoss`: bound to its config, it
maps :class:`nemo_sspo.algorithms.losses.LossInputs` to a ``LossOutput`` whose per-token loss is a
value TO MINIMISE. Optional additive per-token terms, usable by every loss (config fields on
:class:`PolicyLossConfig`):

    loss_t += kl_coef * k(log pi_ref(y_t) - log pi_theta(y_t)) - entropy_coef * H_theta(t)

with ``k`` the k1/k2/k3 estimator of KL(pi_theta || pi_ref) (:mod:`nemo_sspo.algorithms.kl`;
GRPO's penalty is k3, DeepSeekMath arXiv 2402.03300 eq. 4) and ``H_theta`` the current policy's
token entropy over the full vocabulary (with gradient). Both go through the loss's aggregation
mode like the policy term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from nemo_sspo.algorithms.aggregation import _RENAMED as RENAMED_AGGREGATIONS
from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES
from nemo_sspo.algorithms.kl import KL_ESTIMATORS, kl_estimate
from nemo_sspo.algorithms.losses.inputs import LossInputs
from nemo_sspo.algorithms.losses.metrics import policy_metrics
from nemo_sspo.algorithms.ratios import segment_mean
from nemo_sspo.algorithms.segmentation import SEGMENTATIONS, mask_segment_ids
from nemo_sspo.metrics import MetricPair, mean_pair


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
    ``1 - low`` >= 0 and ``1 + high``).
    """
    low, high = getattr(config, low_name), getattr(config, high_name)
    if not 0.0 <= low <= 1.0 or high < 0.0:
        raise config_error(config, f"{low_name}={low}, {high_name}={high}: need 0 <= {low_name} "
                                   f"<= 1 and {high_name} >= 0 (bounds 1 - {low_name} and 1 + "
                                   f"{high_name})")


@dataclass
class PolicyLossConfig:
    """Fields shared by every loss's config (each loss's config adds its own fields).

    A config is data only: what the loss computes with it is fixed at registration
    (:func:`nemo_sspo.algorithms.losses.register_policy_loss`), including a ratio unit that the
    loss does not let users change (GRPO's "token"). Defaults of every config are its paper's or
    official code's recipe (each field says which); the CPU demo overrides in its YAML.
    """

    aggregation: str = "seq-mean-token-mean"
    """Reduction mode passed to ``aggregate`` (one of ``AGGREGATION_MODES``)."""
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
        if self.kl_estimator not in KL_ESTIMATORS:
            raise config_error(self, f"kl_estimator={self.kl_estimator!r}; valid: {KL_ESTIMATORS}")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise config_error(self, f"kl_coef={self.kl_coef} and entropy_coef="
                                     f"{self.entropy_coef} must be >= 0 (0 disables the term)")


def check_segmentation(config) -> None:
    """Check a config's own ``segmentation`` / ``segment_k`` fields (losses whose unit is set by
    the user: SSPO, SSPO with a fixed clip, LPO, SPPO).

    Raises:
        ValueError: unknown strategy, or ``segment_k`` missing for / given without "fixed_k".
    """
    if config.segmentation not in SEGMENTATIONS:
        raise config_error(config, f"segmentation={config.segmentation!r}; valid: {SEGMENTATIONS}")
    if config.segmentation == "fixed_k":
        if not isinstance(config.segment_k, int) or config.segment_k < 1:
            raise config_error(config, f"segment_k={config.segment_k!r}: segmentation 'fixed_k' "
                                       "needs an int segment_k >= 1")
    elif config.segment_k is not None:
        raise config_error(config, f"segment_k={config.segment_k!r} is only read by segmentation "
                                   f"'fixed_k', not {config.segmentation!r}; remove it")


def resolve_segments(segmentation: str, inputs: LossInputs) -> torch.Tensor:
    """``[B, T]`` int64 ids of the loss's ratio segments: computed from the mask for "token" and
    "response", else ``inputs.segment_ids`` after a range check.

    Under context parallelism (``inputs.context_parallel``) ids are those of the unsplit row: a
    "token" segment is numbered by its global position (ids unique over the CP group), a
    "response" segment is 0 on every rank, and ``segment_ids`` must lie in ``[0, S)``.

    Raises:
        ValueError: ``segment_ids`` missing for a text-based unit, or out of range.
    """
    mask, cp = inputs.response_mask, inputs.context_parallel
    if segmentation == "token" and cp is not None:
        position = cp.positions.to(mask.device)[None, :].expand(mask.shape)
        return torch.where(mask, position, torch.full_like(position, -1))
    if segmentation in ("token", "response"):
        return mask_segment_ids(segmentation, mask)
    if inputs.segment_ids is None:
        raise ValueError(f"LossInputs.segment_ids is None but this loss's ratio unit is "
                         f"{segmentation!r}: build them with "
                         "nemo_sspo.algorithms.segmentation.segment_ids")
    check_segment_id_range(inputs.segment_ids, mask, width=None if cp is None else cp.width)
    return torch.where(mask, inputs.segment_ids.long(), torch.full_like(mask, -1, dtype=torch.long))


def check_segment_id_range(segment_ids: torch.Tensor, response_mask: torch.Tensor, *,
                           width: int | None = None) -> None:
    """Check ``0 <= segment_ids < T`` at valid positions (``[B, T]``; masked ones are not read).

    ``width``: the unsplit row width S under context parallelism (ids then lie in ``[0, S)``);
    None: T.

    Segments are numbered within a row, so a row has at most T of them: an id >= T would be
    merged with a segment of the next row, and -1 at a valid token would be folded into another
    segment, both silently. One device-to-host sync (min and max together).

    Raises:
        ValueError: naming ``segment_ids``, the offending value and the expected range.
    """
    if not bool(response_mask.any()):
        return
    length = segment_ids.shape[-1] if width is None else width
    ids = segment_ids[response_mask]
    low, high = torch.stack([ids.min(), ids.max()]).tolist()
    if low < 0 or high >= length:
        raise ValueError(f"segment_ids at valid tokens range over [{low}, {high}] but must lie in "
                         f"[0, T - 1] = [0, {length - 1}] (per-row segment numbers; -1 only at "
                         "masked positions): build them with "
                         "nemo_sspo.algorithms.segmentation.segment_ids")


def check_optional_inputs(config: PolicyLossConfig, inputs: LossInputs) -> None:
    """The optional tensors the config's coefficients need.

    Raises:
        ValueError: naming the config field and the missing ``LossInputs`` field.
    """
    if config.kl_coef > 0 and inputs.ref_logprobs is None:
        raise config_error(config, f"kl_coef={config.kl_coef} needs LossInputs.ref_logprobs "
                                   "([B, T] log-probs of the reference policy); pass them or set "
                                   "kl_coef=0")
    if config.entropy_coef > 0 and inputs.entropy is None:
        raise config_error(config, f"entropy_coef={config.entropy_coef} needs LossInputs.entropy "
                                   "([B, T] current-policy token entropy); pass it or set "
                                   "entropy_coef=0")


@dataclass(frozen=True)
class LossTerms:
    """A loss's per-token result before the additive terms; all ``[B, T]``.

    Only the first five fields are required: an objective without clip bounds, a gate or a
    selection leaves the rest at their defaults (no token clipped, no gradient zeroed).

    Attributes:
        per_token_loss: value to minimise (differentiable), 0 at masked positions.
        response_mask: bool, valid tokens: ``LossInputs.response_mask`` itself (the denominator
            of the aggregation counts that mask; another mask is refused when the loss is called).
        segments: int64 ids of the loss's ratio segments (-1 masked).
        log_ratio: detached token log-ratio d_t = log pi_theta - log pi_old (0 masked).
        ratio: detached ratio (or weight) the loss applies to each token.
        segment_length: float, token count of each token's segment (0 masked); None: counted
            from ``segments``.
        segment_entropy: float, mean old-policy entropy over each token's segment (eq. 13), or
            None: computed from ``LossInputs.old_entropy`` when the inputs carry it.
        clip_low / clip_high / clip_dual: bool, the token's ratio (or its IS weight) was clipped
            at the lower / upper bound, or the dual clip was active; None: never.
        grad_zero: bool, the loss's clip/selection removed the token's gradient; None: never.
        b_low / b_high: clip bounds at each token, or None for losses without bounds.
        gate_weight: factor by which a soft gate scales the token's gradient, or None.
        extra_metrics: loss-specific ``MetricPair`` s (:mod:`nemo_sspo.metrics`) by metric key,
            logged beside the shared ones (summed over micro-batches and data-parallel ranks, then
            reported as total / count); a key the shared metrics already use is refused.
    """

    per_token_loss: torch.Tensor
    response_mask: torch.Tensor
    segments: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    segment_length: torch.Tensor | None = None
    segment_entropy: torch.Tensor | None = None
    clip_low: torch.Tensor | None = None
    clip_high: torch.Tensor | None = None
    clip_dual: torch.Tensor | None = None
    grad_zero: torch.Tensor | None = None
    b_low: torch.Tensor | None = None
    b_high: torch.Tensor | None = None
    gate_weight: torch.Tensor | None = None
    extra_metrics: dict[str, MetricPair] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Fill the defaulted flags (all False) and the segment lengths (from ``segments``)."""
        never = torch.zeros_like(self.response_mask)
        for name in ("clip_low", "clip_high", "clip_dual", "grad_zero"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, never)
        if self.segment_length is None:
            ones = self.response_mask.to(self.ratio.dtype)
            # Under context parallelism ids reach the unsplit width S > T: the clamp keeps the
            # local count in range; finish_policy_loss recounts every segment over the CP group.
            ids = self.segments.clamp(max=max(self.segments.shape[-1] - 1, 0))
            object.__setattr__(self, "segment_length",
                               segment_mean(ones, ids, self.response_mask)[1])


def finish_policy_loss(terms: LossTerms, config: PolicyLossConfig,
                       inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the reference-KL and entropy terms and build the metrics (module docstring).

    ``inputs.ref_logprobs`` / ``inputs.entropy`` given with a zero coefficient are still reported
    (``policy/kl_ref``, ``policy/entropy_current``). Under context parallelism the segment lengths
    are recounted over the CP group (a loss's own ``LossTerms`` may have counted local columns
    only) and the metric pairs are this rank's share (reduced in ``policy_loss_sums``).
    """
    mask, logprobs, cp = terms.response_mask, inputs.logprobs, inputs.context_parallel
    per_token = terms.per_token_loss
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    if cp is not None:
        ones = mask.to(terms.ratio.dtype)
        terms = replace(terms, segment_length=segment_mean(ones, terms.segments, mask, cp=cp)[1])
    old_entropy = None if inputs.old_entropy is None else inputs.old_entropy.detach()
    if old_entropy is not None and terms.segment_entropy is None:
        entropy, _ = segment_mean(old_entropy, terms.segments, mask, cp=cp)
        terms = replace(terms, segment_entropy=entropy)
    metrics = policy_metrics(terms, old_entropy, cp=cp)
    tokens = mask.sum()
    if inputs.ref_logprobs is not None:
        # Mask before the estimator: NaN padding must not reach exp (0 * NaN in backward).
        log_ref_ratio = torch.where(mask, inputs.ref_logprobs.detach().to(logprobs.dtype) - logprobs,
                                    zero.to(logprobs.dtype))
        kl = kl_estimate(log_ref_ratio, config.kl_estimator)  # 0 at masked positions
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
        metrics["policy/kl_ref"] = mean_pair(kl.detach().sum(), tokens)
    if inputs.entropy is not None:
        bonus = torch.where(mask, inputs.entropy.to(per_token.dtype), zero)
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * bonus
        metrics["policy/entropy_current"] = mean_pair(bonus.detach().sum(), tokens)
    return per_token, metrics
