"""The learning-rate schedules of :func:`nemo_sspo.megatron.training.build_lr_scheduler`, importable
without megatron-core (the config reads them when it loads).
"""

from __future__ import annotations

from nemo_sspo.choice import Choice

__all__ = ["LrSchedule"]


class LrSchedule(Choice):
    """Decay after the warmup (config key ``optim.lr_schedule``; megatron-core's ``lr_decay_style``):
    ``constant`` keeps ``lr``, ``linear`` and ``cosine`` go from ``lr`` down to ``min_lr``.
    """

    constant = "constant"
    linear = "linear"
    cosine = "cosine"
