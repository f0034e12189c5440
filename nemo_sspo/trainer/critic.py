"""SPPO's critic: sequence-level PPO (arXiv 2604.08865) with a scalar value of the prompt.

SPPO treats a whole response as one action of a contextual bandit: the baseline is a learned value
V(x) of the prompt x alone, so one sample per prompt is enough (no group baseline). With 0/1 rewards:

- prediction: p(x) = sigmoid(V(x)), an estimate of the probability that a response to x is right;
- critic loss (binary cross-entropy on the reward; prompt x with responses i = 1..G):
  L_V = mean over prompts of BCE(p(x), rbar(x)) = -[rbar log p + (1 - rbar) log(1 - p)], with
  rbar(x) the mean reward of x's responses (BCE is linear in the target, so this equals the mean of
  the per-response BCE terms; for G = 1, rbar = r);
- advantage: A_i = r_i - p(x_i), from the critic *before* its update on the batch, shared by every
  token of response i (the policy loss is the ``sppo`` ratio-clip loss).

Model: the critic is its own Megatron ``GPTModel`` in the policy's parallel layout (TP shards, PP
stages, DP replicas with Megatron DDP and its own Adam optimizer). It may be smaller than the
policy: another checkpoint with the same tokenizer (``critic.source``) and/or its first
``critic.num_layers`` decoder layers. The last pipeline stage ends in the decoder's final norm and a
scalar head ``Linear(H, 1)`` (replicated over TP, zero-initialised: p = 0.5 at the start) instead of
the LM head; V(x) is read at the last prompt token. One critic step per training step, on the
step's prompts, after the policy update.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn.functional as F

from nemo_sspo.megatron import build_policy_model, forward_logits, load_hf_into_megatron
from nemo_sspo.megatron.step import model_device, split_micro_batches, to_device
from nemo_sspo.megatron.training import accumulate_gradients, apply_optimizer_step, run_schedule
from nemo_sspo.metrics import mean_pair
from nemo_sspo.algorithms.batch import pack_tokens

__all__ = [
    "Critic",
    "CriticBatch",
    "ValueModel",
    "build_value_model",
    "critic_advantages",
    "critic_loss",
    "critic_targets",
    "pack_critic_batch",
    "truncate_layers",
]

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (responses per prompt)")


def critic_targets(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """BCE target per prompt: the mean reward of its ``group_size`` consecutive responses.

    Args:
        rewards: ``[B]`` float, 0/1 task rewards (any value in [0, 1] is accepted).
        group_size: G responses per prompt; ``B % G == 0``.

    Returns:
        ``[B / G]`` float32.

    Raises:
        ValueError: ``group_size < 1``, ``B % G != 0``, or a reward outside [0, 1] or NaN (BCE
            needs a probability target).
    """
    _check_group_size(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by group_size={group_size}")
    if bool((~((rewards >= 0) & (rewards <= 1))).any()):  # NaN fails both comparisons
        raise ValueError("the SPPO critic's BCE target needs rewards in [0, 1] (a 0/1 correctness reward); "
                         f"got values in [{float(rewards.min())}, {float(rewards.max())}]")
    return rewards.to(torch.float32).reshape(-1, group_size).mean(dim=1)


def critic_loss(value_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-prompt BCE of sigmoid(V) against the target, ``[n]`` float32 (module docstring).

    Args:
        value_logits: ``[n]`` V(x), the critic's logit (with grad).
        targets: ``[n]`` float in [0, 1].
    """
    return F.binary_cross_entropy_with_logits(value_logits.float(), targets.float(), reduction="none")


def critic_advantages(rewards: torch.Tensor, value_logits: torch.Tensor, group_size: int) -> torch.Tensor:
    """SPPO's advantage A_i = r_i - sigmoid(V(x_i)) per response.

    Args:
        rewards: ``[B]`` float, rows grouped by prompt (G consecutive rows per prompt).
        value_logits: ``[B / G]`` V(x) per prompt (no gradient is taken).
        group_size: G.

    Returns:
        ``[B]`` float32.

    Raises:
        ValueError: ``group_size < 1``, ``rewards`` not ``[B]``, or ``value_logits`` not
            ``[B / G]`` (one logit per group of G consecutive responses; no broadcasting).
    """
    _check_group_size(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by "
                         f"group_size={group_size}")
    groups = rewards.numel() // group_size
    if tuple(value_logits.shape) != (groups,):
        raise ValueError(f"value_logits has shape {tuple(value_logits.shape)} but must be [B / G] = "
                         f"[{groups}] (one critic logit per prompt for rewards "
                         f"{tuple(rewards.shape)}, group_size={group_size})")
    baseline = torch.sigmoid(value_logits.detach().float()).repeat_interleave(group_size)
    return rewards.to(torch.float32) - baseline.to(rewards.device)


@dataclass
class CriticBatch:
    """Prompts for the critic, right-padded.

    Attributes:
        input_ids: [n, P] int64 prompt tokens, right-padded.
        position_ids: [n, P] int64, 0..P-1.
        last_index: [n] int64, column of each prompt's last token (its length - 1).
        targets: [n] float32 BCE targets (:func:`critic_targets`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    last_index: torch.Tensor
    targets: torch.Tensor

    def select(self, rows: slice) -> "CriticBatch":
        """Rows ``rows`` of every field (views)."""
        return CriticBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def pack_critic_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rewards: torch.Tensor,
                      group_size: int, *, pad_id: int) -> CriticBatch:
    """One critic row per prompt group from a rollout's LEFT-padded ``[B, P]`` prompts and ``[B]`` rewards."""
    firsts = slice(0, prompt_ids.shape[0], group_size)
    input_ids, lengths = pack_tokens([(prompt_ids[firsts], prompt_mask[firsts])], pad_id=pad_id)
    rows, width = input_ids.shape
    return CriticBatch(input_ids=input_ids, position_ids=torch.arange(width).expand(rows, width).contiguous(),
                       last_index=lengths - 1, targets=critic_targets(rewards, group_size))


