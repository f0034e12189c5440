"""Pure-torch algorithms: segmentation, segment ratios, clip bounds, advantages, aggregation, KL
estimators, DAPO's group selection and overlong shaping, the advantage-estimator and policy-loss
registries. No process groups, no Megatron, no Hydra: usable in any GRPO loop.

Shape letters: B responses (rows), T response positions, V vocabulary, G responses per prompt.
"""

from nemo_sspo.algorithms.advantage_estimators import (
    ADVANTAGE_SCOPES,
    AdvantageEstimator,
    AdvantageInputs,
    ScopeStats,
    advantage_estimator_names,
    estimate_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from nemo_sspo.algorithms.advantages import (
    PromptRewardStats,
    group_advantages,
    smooth_group_advantages,
    zero_variance_groups,
)
from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES, aggregate
from nemo_sspo.algorithms.bounds import LOWER_BOUND_RULES, entropy_adaptive_bounds
from nemo_sspo.algorithms.dynamic_sampling import select_nonzero_variance_groups
from nemo_sspo.algorithms.kl import KL_ESTIMATORS, kl_estimate
from nemo_sspo.algorithms.losses import (
    LossInputs,
    PolicyLoss,
    PolicyLossConfig,
    compute_policy_loss,
    make_policy_loss,
    policy_loss_names,
    policy_loss_sums,
)
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP, segment_mean
from nemo_sspo.algorithms.reward_shaping import overlong_reward_shaping
from nemo_sspo.algorithms.segmentation import (
    SEGMENTATIONS,
    SegmentTables,
    build_segment_tables,
    segment_ids,
)

__all__ = [
    "ADVANTAGE_SCOPES",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LOWER_BOUND_RULES",
    "SEGMENTATIONS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "LossInputs",
    "PolicyLoss",
    "PolicyLossConfig",
    "PromptRewardStats",
    "ScopeStats",
    "SegmentTables",
    "advantage_estimator_names",
    "aggregate",
    "build_segment_tables",
    "entropy_adaptive_bounds",
    "estimate_advantages",
    "get_advantage_estimator",
    "compute_policy_loss",
    "group_advantages",
    "kl_estimate",
    "overlong_reward_shaping",
    "make_policy_loss",
    "policy_loss_names",
    "policy_loss_sums",
    "register_advantage_estimator",
    "segment_ids",
    "segment_mean",
    "select_nonzero_variance_groups",
    "smooth_group_advantages",
    "zero_variance_groups",
]
