"""Qwen2 (q/k/v biases, untied output layer) under TP=2 and PP=2: logits, export and refit.

One world-2 spawn runs TP=2 and then PP=2. The reference is transformers' Qwen2ForCausalLM on the
full model in one process (fp32). Checks per layout:

1. the TP-gathered logits of the last stage equal transformers' (atol 1e-5: fp32 reductions in a
   different order); the vocabulary 100 is padded to 128 * tp rows whose logits are exactly 0;
2. ``export_hf_state_dict`` from the sharded model returns exactly the HF tensors (bit-equal,
   in HF key order, biases included);
3. refit: after the Megatron weights change (as an optimizer step would), the exported dict
   loaded into a fresh HF model gives the same logits as Megatron.
"""

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_sspo.megatron import (
    build_policy_model,
    cpu_device_context,
    destroy_parallel,
    export_hf_state_dict,
    forward_logits,
    get_parallel_groups,
    initialize_parallel,
    load_hf_into_megatron,
)

VOCAB, SEQ, BATCH = 100, 6, 2


def _config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )


def _hf_model(config, state=None) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(config).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
        return model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)  # transformers zero-initialises biases
    return model


def _megatron_logits(model, ids):
    """Full-vocabulary logits [B, S, V_padded] on every rank (pipeline schedule, TP all-gather)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    groups = get_parallel_groups()
    collected = []

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        output = forward_logits(stage_model, batch, torch.arange(SEQ).expand_as(batch))
        return output, lambda out: (collected.append(out.detach()) or out.sum() * 0.0, {})

    with cpu_device_context(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=True,
        )
    local = collected[0] if groups.is_last_stage else torch.empty(BATCH, SEQ, 128)
    shards = [torch.empty_like(local) for _ in range(groups.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
    full = torch.cat(shards, dim=-1)
    dist.broadcast(full, src=groups.pp_last_rank, group=groups.pp_group)
    return full


def _check_layout(tp: int, pp: int) -> dict:
    config = _config()
    torch.manual_seed(1234)  # the same HF weights and inputs on every rank
    hf_model = _hf_model(config)
    hf_state = hf_model.state_dict()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        expected = hf_model(ids).logits

    initialize_parallel(tp_size=tp, pp_size=pp, seed=7)
    try:
        model = build_policy_model(config).eval()
        load_hf_into_megatron(model, hf_state, config)
        full = _megatron_logits(model, ids)
        assert full.shape[-1] == 128 * tp  # vocab 100 padded to a multiple of 128 * tp
        torch.testing.assert_close(full[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)
        assert torch.count_nonzero(full[..., VOCAB:]) == 0
        exported = export_hf_state_dict(model, config)
        assert list(exported) == list(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(exported[name], tensor), f"{name} (tp={tp}, pp={pp})"

        # Refit: perturb the weights, export, reload into HF. The same seed on every rank keeps
        # TP-replicated parameters (norms) identical across ranks, as training does.
        generator = torch.Generator().manual_seed(100)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn(param.shape, generator=generator))
        moved = _megatron_logits(model, ids)[..., :VOCAB]
        refit = _hf_model(config, export_hf_state_dict(model, config))
        with torch.no_grad():
            refit_logits = refit(ids).logits
        torch.testing.assert_close(refit_logits, moved, atol=1e-5, rtol=1e-5)
        return {"max_abs_diff": float((full[..., :VOCAB] - expected).abs().max()),
                "refit_changed": float((refit_logits - expected).abs().max())}
    finally:
        destroy_parallel()


def _both_layouts(rank: int, world_size: int) -> dict:
    return {layout: _check_layout(*layout) for layout in ((2, 1), (1, 2))}


def test_qwen2_tp2_and_pp2_logits_export_and_refit(run_distributed):
    results = run_distributed(_both_layouts, 2, timeout_s=240)
    for layout, values in results[0].items():
        assert values["max_abs_diff"] < 1e-5, layout
        assert values["refit_changed"] > 1e-3, layout  # the perturbation really moved the logits
