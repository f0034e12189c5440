"""Policy-loss registry and the registered losses (importing this package registers them)."""

from nemo_sspo.algorithms.losses.ratio_clip import (
    LOG_RATIO_CLAMP,
    GRPOLossConfig,
    GSPOLossConfig,
    SSPOFixedClipConfig,
    SSPOLossConfig,
    ratio_clip_loss,
)
from nemo_sspo.algorithms.losses.registry import (
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "GRPOLossConfig",
    "GSPOLossConfig",
    "SSPOFixedClipConfig",
    "SSPOLossConfig",
    "get_policy_loss",
    "policy_loss_names",
    "ratio_clip_loss",
    "register_policy_loss",
]
