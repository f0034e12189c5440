"""Policy-loss registry and the registered losses (importing this package registers them).

Registered names: grpo, dr_grpo, dapo, gspo, gspo_token, sspo, sspo_fixed_clip, lpo, sppo, dcpo,
gmpo, sapo, soft_seq_po (all on the shared segment-ratio engine :func:`ratio_clip_loss`), cispo
(:func:`cispo_loss`), clip_cov and kl_cov (:func:`covariance_policy_loss`).
"""

from nemo_sspo.algorithms.losses.adaptive_bounds import DCPOLossConfig, SSPOLossConfig
from nemo_sspo.algorithms.losses.base import LossTerms, PolicyLossConfig
from nemo_sspo.algorithms.losses.cispo import CISPOLossConfig, cispo_loss
from nemo_sspo.algorithms.losses.covariance import (
    ClipCovLossConfig,
    KLCovLossConfig,
    covariance_policy_loss,
    select_high_covariance_tokens,
    select_random_covariance_tokens,
)
from nemo_sspo.algorithms.losses.geometric import GMPOLossConfig, SoftSeqPOLossConfig
from nemo_sspo.algorithms.losses.ratio_clip import (
    DAPOLossConfig,
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    GSPOTokenLossConfig,
    LPOLossConfig,
    RatioLossConfig,
    SequencePPOLossConfig,
    SSPOFixedClipConfig,
    ratio_clip_loss,
)
from nemo_sspo.algorithms.losses.registry import (
    build_policy_loss_config,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from nemo_sspo.algorithms.losses.soft_gates import (
    SAPOLossConfig,
    SoftGate,
    get_soft_gate,
    register_soft_gate,
    soft_gate_names,
)
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP

__all__ = [
    "LOG_RATIO_CLAMP",
    "CISPOLossConfig",
    "ClipCovLossConfig",
    "DAPOLossConfig",
    "DCPOLossConfig",
    "DrGRPOLossConfig",
    "GMPOLossConfig",
    "GRPOLossConfig",
    "GSPOLossConfig",
    "GSPOTokenLossConfig",
    "KLCovLossConfig",
    "LPOLossConfig",
    "LossTerms",
    "PolicyLossConfig",
    "RatioLossConfig",
    "SAPOLossConfig",
    "SSPOFixedClipConfig",
    "SSPOLossConfig",
    "SequencePPOLossConfig",
    "SoftGate",
    "SoftSeqPOLossConfig",
    "build_policy_loss_config",
    "cispo_loss",
    "covariance_policy_loss",
    "get_policy_loss",
    "get_soft_gate",
    "policy_loss_names",
    "ratio_clip_loss",
    "register_policy_loss",
    "register_soft_gate",
    "select_high_covariance_tokens",
    "select_random_covariance_tokens",
    "soft_gate_names",
]
