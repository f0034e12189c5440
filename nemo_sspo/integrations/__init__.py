"""Adapters that put nemo_sspo's policy losses into other GRPO training loops.

One module per host, each importing its host lazily (importing this package imports no host):

- :mod:`nemo_sspo.integrations.verl`: ``register()`` / ``install()`` add every loss to verl's
  policy-loss registry as ``nemo_sspo_<name>`` (:mod:`~nemo_sspo.integrations.verl_plugin` runs
  ``install()`` in every verl process).
- :mod:`nemo_sspo.integrations.nemo_rl`: ``NeMoRLPolicyLoss``, a NeMo-RL ``LossFunction`` of its
  current interface (log-prob or logit input), and ``prepare_master_config`` for the launcher.
- :mod:`nemo_sspo.integrations.nemo_aligner`: ``make_actor_loss_func``, the ``loss_func`` of
  NeMo-Aligner's actor (0.7.0's PPO and REINFORCE batches, the GRPO branch's), and
  ``logprobs_and_entropy`` for its log-prob pass.

See docs/integrations.md for what ran against a real host (the NeMo-RL and NeMo-Aligner losses
are checked against figures recorded from the real host code) and what was not run.
"""

__all__: list[str] = []
