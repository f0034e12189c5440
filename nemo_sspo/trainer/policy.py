"""The policy's side of a step: the batch from a rollout, its forward-only log-probs, and the updates.

:class:`Policy` holds the Megatron policy (DDP-wrapped, with its optimizer and learning-rate
schedule), the frozen reference where the loss has a KL term, and what the loss reads of a batch
(:class:`nemo_sspo.megatron.step.LossSpec`, the micro-batch layout, the segment tables). The recipe
(:mod:`nemo_sspo.trainer.loop`) calls :meth:`Policy.prepare_batch` then :meth:`Policy.update`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from nemo_sspo.algorithms import segment_ids
from nemo_sspo.algorithms.batch import PolicyBatch, concat_policy_batches
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from nemo_sspo.algorithms.off_policy import off_policy_weights
from nemo_sspo.megatron import ParallelGroups
from nemo_sspo.megatron.lora import adapters_disabled
from nemo_sspo.megatron.moe import num_experts
from nemo_sspo.megatron.router_replay import engine_routing_sums, expert_load_pair
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.megatron.training import compute_old_logprobs, compute_ref_logprobs, train_on_batch
from nemo_sspo.metrics import MetricPair, merge_metric_sums
from nemo_sspo.parallel.data_balance import balance_across_data_parallel
from nemo_sspo.rollouts.records import Rollout

__all__ = ["Policy"]


@dataclass
class Policy:
    """The trained policy and what a step does with it (module docstring).

    Attributes:
        model: this rank's DDP-wrapped Megatron policy stage.
        optimizer: its optimizer (megatron-core's, possibly distributed).
        lr_scheduler: its learning-rate schedule (stepped once per optimizer step).
        ref_model: the frozen reference stage (same layout); under LoRA the policy ``model`` itself, read
            with its adapters off; None when the loss has no KL term.
        spec: what the loss reads (loss, groups, vocabulary shard, temperature, output precision).
        layout: the micro-batch layout (``parallel`` section).
        groups: this rank's parallel groups.
        hf_config: the policy's HF config (MoE expert count for the router metrics).
        cfg: the run's config (reads ``rollout`` corrections, ``model`` router replay,
            ``trainer.minibatches_per_step``).
        tables: the loss's segment tables padded to the model's vocabulary, or None for a
            segmentation without tables.
        pad_id: the tokenizer's pad id.
        route_layers: router replay R3: the MoE layers of this stage, whose engine routes the batch
            carries; None otherwise.
        progress: the step's progress line (``phase`` and ``micro_batch``), or None.
    """

    model: Any
    optimizer: Any
    lr_scheduler: Any
    ref_model: Any
    spec: LossSpec
    layout: MicroBatchLayout
    groups: ParallelGroups
    hf_config: Any
    cfg: Any
    tables: Any
    pad_id: int
    route_layers: list | None
    progress: Any = None

    def prepare_batch(self, rollout: Rollout, advantages: torch.Tensor,
                      sums: dict[str, MetricPair]) -> tuple[PolicyBatch, dict[str, MetricPair]]:
        """From the rollout and its ``[B]`` float32 advantages (whose metric pairs are ``sums``):
        segment ids and packing; with a token budget (``parallel.max_tokens_per_micro_batch``) each
        mini-batch's rows balanced by tokens across data-parallel ranks (:meth:`_balanced`); then
        pi_old (and pi_ref) log-probs from Megatron, and the off-policy correction weights unless
        ``rollout.correction.name`` is ``none`` (last pipeline stage).

        Returns:
            ``(PolicyBatch, sums with the router-load and correction metric pairs added)``.
        """
        rb, needs, g = rollout.batch, self.spec.loss.requirements, self.groups
        segments = segment_ids(needs.segmentation, rb.response_ids, rb.response_mask, self.tables, k=needs.segment_k)
        batch = PolicyBatch.from_rollout(rb, segments, advantages, pad_id=self.pad_id, route_layers=self.route_layers)
        if not self.layout.fixed and g.dp_size > 1:
            batch = self._balanced(batch)
        self._phase("old log-probs")
        batch = compute_old_logprobs(self.model, batch, self.spec, self.layout, dp_group=g.dp_group,
                                     record_routes=self.cfg.model.router_replay == "r2")
        if batch.routes is not None:
            sums["moe/expert_load_max_over_mean"] = expert_load_pair(
                batch.routes, batch.row_lengths(), num_experts(self.hf_config), dp_group=g.dp_group)
        if self.ref_model is not None:
            self._phase("reference log-probs")
            with adapters_disabled(self.ref_model):  # LoRA: the reference is the policy's base model
                batch = compute_ref_logprobs(self.ref_model, batch, self.spec, self.layout, dp_group=g.dp_group,
                                             keep_routes=self.route_layers is not None)
        ro = self.cfg.rollout
        if ro.correction.name != "none" and g.is_last_stage:
            weights, correction_sums = off_policy_weights(
                ro.correction.name, batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                segment_ids=batch.segment_ids, cap=ro.correction.cap, low=ro.correction.low, high=ro.correction.high)
            batch = replace(batch, tis_weights=weights)
            sums.update(correction_sums)
        return batch, sums

    def routing_sums(self, batch: PolicyBatch, step: int) -> dict[str, MetricPair]:
        """R3, every ``model.routing_agreement_interval`` steps: one forward-only pass of the policy
        (before its update) with its own routers, compared with the engine's routes and log-probs
        (:func:`~nemo_sspo.megatron.router_replay.engine_routing_sums`); {} otherwise.
        """
        every = self.cfg.model.routing_agreement_interval
        if self.route_layers is None or every == 0 or step % every:
            return {}
        g = self.groups
        own = compute_old_logprobs(self.model, replace(batch, routes=None), self.spec, self.layout,
                                   dp_group=g.dp_group, record_routes=True)
        return engine_routing_sums(batch, own, pp_group=g.pp_group, is_last_stage=g.is_last_stage)

    def _balanced(self, batch: PolicyBatch) -> PolicyBatch:
        """Each mini-batch's rows (the consecutive blocks :meth:`update` steps on) spread over the
        data-parallel ranks by tokens, every rank keeping its row count
        (:func:`nemo_sspo.parallel.data_balance.balance_across_data_parallel`): the forward passes
        and the update then cost every rank about the same.
        """
        size = batch.input_ids.shape[0] // self.cfg.trainer.minibatches_per_step
        return concat_policy_batches([
            balance_across_data_parallel(batch.select(slice(start, start + size)), self.groups.dp_group)
            for start in range(0, batch.input_ids.shape[0], size)])

    def update(self, batch: PolicyBatch) -> tuple[dict[str, MetricPair], float]:
        """``trainer.minibatches_per_step`` optimizer steps over consecutive row blocks of ``batch``.

        Returns:
            ``(the loss's metric pairs merged over the mini-batches, their mean gradient norm)``.

        Raises:
            FloatingPointError: a mini-batch's gradient norm is NaN or inf. The optimizer step has
                then corrupted the Megatron weights, but the rollout engine still holds the last
                good policy (refit comes after the update), which ``fit`` saves as
                ``hf_checkpoint_interrupted``.
        """
        rows = batch.input_ids.shape[0]
        size = rows // self.cfg.trainer.minibatches_per_step
        sums: dict[str, MetricPair] = {}
        norms = []
        for start in range(0, rows, size):
            self._phase("update", start // size + 1, rows // size, "optimizer steps")
            mb_sums, grad_norm = train_on_batch(
                self.model, self.optimizer, batch.select(slice(start, start + size)), self.spec, self.layout,
                dp_group=self.groups.dp_group, lr_scheduler=self.lr_scheduler,
                on_micro_batch=self.progress.micro_batch if self.progress is not None else None)
            if not math.isfinite(grad_norm):
                raise FloatingPointError(
                    f"gradient norm {grad_norm} in mini-batch {start // size + 1}: the loss or its gradient "
                    "is not finite (check rewards, optim.lr and the loss.params); the policy of the last "
                    "completed step is kept")
            norms.append(grad_norm)
            sums = merge_metric_sums(sums, mb_sums)
        return sums, sum(norms) / len(norms)

    def _phase(self, *args) -> None:
        if self.progress is not None:
            self.progress.phase(*args)
