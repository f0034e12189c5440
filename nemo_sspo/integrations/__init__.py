"""Adapters that put nemo_sspo's policy losses into other GRPO training loops.

One module per host, each importing its host lazily (importing this package imports no host):

- :mod:`nemo_sspo.integrations.verl`: ``register()`` / ``install()`` add every loss to verl's
  policy-loss registry as ``nemo_sspo_<name>`` (:mod:`~nemo_sspo.integrations.verl_plugin` runs
  ``install()`` in every verl process).
- :mod:`nemo_sspo.integrations.nemo_rl`: ``NeMoRLPolicyLoss``, a NeMo-RL loss function computing the
  loss from vocab-parallel logits.
- :mod:`nemo_sspo.integrations.nemo_aligner`: ``make_actor_loss_func``, the ``loss_func`` of
  NeMo-Aligner's PPO/GRPO actor, and ``logprobs_and_entropy`` for its log-prob pass.

See docs/integrations.md for what ran against a real host and what was written against a
documented interface.
"""

__all__: list[str] = []
