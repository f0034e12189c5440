"""Rollout engines: transformers ``generate`` on CPU, with weight refit from the policy."""

from nemo_sspo.rollout.hf_engine import HFRolloutEngine, RolloutBatch

__all__ = ["HFRolloutEngine", "RolloutBatch"]
