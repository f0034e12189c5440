"""Rollout engines: transformers ``generate`` (CPU) and vLLM (GPU, imported lazily), with weight refit
from the policy, behind one interface and a registry (``rollout.engine.backend``). The correction of the
engine/trainer log-prob gap is :mod:`nemo_sspo.algorithms.off_policy`.
"""

from nemo_sspo.rollout.engines import (
    ROLLOUT_ENGINE_REGISTRY,
    EngineContext,
    RolloutEngine,
    build_rollout_engine,
    register_rollout_engine,
    rollout_engine_names,
    unregister_rollout_engine,
)
from nemo_sspo.rollout.hf_engine import HFRolloutEngine, RolloutBatch
from nemo_sspo.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine

__all__ = [
    "ROLLOUT_ENGINE_REGISTRY",
    "EngineContext",
    "HFRolloutEngine",
    "RolloutBatch",
    "RolloutEngine",
    "VLLMOptions",
    "VLLMRolloutEngine",
    "build_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
    "unregister_rollout_engine",
]