def truncate_layers(hf_config, state_dict: dict[str, torch.Tensor], num_layers: int):
    """The checkpoint's first ``num_layers`` decoder layers: ``(hf_config copy, state dict subset)``.

    Raises:
        ValueError: ``num_layers`` outside ``[1, num_hidden_layers]`` (names ``critic.num_layers``).
    """
    total = hf_config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"critic.num_layers={num_layers} must be in [1, {total}] (the checkpoint's layers)")
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    kept = {key: value for key, value in state_dict.items()
            if not (m := _LAYER_KEY.match(key)) or int(m.group(1)) < num_layers}
    return config, kept


class ValueModel(torch.nn.Module):
    """A ``GPTModel`` stage whose last stage outputs one value per position instead of logits.

    The ``GPTModel`` is built with its LM head so that the HF mapping loads the final norm, then its
    last stage is made headless: Megatron's ``GPTModel.forward`` returns the decoder output (after
    the final norm) when ``post_process`` is False, and the output layer and, on every stage, the
    embedding tying (whose gradient all-reduce across stages would look for the output layer) are
    dropped. The scalar head
    ``value_head`` replaces them. The ``GPTModel`` is ``self.module``, so Megatron's
    ``get_attr_wrapped_model`` and this package's ``unwrap_model`` reach it through the wrapper.

    ``forward(input_ids, position_ids, attention_mask)`` returns values ``[B, S]`` (float, V(x) at
    every prefix) on the last stage and the stage's hidden states ``[S, B, H]`` elsewhere.
    """

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.module = gpt
        self.value_head = None
        # On every stage: with PP the first stage would otherwise all-reduce its embedding gradient
        # with the (removed) output layer of the last.
        gpt.share_embeddings_and_output_weights = False
        if gpt.post_process:
            gpt.post_process = False
            gpt.output_layer = None
            weight = next(gpt.parameters())
            self.value_head = torch.nn.Linear(gpt.config.hidden_size, 1, device=weight.device,
                                              dtype=gpt.config.params_dtype)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron distributed-checkpoint state (``nemo_sspo.trainer.checkpoint``): the GPTModel's
        own sharded state under ``module.``, and the value head (replicated over TP) under ``value_head.``."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        state = self.module.sharded_state_dict(prefix=f"{prefix}module.", sharded_offsets=sharded_offsets,
                                               metadata=metadata)
        if self.value_head is not None:
            state.update(sharded_state_dict_default(self.value_head, f"{prefix}value_head.", sharded_offsets,
                                                    metadata))
        return state

    def forward(self, input_ids, position_ids, attention_mask):
        hidden = self.module(input_ids, position_ids, attention_mask)
        if self.value_head is None:
            return hidden
        return self.value_head(hidden).squeeze(-1).transpose(0, 1)


def build_value_model(hf_config, state_dict: dict[str, torch.Tensor], *, num_layers: int | None = None,
                      **model_options) -> ValueModel:
    """This rank's critic stage (current parallel state), loaded from HF weights.

    Args:
        hf_config, state_dict: a Llama / Qwen2 checkpoint (``load_hf_checkpoint``).
        num_layers: keep the first N decoder layers (:func:`truncate_layers`); None keeps all.
        **model_options: ``precision``, ``fp8``, ``fp8_recipe``, ``transformer_impl`` of
            ``build_policy_model`` (the policy's ``model.*`` settings).
    """
    if num_layers is not None:
        hf_config, state_dict = truncate_layers(hf_config, state_dict, num_layers)
    gpt = build_policy_model(hf_config, **model_options)
    load_hf_into_megatron(gpt, state_dict, hf_config)
    return ValueModel(gpt)


def _value_logits(batch: CriticBatch, values: torch.Tensor) -> torch.Tensor:
    """V at each row's last prompt token: ``[n]`` float32 from ``[n, P]`` values."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, batch.last_index.to(values.device)].float()


def _bce_loss_func(batch: CriticBatch, values: torch.Tensor):
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


def _predict_loss_func(batch: CriticBatch, values: torch.Tensor):
    zero = values.new_zeros((), dtype=torch.float32)
    return zero, torch.zeros((), dtype=torch.int), {"value_logits": _value_logits(batch, values).detach()}


def _forward_step(loss_func):
    def forward_step(data_iterator, model):
        batch = to_device(next(data_iterator), model_device(model))
        return forward_logits(model, batch.input_ids, batch.position_ids), partial(loss_func, batch)

    return forward_step


class Critic:
    """The SPPO critic of one rank: DDP-wrapped :class:`ValueModel`, its optimizer, micro-batch size.

    Both methods are collective over the model-parallel and data-parallel groups (Megatron
    schedules); every rank of a replica passes the same :class:`CriticBatch`.
    """

    def __init__(self, model, optimizer, micro_batch_size: int) -> None:
        self.model, self.optimizer, self.micro_batch_size = model, optimizer, micro_batch_size

    def predict(self, batch: CriticBatch) -> torch.Tensor | None:
        """V(x) per prompt, ``[n]`` float32, forward only (eval mode); None off the last stage."""
        self.model.eval()
        with torch.no_grad():
            outputs = run_schedule(self.model, split_micro_batches(batch, self.micro_batch_size),
                                   _forward_step(_predict_loss_func), forward_only=True)
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
                                    _forward_step(_bce_loss_func))
        return sums, apply_optimizer_step(self.optimizer)
