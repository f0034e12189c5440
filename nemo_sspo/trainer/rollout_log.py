"""``trainer.rollout_log``: what each response of a step scored, one JSON Lines record per response.

A rollout log lets a person check a reward function or an advantage estimator by hand (the role of
verl's ``trainer.rollout_data_dir`` and NeMo-RL's generation logs). Each data-parallel replica's
rank that holds the step's advantages (the last pipeline stage's tensor- and context-parallel rank
0) writes the responses it trained on to ``<output_dir>/rollouts/replica_<dp rank>.jsonl``; nothing
is gathered across ranks. A record:

``step`` (1-based), ``replica`` (data-parallel rank), ``row`` (index in the replica's batch),
``prompt_id`` (the problem's stable key, :func:`nemo_sspo.rollouts.sampling.prompt_key`), ``sample``
(index in its group of ``rollout.samples_per_prompt``), ``prompt`` and ``response`` (decoded without
special tokens), ``task_reward`` (the reward function's score), ``reward`` (with overlong shaping:
what the advantage used), ``advantage``, ``response_length`` (tokens, the stop token included),
``version`` (the policy version that sampled it: the training steps its weights had taken, 0 = the
initial weights, so step - 1 when colocated; a partial rollout's oldest token's) and
``truncated`` (no stop token within ``rollout.sampling.max_new_tokens``).

A step's records are written when its metrics are (after the step completes), so the log and
``metrics.jsonl`` hold the same steps. A resumed run keeps the records of the steps up to its
checkpoint and drops later ones (written by the interrupted run after its checkpoint), which it then
writes again; ``trainer.overwrite_output_dir`` and ``trainer.resume=auto``'s move of an earlier run
cover the folder like the other outputs (``nemo_sspo.trainer.checkpoint.RUN_OUTPUTS``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nemo_sspo.data.jsonl import jsonl_line, jsonl_lines

__all__ = ["ROLLOUT_LOG_DIR", "RolloutLog", "rollout_records"]

ROLLOUT_LOG_DIR = "rollouts"
"""Sub-folder of ``trainer.output_dir`` holding the rollout log, one file per data-parallel replica."""


def rollout_records(step: int, versioned: Any, advantages: torch.Tensor, *, samples_per_prompt: int, tokenizer,
                    replica: int) -> list[dict[str, Any]]:
    """The records (module docstring) of one replica's rollout.

    Args:
        step: the training step (1-based).
        versioned: the step's ``VersionedRollout`` (its ``rollout`` of ``B`` responses, grouped by
            prompt slot, and each response's version).
        advantages: ``[B]`` float, the responses' advantages as the loss receives them.
        samples_per_prompt: responses per prompt (``rollout.samples_per_prompt``).
        tokenizer: decodes the prompts.
        replica: this replica's data-parallel rank.

    Returns:
        ``B`` dicts in row order.

    Raises:
        ValueError: ``advantages`` does not have one value per response.
    """
    rollout = versioned.rollout
    rb = rollout.batch
    count = rollout.rewards.numel()
    if advantages.shape != (count,):
        raise ValueError(f"advantages {tuple(advantages.shape)} must hold one value per response ({count})")
    prompts = tokenizer.batch_decode([ids[mask].tolist() for ids, mask in zip(rb.prompt_ids, rb.prompt_mask, strict=True)],
                                     skip_special_tokens=True)
    columns = zip(prompts, rb.response_texts, rollout.task_rewards.tolist(), rollout.rewards.tolist(),
                  advantages.tolist(), rb.response_mask.sum(dim=1).tolist(), versioned.versions().tolist(),
                  rb.truncated.tolist(), strict=True)
    return [{"step": step, "replica": replica, "row": row, "prompt_id": rollout.prompt_keys[row // samples_per_prompt],
             "sample": row % samples_per_prompt, "prompt": prompt, "response": response, "task_reward": task_reward,
             "reward": reward, "advantage": advantage, "response_length": length, "version": version,
             "truncated": truncated}
            for row, (prompt, response, task_reward, reward, advantage, length, version, truncated)
            in enumerate(columns)]


class RolloutLog:
    """One replica's rollout log file (module docstring).

    Args:
        output_dir: the run's ``trainer.output_dir``.
        replica: the writing rank's data-parallel rank (names the file).
        resume_step: a resumed run's checkpoint step: records of steps up to it are kept, later ones
            dropped; None starts an empty file.
        tokenizer: decodes the prompts.
        samples_per_prompt: responses per prompt (``rollout.samples_per_prompt``).
    """

    def __init__(self, output_dir: str | Path, replica: int, *, resume_step: int | None, tokenizer,
                 samples_per_prompt: int) -> None:
        """Opens the file (class docstring)."""
        self.replica, self.tokenizer, self.samples_per_prompt = replica, tokenizer, samples_per_prompt
        self.path = Path(output_dir) / ROLLOUT_LOG_DIR / f"replica_{replica:03d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [line for _, line in jsonl_lines(self.path.read_text(encoding="utf-8"))
                    if json.loads(line)["step"] <= resume_step]
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.writelines(f"{line}\n" for line in kept)
        self._file.flush()
        self._pending: list[dict[str, Any]] = []

    def observe(self, step: int, event: str, data: Any) -> None:
        """A step observer (:mod:`nemo_sspo.trainer.step_metrics`): holds the records of the step's
        ``"advantages"`` event, ``(versioned rollout, [B] advantages)``, until :meth:`flush`.
        """
        if event == "advantages":
            versioned, advantages = data
            self.add(rollout_records(step, versioned, advantages, samples_per_prompt=self.samples_per_prompt,
                                     tokenizer=self.tokenizer, replica=self.replica))

    def add(self, records: list[dict[str, Any]]) -> None:
        """Holds a step's records until :meth:`flush` (the step completes)."""
        self._pending.extend(records)

    def flush(self) -> None:
        """Writes the held records."""
        self._file.writelines(jsonl_line(record) for record in self._pending)
        self._file.flush()
        self._pending.clear()

    def close(self) -> None:
        """Closes the file; records never flushed (a step that failed) are not written."""
        self._file.close()
