"""Evaluation inside the training loop: greedy Avg@1 every ``eval.every_n_steps`` steps on the
rollout engine's current (just refitted) weights, and the best step by ``eval/mean``.

The paper evaluates every 10 steps and reports the best step; the trainer keeps that step's policy
as a Hugging Face folder ``<output_dir>/best`` with ``best.json`` (the step and its scores) and logs
``eval/<benchmark>``, ``eval/mean`` and ``eval/best_mean`` on evaluation steps. Per-problem responses
go to ``<output_dir>/eval/step_<N>.jsonl``.

Only global rank 0 (the generator of data-parallel replica 0) evaluates
(:func:`nemo_sspo.evaluation.evaluate`, no collectives); the scores, or the error it raised, are
broadcast so that every rank logs the same values or raises the same error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from nemo_sspo.evaluation import MEAN_KEY, evaluate

__all__ = ["BEST_DIR", "BestEval", "evaluate_engine"]

BEST_DIR = "best"
"""Sub-folder of ``trainer.output_dir`` holding the best step's policy (HF format) and ``best.json``."""


@dataclass(frozen=True)
class BestEval:
    """The best ``eval/mean`` so far and its step (both None before the first evaluation)."""

    mean: float | None = None
    step: int | None = None

    def improved_by(self, mean: float) -> bool:
        """True for the first evaluation and for a strictly higher mean (ties keep the earlier step)."""
        return self.mean is None or mean > self.mean


def evaluate_engine(engine, tokenizer, eval_cfg, reward, *, template: str, samples_path: str | Path
                    ) -> dict[str, float]:
    """Scores the configured benchmarks with ``engine``'s greedy responses. Collective (world group).

    Args:
        engine: the rollout engine on global rank 0 (anything :func:`nemo_sspo.evaluation.as_eval_engine`
            accepts); ignored on other ranks.
        tokenizer: the policy's tokenizer.
        eval_cfg: the ``eval`` config section (benchmarks, data_dir, limits, batch size).
        reward: the trainer's math-verify pool (rank 0).
        template: the prompt template (``data.template``, as in training).
        samples_path: where rank 0 writes the per-problem samples (jsonl).

    Returns:
        ``{"eval/<benchmark>": Avg@1, ..., "eval/mean": ...}``, the same on every rank.

    Raises:
        The error rank 0's evaluation raised (e.g. a missing ``eval.data_dir``), on every rank.
    """
    outcome = None
    if dist.get_rank() == 0:
        ev = eval_cfg
        try:
            outcome = evaluate(engine, tokenizer, ev.benchmarks, data_dir=ev.data_dir, data_dir_key="eval.data_dir", limit=ev.limit_per_benchmark,
                               max_new_tokens=ev.max_new_tokens, template=template,
                               batch_size=ev.batch_size, reward=reward, samples_path=Path(samples_path))
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            outcome = err
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    if MEAN_KEY not in box[0]:
        raise ValueError(f"evaluation returned no {MEAN_KEY!r}: {sorted(box[0])}")
    return box[0]
