"""Pure-torch algorithms: segmentation, segment ratios, clip bounds, advantages, aggregation and
the policy-loss registry. No process groups, no Megatron, no Hydra: usable in any GRPO loop."""

from nemo_sspo.algorithms.advantages import group_advantages
from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES, aggregate
from nemo_sspo.algorithms.bounds import LOWER_BOUND_RULES, entropy_adaptive_bounds
from nemo_sspo.algorithms.losses import (
    GRPOLossConfig,
    GSPOLossConfig,
    SSPOFixedClipConfig,
    SSPOLossConfig,
    get_policy_loss,
    policy_loss_names,
    ratio_clip_loss,
    register_policy_loss,
)
from nemo_sspo.algorithms.ratios import segment_mean
from nemo_sspo.algorithms.segmentation import (
    SEGMENT_LEVELS,
    build_boundary_table,
    newline_segment_ids,
    segment_ids_for_level,
)

__all__ = [
    "AGGREGATION_MODES",
    "LOWER_BOUND_RULES",
    "SEGMENT_LEVELS",
    "GRPOLossConfig",
    "GSPOLossConfig",
    "SSPOFixedClipConfig",
    "SSPOLossConfig",
    "aggregate",
    "build_boundary_table",
    "entropy_adaptive_bounds",
    "get_policy_loss",
    "group_advantages",
    "newline_segment_ids",
    "policy_loss_names",
    "ratio_clip_loss",
    "register_policy_loss",
    "segment_ids_for_level",
    "segment_mean",
]
