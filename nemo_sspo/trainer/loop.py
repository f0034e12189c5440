"""The GRPO-family training loop on a Megatron-Core policy.

One step reads top to bottom as named phases::

    sample prompts -> generate (rollout engine, current weights) -> score (math-verify)
    -> advantages -> old log-probs/entropy (Megatron, forward only) -> mini-batch updates
    -> refit (Megatron -> rollout engine) -> metrics

Rollouts are generated one prompt group per ``generate`` call, seeded by (seed, step, global prompt
index), so the samples do not depend on how prompts are split over data-parallel ranks: the same
seed and config give the same first step for any TP x PP x DP layout. Within a data-parallel
replica only the first model-parallel rank generates and scores; it broadcasts the rollout to the
replica's other TP/PP ranks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_sspo.algorithms import build_boundary_table, group_advantages, newline_segment_ids
from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.data import build_prompt_source, render_prompt
from nemo_sspo.megatron import (
    build_policy_model,
    export_hf_state_dict,
    get_parallel_groups,
    initialize_parallel,
    load_hf_into_megatron,
    vocab_shard,
)
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch, wrap_for_training
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.parallel.metrics import merge_metric_sums, reduce_metric_sums
from nemo_sspo.rewards import MathVerifyReward
from nemo_sspo.rollout import HFRolloutEngine, RolloutBatch
from nemo_sspo.trainer.batch import concat_rollouts, pack_rollouts, response_to_target_frame
from nemo_sspo.trainer.config import TrainConfig, build_loss_config, validate
from nemo_sspo.trainer.metrics import MetricsLogger

__all__ = ["GRPOTrainer", "Rollout"]


@dataclass
class Rollout:
    """A data-parallel replica's scored rollouts (identical on all its TP/PP ranks)."""

    batch: RolloutBatch
    rewards: torch.Tensor  # [B] float32


