"""Rollout engines: transformers ``generate`` (CPU) and vLLM (GPU, imported lazily), with weight refit
from the policy. The correction of the engine/trainer log-prob gap is
:mod:`nemo_sspo.algorithms.off_policy`."""

from nemo_sspo.rollout.hf_engine import HFRolloutEngine, RolloutBatch
from nemo_sspo.rollout.vllm_engine import VLLMRolloutEngine

__all__ = ["HFRolloutEngine", "RolloutBatch", "VLLMRolloutEngine"]
