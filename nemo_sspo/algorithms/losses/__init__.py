"""Policy losses on plain tensors: the typed interface, the registry and the registered losses.

One call for plain tensors: ``compute_policy_loss(name, LossInputs(...), **params)``. Hosts that
reduce over micro-batches bind a loss once (:func:`make_policy_loss`) and call
:func:`policy_loss_sums` per micro-batch. The registered names are :func:`policy_loss_names`
(docs/algorithms.md has the table). Importing this package imports every module in it, and each
loss module registers its losses, so a new loss is one new module (docs/extending.md).
"""

import importlib
import pkgutil

from nemo_sspo.algorithms.losses.adaptive_bounds import DCPOLossConfig, SSPOLossConfig
from nemo_sspo.algorithms.losses.api import compute_policy_loss, policy_loss_sums
from nemo_sspo.algorithms.losses.base import LossTerms, PolicyLossConfig
from nemo_sspo.algorithms.losses.cispo import CISPOLossConfig
from nemo_sspo.algorithms.losses.covariance import (
    ClipCovLossConfig,
    KLCovLossConfig,
    select_high_covariance_tokens,
    select_random_covariance_tokens,
)
from nemo_sspo.algorithms.losses.geometric import GMPOLossConfig, SoftSeqPOLossConfig
from nemo_sspo.algorithms.losses.inputs import LossInputs, LossOutput, LossRequirements, PolicyLoss
from nemo_sspo.algorithms.losses.ratio_clip import (
    DAPOLossConfig,
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    LPOLossConfig,
    RatioEngine,
    SequencePPOLossConfig,
    SSPOFixedClipConfig,
)
from nemo_sspo.algorithms.losses.loss_registry import (
    LossRecord,
    build_policy_loss_config,
    get_policy_loss,
    make_policy_loss,
    policy_loss_names,
    register_policy_loss,
    unregister_policy_loss,
)
from nemo_sspo.algorithms.losses.soft_gates import (
    SAPOLossConfig,
    SoftGate,
    get_soft_gate,
    register_soft_gate,
    soft_gate_names,
    unregister_soft_gate,
)
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # registers the losses it defines

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
    "KLCovLossConfig",
    "LPOLossConfig",
    "LossInputs",
    "LossOutput",
    "LossRecord",
    "LossRequirements",
    "LossTerms",
    "PolicyLoss",
    "PolicyLossConfig",
    "RatioEngine",
    "SAPOLossConfig",
    "SSPOFixedClipConfig",
    "SSPOLossConfig",
    "SequencePPOLossConfig",
    "SoftGate",
    "SoftSeqPOLossConfig",
    "build_policy_loss_config",
    "compute_policy_loss",
    "get_policy_loss",
    "get_soft_gate",
    "make_policy_loss",
    "policy_loss_names",
    "policy_loss_sums",
    "register_policy_loss",
    "register_soft_gate",
    "select_high_covariance_tokens",
    "select_random_covariance_tokens",
    "soft_gate_names",
    "unregister_policy_loss",
    "unregister_soft_gate",
]
