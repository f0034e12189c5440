"""A NeMo-Aligner actor trained with a nemo_sspo loss (SSPO by default).

NeMo-Aligner is deprecated and released no GRPO: for new work use NeMo-RL
(examples/integrations/nemo_rl). This subclass of 0.7.0's ``MegatronGPTActorModel`` serves the
unreleased GRPO branch's trainer (``advantage_layout: tokens``, ``mask_rule: grpo_branch`` to keep
its zero-advantage rule) and 0.7.0's PPO trainer (``advantage_layout: gae``, token-unit
token-mean losses only). Not run here: the full actor needs the NeMo container
(examples/integrations/nemo_aligner/Dockerfile); its loss was checked against the real actors'
(docs/integrations.md). Use it in place of ``MegatronGPTActorModel`` in the training script (same
``load_from_nemo`` call), with the ``model.nemo_sspo`` section of sspo_grpo_actor.yaml.

Only the training loss changes: generation, rewards, advantages and the log-prob pass are the
host's. With ``old_entropy_source: current`` nothing else is needed (exact when each rollout batch
is used for one optimizer step); with ``batch``, also compute ``prev_entropy`` next to the
log-probs (``logprobs_and_entropy``) and carry it through the trainer's ``generate_ppo_data``.
"""

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from nemo.collections.nlp.modules.common.megatron.utils import (
    get_iterator_k_split,
    get_ltor_masks_and_position_ids,
)
from nemo.collections.nlp.parts.utils_funcs import get_last_rank
from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.train_utils import set_sync_funcs
from omegaconf import OmegaConf

from nemo_sspo.algorithms.segmentation import build_segment_tables
from nemo_sspo.integrations.nemo_aligner import PREV_ENTROPY_KEY, make_actor_loss_func

# Keys the last pipeline stage reads (the first stage reads tokens and positions); the REINFORCE
# batch brings rewards_with_kl and baseline instead of advantages and prev_logprobs.
_LAST_STAGE_KEYS = ("response_tokens", "advantages", "mask", "prev_logprobs", "is_end",
                    "rewards_with_kl", "baseline", PREV_ENTROPY_KEY)


class SSPOActorModel(MegatronGPTActorModel):
    """``MegatronGPTActorModel`` whose training loss is a nemo_sspo loss (``cfg.nemo_sspo``)."""

    def __init__(self, cfg, trainer):
        """Read the ``nemo_sspo`` section and build the tokenizer's segment tables."""
        super().__init__(cfg, trainer=trainer)
        section = OmegaConf.to_container(cfg.nemo_sspo, resolve=True)
        self._sspo_loss_name = section["loss_name"]
        self._sspo_loss_config = section["config"]
        self._sspo_options = {key: section[key] for key in
                              ("old_entropy_source", "advantage_layout", "mask_rule")
                              if key in section}
        # NeMo's AutoTokenizer wraps the Hugging Face tokenizer in `.tokenizer`.
        self._sspo_tables = build_segment_tables(self.tokenizer.tokenizer)

    def get_actor_forward_output_and_loss_func(self):
        """The host's forward step with the nemo_sspo ``loss_func``."""
        def fwd_output_and_loss_func(data_iterator, model):
            batch = next(data_iterator)
            if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                needed = set(batch)
            else:
                needed = {"attention_mask"}
                if parallel_state.is_pipeline_first_stage():
                    needed |= {"response_tokens", "position_ids"}
                if parallel_state.is_pipeline_last_stage():
                    needed |= set(_LAST_STAGE_KEYS) & set(batch)
            batch = {k: v.cuda(non_blocking=True) if k in needed else None for k, v in batch.items()}
            parallel_logits = model(batch["response_tokens"], batch["position_ids"],
                                    batch["attention_mask"], labels=None)
            if not parallel_state.is_pipeline_last_stage():
                return parallel_logits, None
            loss_func = make_actor_loss_func(
                batch,
                loss_name=self._sspo_loss_name,
                loss_config=self._sspo_loss_config,
                tables=self._sspo_tables,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                dp_group=parallel_state.get_data_parallel_group(),
                **self._sspo_options,
            )
            return parallel_logits, loss_func

        return fwd_output_and_loss_func

    def get_loss_and_metrics(self, batch, forward_only):
        """As the host's, but averaging whatever metric keys the loss returns."""
        rows, length = batch["response_tokens"].size()
        attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
            data=batch["response_tokens"], eod_token=self.tokenizer.eos_id,
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        batch["attention_mask"] = attention_mask.expand(rows, -1, -1, -1)
        batch["position_ids"] = position_ids.expand(rows, -1)
        set_sync_funcs(self, forward_only)
        per_micro_batch = get_forward_backward_func()(
            forward_step_func=self.get_actor_forward_output_and_loss_func(),
            data_iterator=self._make_data_iterator_list(
                get_iterator_k_split(batch, get_num_microbatches())),
            model=self.model,
            num_microbatches=get_num_microbatches(),
            forward_only=forward_only,
            seq_length=length,
            micro_batch_size=self.cfg.micro_batch_size,
        )
        # Only the last stage holds metrics; send its key list, then each averaged value.
        keys = [sorted(per_micro_batch[0])] if per_micro_batch else [None]
        torch.distributed.broadcast_object_list(keys, get_last_rank())
        metrics = {}
        for key in keys[0]:
            value = (torch.stack([m[key] for m in per_micro_batch]).mean() if per_micro_batch
                     else torch.zeros((), device=torch.cuda.current_device()))
            torch.distributed.broadcast(value, get_last_rank())
            metrics[key] = value.item()
        return metrics["loss"], metrics
