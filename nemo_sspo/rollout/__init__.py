"""Rollout engines: transformers ``generate`` (CPU) and vLLM (GPU, imported lazily), with weight refit
from the policy; truncated importance sampling for the engine/trainer log-prob gap."""

from nemo_sspo.rollout.hf_engine import HFRolloutEngine, RolloutBatch
from nemo_sspo.rollout.tis import truncated_is_weights
from nemo_sspo.rollout.vllm_engine import VLLMRolloutEngine

__all__ = ["HFRolloutEngine", "RolloutBatch", "VLLMRolloutEngine", "truncated_is_weights"]