def _pair(total: float, count: float) -> torch.Tensor:
    return torch.tensor([total, count], dtype=torch.float32)


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def time(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing/{name}_s"] = time.perf_counter() - start


def _check_output_dir(trainer_cfg) -> None:
    """Refuses to overwrite an earlier run's metrics unless ``trainer.overwrite_output_dir``."""
    earlier = Path(trainer_cfg.output_dir) / "metrics.jsonl"
    if earlier.exists() and earlier.stat().st_size > 0 and not trainer_cfg.overwrite_output_dir:
        raise ValueError(
            f"trainer.output_dir={trainer_cfg.output_dir!r} holds an earlier run ({earlier}); choose "
            "another trainer.output_dir or set trainer.overwrite_output_dir=true"
        )


class GRPOTrainer:
    """Builds the policy, rollout engine, reward and logger from a validated :class:`TrainConfig`.

    Raises:
        ValueError: invalid config (see :func:`nemo_sspo.trainer.config.validate`) or a parallel
            layout the model's head/layer counts do not allow.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        par = cfg.parallel
        initialize_parallel(tp_size=par.tensor_model_parallel_size,
                            pp_size=par.pipeline_model_parallel_size, seed=cfg.trainer.seed)
        validate(cfg, world_size=dist.get_world_size())
        _check_output_dir(cfg.trainer)
        self.groups = get_parallel_groups()
        # Data first: a bad source option fails before the model is loaded.
        self.prompts = build_prompt_source(cfg.data.source, seed=cfg.trainer.seed, **dict(cfg.data.options))
        hf_config, state_dict, tokenizer = load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir)
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self._build_policy(state_dict)
        self.is_generator = self.groups.mp_rank == 0
        self.engine = self.reward = None
        if self.is_generator:
            self._build_rollout(state_dict)
        del state_dict
        boundary = build_boundary_table(tokenizer)
        # The model's vocabulary can exceed the tokenizer's (e.g. Qwen2.5: 151,936 rows vs 151,665
        # ids); ids the tokenizer never decodes close no segment.
        self.boundary = torch.nn.functional.pad(boundary, (0, max(0, hf_config.vocab_size - len(boundary))))
        loss_fn, _ = get_policy_loss(cfg.loss.name)
        vocab_start, vocab_size = vocab_shard(self.model)
        self.spec = LossSpec(loss_fn=loss_fn, loss_config=build_loss_config(cfg.loss),
                             tp_group=self.groups.tp_group if self.groups.tp_size > 1 else None,
                             vocab_start=vocab_start, vocab_size=vocab_size,
                             temperature=cfg.rollout.temperature,
                             max_response_length=cfg.rollout.max_new_tokens)
        self.logger = MetricsLogger(cfg.trainer.output_dir, cfg.trainer.max_steps,
                                    enabled=dist.get_rank() == 0)

    def _build_policy(self, state_dict) -> None:
        """Megatron policy for this rank, loaded from the HF weights, wrapped in DDP with its optimizer."""
        model = build_policy_model(self.hf_config)
        load_hf_into_megatron(model, state_dict, self.hf_config)
        opt = self.cfg.optim
        self.model, self.optimizer = wrap_for_training(
            model, lr=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
        )

    def _build_rollout(self, state_dict) -> None:
        """Rollout engine (an HF copy of the policy) and reward pool, on generating ranks only."""
        ro = self.cfg.rollout
        self.engine = HFRolloutEngine(build_hf_model(self.hf_config, state_dict), self.tokenizer,
                                      max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                                      top_p=ro.top_p)
        self.reward = MathVerifyReward(num_workers=self.cfg.reward.num_workers, timeout_s=self.cfg.reward.timeout_s)

    # ---- phases -------------------------------------------------------------------------------
    def _local_problems(self):
        """(index of this rank's first prompt in the step's global list, this rank's problems)."""
        problems = self.prompts.sample(self.cfg.rollout.prompts_per_step)
        per_rank = len(problems) // self.groups.dp_size
        first = self.groups.dp_rank * per_rank
        return first, problems[first : first + per_rank]

    def generate_and_score(self, step: int) -> Rollout:
        """Generates G responses per local prompt and scores them; shared across the replica's TP/PP ranks."""
        first, problems = self._local_problems()
        rollout = None
        if self.is_generator:
            group = self.cfg.rollout.samples_per_prompt
            parts = []
            for k, problem in enumerate(problems):
                prompt = render_prompt(self.tokenizer, problem.question, self.cfg.data.template)
                seed = self.cfg.trainer.seed * 1_000_003 + step * 10_007 + first + k
                parts.append(self.engine.generate([prompt] * group, seed=seed))
            batch = concat_rollouts(parts, pad_id=self.tokenizer.pad_token_id)
            answers = [p.answer for p in problems for _ in range(group)]
            rewards = torch.tensor(self.reward(batch.response_texts, answers), dtype=torch.float32)
            rollout = Rollout(batch=batch, rewards=rewards)
        return self._broadcast_in_replica(rollout)

    def _broadcast_in_replica(self, rollout: Rollout | None) -> Rollout:
        g = self.groups
        if g.mp_size == 1:
            return rollout
        box = [rollout]
        dist.broadcast_object_list(box, src=g.mp_src_rank, group=g.mp_group)
        return box[0]

    def prepare_batch(self, rollout: Rollout):
        """Advantages, newline segments and packing; then pi_old log-probs/entropy from Megatron."""
        rb = rollout.batch
        advantages, adv_stats = group_advantages(rollout.rewards, self.cfg.rollout.samples_per_prompt)
        segments = newline_segment_ids(rb.response_ids, rb.response_mask, self.boundary)
        batch = pack_rollouts(rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                              segments, advantages, pad_id=self.tokenizer.pad_token_id)
        batch = compute_old_logprobs(self.model, batch, self.spec, self.cfg.parallel.micro_batch_size)
        return batch, adv_stats

    def update(self, batch) -> tuple[dict[str, torch.Tensor], float]:
        """minibatches_per_step optimizer steps over consecutive row blocks of ``batch``."""
        rows = batch.input_ids.shape[0]
        size = rows // self.cfg.trainer.minibatches_per_step
        sums: dict[str, torch.Tensor] = {}
        norms = []
        for start in range(0, rows, size):
            mb_sums, grad_norm = train_on_batch(self.model, self.optimizer, batch.select(slice(start, start + size)),
                                                self.spec, self.cfg.parallel.micro_batch_size)
            norms.append(grad_norm)
            sums = merge_metric_sums(sums, mb_sums)
        return sums, sum(norms) / len(norms)

    def refit(self) -> None:
        """Copies the updated Megatron weights into the rollout engine (collective over TP/PP)."""
        state = export_hf_state_dict(self.model.module, self.hf_config)
        if self.is_generator:
            self.engine.load_weights(state)

    # ---- metrics ------------------------------------------------------------------------------
    def _rollout_metric_sums(self, rollout: Rollout, batch, adv_stats) -> dict[str, torch.Tensor]:
        rb, rewards = rollout.batch, rollout.rewards
        n = float(rewards.numel())
        lengths = rb.response_mask.sum(dim=1).float()
        groups = n / self.cfg.rollout.samples_per_prompt
        sums = {
            "reward/mean": _pair(float(rewards.sum()), n),
            "reward/accuracy": _pair(float((rewards >= 1.0).sum()), n),
            "response/length_mean": _pair(float(lengths.sum()), n),
            "response/truncated_frac": _pair(float(rb.truncated.float().sum()), n),
            "advantages/zero_variance_group_frac": _pair(adv_stats["advantages/zero_variance_group_frac"] * groups, groups),
        }
        mask = batch.loss_mask
        if mask.any():
            rollout_lp = response_to_target_frame(rb.rollout_logprobs, rb.prompt_mask, mask.shape[1])
            gap = (rollout_lp - batch.old_logprobs)[mask].abs()
            sums["rollout/trainer_logprob_gap_abs"] = _pair(float(gap.sum()), float(gap.numel()))
        return sums

    def train_step(self, step: int) -> dict[str, float]:
        timer = _Timer()
        with timer.time("generation"):
            rollout = self.generate_and_score(step)
        with timer.time("train"):
            batch, adv_stats = self.prepare_batch(rollout)
            sums, grad_norm = self.update(batch)
        with timer.time("refit"):
            self.refit()
        if self.groups.is_last_stage:
            sums.update(self._rollout_metric_sums(rollout, batch, adv_stats))
        metrics = reduce_metric_sums(sums, dp_group=self.groups.dp_group, pp_group=self.groups.pp_group,
                                     last_stage_rank=self.groups.pp_last_rank, is_last_stage=self.groups.is_last_stage)
        metrics["optim/grad_norm"] = grad_norm
        metrics.update(timer.seconds)
        return metrics

    def save_hf_checkpoint(self, name: str) -> None:
        """Writes the rollout model (the policy as of the last refit) and tokenizer under ``output_dir/name``.

        Only global rank 0 writes (it is the generator of data-parallel replica 0).
        """
        if dist.get_rank() != 0 or not self.cfg.trainer.save_hf_checkpoint:
            return
        path = Path(self.cfg.trainer.output_dir) / name
        self.engine.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def fit(self) -> list[dict[str, float]]:
        """Runs ``trainer.max_steps`` steps; returns the per-step metrics (same on every rank).

        If a step raises, the policy of the last completed step is saved to
        ``output_dir/hf_checkpoint_interrupted`` before the error propagates (metrics.jsonl already
        holds every completed step).
        """
        try:
            for step in range(1, self.cfg.trainer.max_steps + 1):
                self.logger.log(step, self.train_step(step))
        except BaseException:
            if self.logger.history:
                self.save_hf_checkpoint("hf_checkpoint_interrupted")
            raise
        finally:
            self.close()
        self.save_hf_checkpoint("hf_checkpoint")
        return self.logger.history

    def close(self) -> None:
        self.logger.close()
        if self.reward is not None:
            self.reward.close()
