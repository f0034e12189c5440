"""The trainer's SPPO critic: predicts V(prompt) for the advantages, then takes one BCE step.

The maths (targets, loss, advantages) is ``nemo_sspo.algorithms.critic``; the value model (a
``GPTModel`` with a scalar head) is ``nemo_sspo.megatron.value_model``. V(x) is read at the last
prompt token. One critic step per training step, on the step's prompts, after the policy update.
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.batch import CriticBatch
from nemo_sspo.algorithms.critic import critic_loss
from nemo_sspo.megatron.step import make_forward_step, split_micro_batches
from nemo_sspo.megatron.training import accumulate_gradients, apply_optimizer_step, run_schedule
from nemo_sspo.metrics import mean_pair

__all__ = ["Critic"]


def _value_logits(batch: CriticBatch, values: torch.Tensor) -> torch.Tensor:
    """V at each row's last prompt token: ``[n]`` float32 from ``[n, P]`` values."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, batch.last_index.to(values.device)].float()


def _bce_loss_func(batch: CriticBatch, model, values: torch.Tensor):
    logits = _value_logits(batch, values)
    targets = batch.targets.to(logits.device)
    bce = critic_loss(logits, targets)
    prob = torch.sigmoid(logits.detach())
    count = torch.tensor(float(logits.numel()), device=logits.device)
    metrics = {
        "critic/loss": mean_pair(bce.detach().sum(), count),
        "critic/value_mean": mean_pair(prob.sum(), count),
        "critic/reward_mean": mean_pair(targets.sum(), count),
        "critic/abs_error": mean_pair((prob - targets).abs().sum(), count),
    }
    return bce.sum(), torch.tensor(logits.numel(), dtype=torch.int, device=logits.device), metrics


def _predict_loss_func(batch: CriticBatch, model, values: torch.Tensor):
    zero = values.new_zeros((), dtype=torch.float32)
    return zero, torch.zeros((), dtype=torch.int), {"value_logits": _value_logits(batch, values).detach()}


class Critic:
    """The SPPO critic of one rank: DDP-wrapped :class:`ValueModel`, its optimizer, micro-batch size
    and learning-rate schedule (``critic.optim``; None for a constant rate).

    Both methods are collective over the model-parallel and data-parallel groups (Megatron
    schedules); every rank of a replica passes the same :class:`CriticBatch`.
    """

    def __init__(self, model, optimizer, micro_batch_size: int, lr_scheduler=None) -> None:
        self.model, self.optimizer, self.micro_batch_size = model, optimizer, micro_batch_size
        self.lr_scheduler = lr_scheduler

    def predict(self, batch: CriticBatch) -> torch.Tensor | None:
        """V(x) per prompt, ``[n]`` float32, forward only (eval mode); None off the last stage."""
        self.model.eval()
        with torch.no_grad():
            outputs = run_schedule(self.model, split_micro_batches(batch, self.micro_batch_size),
                                   make_forward_step(_predict_loss_func), forward_only=True)
        self.model.train()
        return torch.cat([o["value_logits"] for o in outputs]) if outputs else None

    def update(self, batch: CriticBatch) -> tuple[dict[str, torch.Tensor], float]:
        """One Adam step on the BCE loss averaged over the batch's prompts (all DP ranks).

        Returns:
            ``(metric_sums, grad_norm)``: ``critic/loss``, ``critic/value_mean`` (mean sigmoid(V),
            before the step), ``critic/reward_mean``, ``critic/abs_error`` as (sum, count) pairs on
            the last stage (empty elsewhere); the global gradient norm before clipping.
        """
        self.optimizer.zero_grad()
        sums = accumulate_gradients(self.model, split_micro_batches(batch, self.micro_batch_size),
                                    make_forward_step(_bce_loss_func))
        return sums, apply_optimizer_step(self.optimizer, self.lr_scheduler)
