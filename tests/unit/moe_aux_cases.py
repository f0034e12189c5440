"""The tiny Qwen3-MoE, batch and float64 references of the auxiliary-loss tests (unit and distributed).

References are transformers' own: ``load_balancing_loss_func`` on the router logits of a float64
``Qwen3MoeForCausalLM`` with its attention mask, and the gradient of the coefficient-weighted loss
on each router weight by autograd in float64.
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from nemo_sspo.algorithms.batch import pack_rollouts

VOCAB, EXPERTS, TOP_K, LAYERS = 100, 8, 2, 2
PROMPT_LENGTHS = [3, 2, 4, 2]
RESPONSE_LENGTHS = [4, 2, 5, 3]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]
COEF = 0.5


def hf_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=False,
        max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)  # routes that depend on the token
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return model.double()


def policy_batch():
    generator = torch.Generator().manual_seed(1)
    p_max, t_max = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.zeros(4, p_max, dtype=torch.long)
    response_ids = torch.zeros(4, t_max, dtype=torch.long)
    for b, (p, t) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        prompt_ids[b, p_max - p:] = torch.randint(1, VOCAB, (p,), generator=generator)
        response_ids[b, :t] = torch.randint(1, VOCAB, (t,), generator=generator)
    prompt_mask = torch.arange(p_max)[None, :] >= (p_max - torch.tensor(PROMPT_LENGTHS))[:, None]
    response_mask = torch.arange(t_max)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    segments = torch.where(response_mask, 0, -1)
    return pack_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, segments,
                         torch.tensor(ADVANTAGES), pad_id=0)


def hf_aux_and_grads(hf: Qwen3MoeForCausalLM, batch, rows: list[slice], weights: list[float]):
    """sum_m w_m * aux_m / sum_m w_m over row blocks (float64), and its gradient on each router weight."""
    hf.zero_grad()
    total = 0.0
    for block, weight in zip(rows, weights):
        ids = batch.input_ids[block]
        attention = (torch.arange(ids.shape[1])[None, :] < torch.tensor(
            [p + t for p, t in zip(PROMPT_LENGTHS[block], RESPONSE_LENGTHS[block])])[:, None]).long()
        out = hf(ids, attention_mask=attention, output_router_logits=True)
        total = total + weight * load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K, attention)
    total = total / sum(weights)
    (COEF * total).backward()
    return total.item(), [layer.mlp.gate.weight.grad.clone() for layer in hf.model.layers]


def router_grads(ddp):
    """The step's gradient (``main_grad``) of each MoE layer's router weight, float64."""
    return [param.main_grad.double().clone() for name, param in ddp.module.named_parameters()
            if name.endswith("mlp.router.weight")]


def megatron_runs(layouts: dict, coefs, *, tp: int = 1, ep: int = 1) -> dict:
    """``(moe/aux_loss, router grads, all grads)`` per (layout name, coef), after one step's gradients
    on this rank's rows (the batch split evenly over data-parallel ranks) of one fp32 Megatron model.
    """
    from nemo_sspo.algorithms.losses import DAPOLossConfig, make_policy_loss
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups,
                                    initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_gradients, compute_old_logprobs, wrap_for_training
    from nemo_sspo.models import split_expert_weights
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    torch.set_num_threads(1)
    hf = hf_model()
    batch = policy_batch()
    initialize_parallel(tp_size=tp, pp_size=1, seed=0, ep_size=ep)
    try:
        groups = get_parallel_groups()
        rows = batch.input_ids.shape[0] // groups.dp_size
        local = batch.select(slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
        model = build_policy_model(hf.config)
        load_hf_into_megatron(model, split_expert_weights({k: v.float() for k, v in hf.state_dict().items()}),
                              hf.config)
        ddp, _ = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                   adam_eps=1e-8, clip_grad=0.0)
        vocab_start, vocab_size = vocab_shard(model)
        results = {}
        for coef in coefs:
            spec = LossSpec(loss=make_policy_loss("dapo", DAPOLossConfig()),
                            tp_group=groups.tp_group if tp > 1 else None, vocab_start=vocab_start,
                            vocab_size=vocab_size, temperature=1.0, max_response_length=8, output_chunk_size=16,
                            router_aux_loss_coef=coef)
            for name, layout in layouts.items():
                dp_group = groups.dp_group if groups.dp_size > 1 else None
                scored = compute_old_logprobs(ddp, local, spec, layout, dp_group=dp_group)
                sums = compute_gradients(ddp, scored, spec, layout, dp_group=dp_group)
                metrics = reduce_metric_sums(sums, dp_group=groups.dp_group, pp_group=groups.pp_group,
                                             last_stage_rank=groups.pp_last_rank, is_last_stage=groups.is_last_stage)
                grads = [p.main_grad.double().clone() for p in ddp.module.parameters()]
                results[name, coef] = (metrics.get("moe/aux_loss"), router_grads(ddp), grads)
    finally:
        destroy_parallel()
    return results


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max())



