"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads), both with an
untied output layer, under TP=2 and PP=2: logits, export, streamed refit and refit.

One world-2 spawn runs both architectures at TP=2 and then PP=2. The reference is transformers'
``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` on the full model in one process, in float64. Checks per
architecture and layout:

1. the TP-gathered fp32 logits of the last stage equal the float64 reference (rtol/atol 1e-5: fp32
   rounding in another reduction order); the vocabulary 100 is padded to 128 * tp rows whose
   logits are exactly 0;
2. ``export_hf_state_dict`` from the sharded model returns exactly the HF tensors (bit-equal, in
   HF key order, biases and q/k norms included), and the streamed refit
   (``iter_hf_weight_buckets`` with a budget below one layer) yields the same tensors bit for bit;
3. refit: after the Megatron weights change (as an optimizer step would), the exported dict
   loaded into a fresh HF model gives the same logits as Megatron;
4. ``parameter_counts`` (from one meta-device build) predicts each rank's real parameter count,
   for these untied models and for a tied Qwen3 (whose last PP stage holds its own embedding copy).

Biases and norm weights are redrawn away from transformers' init (0 and 1), so a dropped, permuted
or swapped bias / q_norm / k_norm changes the logits by far more than the tolerance.
"""

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nemo_sspo.megatron import build_policy_model, export_hf_state_dict, iter_hf_weight_buckets, parameter_counts
from tests.distributed._megatron_layouts import full_vocab_logits, megatron_layout
from tests.unit.mapping_cases import TINY, VOCAB, assert_same_tensors, float64_logits, megatron_copy, redraw_, relative_error

SEQ, BATCH = 6, 2
ARCHS = {
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**TINY)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(head_dim=24, **TINY)),  # 24 != 64 / 4
}


def _hf_model(arch: str, state=None):
    model_cls, config = ARCHS[arch]
    model = model_cls(config()).eval()
    if state is None:
        return redraw_(model)
    model.load_state_dict(state, strict=True)
    return model


def _streamed(model, config, groups) -> dict:
    """The streamed export on the engine rank, broadcast so every rank can compare it."""
    merged = {}
    for bucket in iter_hf_weight_buckets(model, config, bucket_bytes=1):  # one unit per bucket
        merged.update(bucket)
    payload = [merged if dist.get_rank() == groups.mp_src_rank else None]
    dist.broadcast_object_list(payload, src=groups.mp_src_rank)
    return payload[0]


def _check_layout(arch: str, tp: int, pp: int) -> dict:
    torch.manual_seed(1234)  # the same HF weights and inputs on every rank
    hf_model = _hf_model(arch)
    config = hf_model.config
    hf_state = hf_model.state_dict()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    expected = float64_logits(hf_model, ids)

    predicted = parameter_counts(config, tp_size=tp, pp_size=pp)
    with megatron_layout(tp, pp) as groups:
        model = megatron_copy(config, hf_state)
        assert sum(p.numel() for p in model.parameters()) == predicted[groups.pp_rank][groups.tp_rank]
        full = full_vocab_logits(model, ids)
        assert full.shape[-1] == 128 * tp  # vocab 100 padded to a multiple of 128 * tp
        torch.testing.assert_close(full[..., :VOCAB].double(), expected, atol=1e-5, rtol=1e-5)
        assert torch.count_nonzero(full[..., VOCAB:]) == 0
        exported = export_hf_state_dict(model, config)
        streamed = _streamed(model, config, groups)
        assert_same_tensors(exported, hf_state, f"({arch}, tp={tp}, pp={pp})")
        assert_same_tensors(streamed, hf_state, f"streamed ({arch}, tp={tp}, pp={pp})")

        # Refit: perturb the weights, export, reload into HF. The same seed on every rank keeps
        # TP-replicated parameters (norms) identical across ranks, as training does.
        generator = torch.Generator().manual_seed(100)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn(param.shape, generator=generator))
        moved = full_vocab_logits(model, ids)[..., :VOCAB]
        refit = _hf_model(arch, export_hf_state_dict(model, config))
        with torch.no_grad():
            refit_logits = refit(ids).logits
        torch.testing.assert_close(refit_logits, moved, atol=1e-5, rtol=1e-5)
        return {"rel_diff": relative_error(full[..., :VOCAB], expected),
                "refit_changed": float((refit_logits - expected).abs().max())}


def _tied_counts(tp: int, pp: int) -> None:
    config = Qwen3Config(head_dim=24, **(TINY | {"tie_word_embeddings": True}))
    predicted = parameter_counts(config, tp_size=tp, pp_size=pp)
    with megatron_layout(tp, pp) as groups:
        actual = sum(p.numel() for p in build_policy_model(config).parameters())
        assert actual == predicted[groups.pp_rank][groups.tp_rank], (tp, pp, actual, predicted)


def _all_layouts(rank: int, world_size: int) -> dict:
    for tp, pp in ((2, 1), (1, 2)):
        _tied_counts(tp, pp)
    return {(arch, tp, pp): _check_layout(arch, tp, pp) for arch in ARCHS for tp, pp in ((2, 1), (1, 2))}


def test_qwen2_and_qwen3_tp2_and_pp2_logits_export_and_refit(run_distributed):
    results = run_distributed(_all_layouts, 2, timeout_s=300)
    assert len(results[0]) == 4
    for layout, values in results[0].items():
        assert values["rel_diff"] < 1e-5, layout
        assert values["refit_changed"] > 1e-3, layout  # the perturbation really moved the logits
