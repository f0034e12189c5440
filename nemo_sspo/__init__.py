"""nemo_sspo: SSPO and GRPO-family policy losses on Megatron-Core.

Layers, bottom to top (a module imports only its own layer and those below; checked by
``tools/import_graph.py``): ``metrics`` (metric pairs) -> ``algorithms`` (plain torch)
-> ``parallel`` (process-group maths) -> ``megatron`` (model, weight mapping, schedules)
-> ``models`` / ``data`` / ``rewards`` -> ``rollout`` -> ``evaluation`` -> ``trainer`` -> ``cli``.
``integrations`` (verl, NeMo-RL, NeMo-Aligner adapters) sits beside ``trainer`` and imports only
``metrics``, ``algorithms``, ``parallel`` and ``megatron``.

Shape letters used in every docstring:

- ``B``: responses in a (micro-)batch (rows).
- ``T``: response tokens per row (padded); ``P``: prompt tokens.
- ``S``: full sequence length ``P + T``.
- ``N``: flattened tokens (``B * T``) fed to a vocab-parallel function.
- ``V``: vocabulary size; ``V_local = V_padded / tp_size`` is one tensor-parallel vocab shard.
- ``G``: responses per prompt (``samples_per_prompt``, the config key ``rollout.samples_per_prompt``).
"""

from nemo_sspo.algorithms.losses import LossInputs, compute_policy_loss

__all__ = ["LossInputs", "compute_policy_loss"]
__version__ = "0.1.0"
