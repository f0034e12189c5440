"""Model FLOPs, peak table and per-step throughput (nemo_sspo.trainer.throughput): counts by hand for
a tiny model, and a second count by torch's FlopCounterMode on the same shape in transformers."""

import dataclasses
import re

import pytest
import torch

from nemo_sspo.trainer.throughput import (
    ModelShape,
    PEAK_TFLOPS_ENV,
    forward_flops,
    peak_tflops,
    step_work_sums,
    summarize_throughput,
    throughput_metrics,
)

# L=2 layers, h=8, 2 query heads and 1 key/value head of d=4, gated MLP f=16, V=10.
TINY = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, ffn_size=16, vocab_size=10)


def test_forward_flops_by_hand():
    # Per layer and token: q 8*8=64, k and v 2*8*4=64, o 8*8=64, MLP 3*8*16=384 -> 576 MACs;
    # x2 FLOPs per MAC x 2 layers = 2,304 FLOPs per token; sequences of 3 and 5 tokens: 8 tokens -> 18,432.
    # Causal attention pairs: 3*4/2 + 5*6/2 = 6 + 15 = 21; QK^T and AV: 2 * 2 FLOPs * 2 layers * 2 heads
    # * 4 dims * 21 = 1,344. Logits of 4 tokens: 2 * 4 * 8 * 10 = 640. Total 18,432 + 1,344 + 640 = 20,416.
    assert TINY.linear_flops_per_token() == 2304
    assert forward_flops(TINY, torch.tensor([3, 5]), logit_tokens=4) == 20416.0


def test_step_work_sums_by_hand():
    # Sequences 2+1=3 and 3+4=7 tokens, 5 response tokens: linear 2,304 * 10 = 23,040; attention pairs
    # 6 + 28 = 34 -> (2 * 2 * 2 * 2 * 4 = 64) * 34 = 2,176; logits 2 * 5 * 8 * 10 = 800; forward 26,016;
    # x4 passes = 104,064; generation with a KV cache: one forward, 26,016.
    sums = step_work_sums(torch.tensor([2, 3]), torch.tensor([1, 4]), TINY, forward_passes=4)
    assert {k: (float(p.total), float(p.count)) for k, p in sums.items()} == {
        "tokens/prompt": (5.0, 1.0), "tokens/response": (5.0, 1.0), "flops/train": (104064.0, 1.0),
        "flops/generation": (26016.0, 1.0)}


def test_counts_agree_with_torch_flop_counter_forward_and_backward():
    """A second count: FlopCounterMode on transformers' Llama with TINY's shape (eager attention, which
    multiplies all s x s query/key pairs, not only the causal ones, and computes logits at every
    position), over the decoder layers and the output layer (the rotary table's tiny matmul is not
    model work). Backward must cost exactly twice the forward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, num_hidden_layers=2, vocab_size=10, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    assert ModelShape.from_hf_config(config) == TINY
    s = 5
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=torch.arange(s).unsqueeze(0))
    forward = _model_work(counter)
    # Eager attention counts s^2 = 25 pairs per head where causal attention needs s(s+1)/2 = 15.
    extra = 4 * TINY.num_layers * TINY.num_heads * TINY.head_dim * (s * s - s * (s + 1) // 2)
    assert forward == forward_flops(TINY, torch.tensor([s]), logit_tokens=s) + extra
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=torch.arange(s).unsqueeze(0)).logits.sum().backward()
    assert _model_work(counter) == 3 * forward  # forward + backward


def _model_work(counter) -> int:
    counts = counter.get_flop_counts()
    return sum(sum(counts[name].values()) for name in counts
               if re.search(r"\.layers\.\d+$", name) or name.endswith(".lm_head"))


@pytest.mark.parametrize("name, precision, fp8, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.5),
    ("NVIDIA H100 80GB HBM3", "bf16", True, 1979.0),
    ("NVIDIA H100 PCIe", "bf16", False, 756.5),
    ("NVIDIA H200", "bf16", False, 989.5),
    ("NVIDIA H200 NVL", "bf16", True, 1670.5),
    ("NVIDIA B200", "bf16", False, 2250.0),
    ("NVIDIA B200", "bf16", True, 4500.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, None),  # not in the table
    ("NVIDIA H100 80GB HBM3", "fp32", False, None),  # no fp32 column
    (None, "fp32", False, None),  # CPU
])
def test_peak_table(monkeypatch, name, precision, fp8, expected):
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    assert peak_tflops(name, precision, fp8) == expected


def test_peak_from_the_environment(monkeypatch):
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "312")
    assert peak_tflops(None, "fp32", False) == 312.0
    for bad in ("fast", "-1", "0", "inf"):
        monkeypatch.setenv(PEAK_TFLOPS_ENV, bad)
        with pytest.raises(ValueError, match=f"{PEAK_TFLOPS_ENV}='{bad}' must be a positive number"):
            peak_tflops("NVIDIA H100 80GB HBM3", "bf16", False)


REDUCED = {"tokens/prompt": 100.0, "tokens/response": 50.0, "flops/train": 1e12, "flops/generation": 0.25e12,
           "timing/rollout_generation_s": 2.0, "timing/train_s": 4.0, "timing/step_s": 10.0}
# Totals over 2 data-parallel ranks: 200 prompt + 100 response tokens, 2e12 training FLOPs, 0.5e12 generation.
TOTALS = {"tokens/prompt": 200.0, "tokens/response": 100.0, "flops/train": 2e12, "flops/generation": 0.5e12}
TRAINING_SIDE = {  # 4 training GPUs, 4 s of training
    "throughput/train_tokens_per_s": 75.0,  # 300 / 4 s
    "throughput/train_tokens_per_s_per_gpu": 18.75,  # 75 / 4 GPUs
    "throughput/train_tflops_per_gpu": 0.125,  # 2e12 / 4 s / 4 GPUs / 1e12
    "throughput/train_mfu": 0.25,  # 0.125 / 0.5
    "throughput/generation_tokens_per_s": 50.0,  # 100 / 2 s of the rollout side's own generation
}


def test_throughput_metrics_by_hand_colocated():
    out = throughput_metrics(REDUCED, dp_size=2, training_gpus=4, rollout_gpus=None, peak=0.5)
    assert out == pytest.approx({**TOTALS, **TRAINING_SIDE,
        "throughput/tokens_per_s_per_gpu": 7.5,  # 300 / 10 s / 4 GPUs (generation runs on the same 4)
        "throughput/tflops_per_gpu": 0.0625,  # 2.5e12 / 10 s / 4 GPUs / 1e12
        "throughput/mfu": 0.125,
        "throughput/generation_tokens_per_s_per_gpu": 12.5,  # 50 / 4 GPUs
        "throughput/generation_tflops_per_gpu": 0.0625,  # 0.5e12 / 2 s / 4 GPUs / 1e12
        "throughput/generation_mfu": 0.125,
    }, rel=1e-12)
    no_peak = throughput_metrics(REDUCED, dp_size=2, training_gpus=4, rollout_gpus=None, peak=None)
    assert not [key for key in no_peak if key.endswith("mfu")]


def test_throughput_metrics_by_hand_separate():
    out = throughput_metrics(REDUCED, dp_size=2, training_gpus=4, rollout_gpus=2, peak=0.5)
    assert out == pytest.approx({**TOTALS, **TRAINING_SIDE,
        "throughput/tokens_per_s_per_gpu": 5.0,  # 300 / 10 s / (4 + 2) GPUs
        "throughput/tflops_per_gpu": 2.5 / 60,  # 2.5e12 / 10 s / 6 GPUs / 1e12
        "throughput/mfu": 2.5 / 30,
        "throughput/generation_tokens_per_s_per_gpu": 25.0,  # 50 / 2 rollout GPUs
        "throughput/generation_tflops_per_gpu": 0.125,  # 0.5e12 / 2 s / 2 GPUs / 1e12
        "throughput/generation_mfu": 0.25,
    }, rel=1e-12)
    # A step that generated nothing (window of 0 s) has no rollout-side rates.
    idle = throughput_metrics({**REDUCED, "timing/rollout_generation_s": 0.0}, dp_size=2, training_gpus=4,
                              rollout_gpus=2, peak=0.5)
    assert not [key for key in idle if key.startswith("throughput/generation")]


def test_summary_skips_the_first_step_and_takes_the_peak_memory_maximum():
    history = [{"step": 1, "timing/step_s": 9.0, "memory/peak_allocated_gib": 1.0},
               {"step": 2, "timing/step_s": 2.0, "memory/peak_allocated_gib": 3.0},
               {"step": 3, "timing/step_s": 4.0, "memory/peak_allocated_gib": 2.0}]
    assert summarize_throughput(history) == {"summary/timing/step_s": 3.0, "summary/memory/peak_allocated_gib": 3.0,
                                             "summary/steps": 2.0}
    assert summarize_throughput(history[:1]) == {"summary/timing/step_s": 9.0,
                                                 "summary/memory/peak_allocated_gib": 1.0, "summary/steps": 1.0}
    assert summarize_throughput([]) == {}


def _tiny_moe_config(**extra):
    from transformers import Qwen3MoeConfig

    # The shape of model=tiny_random_qwen3_moe (nemo_sspo/models/hf_checkpoint.py) with a 50-row vocabulary.
    return Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=50, moe_intermediate_size=32, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, **extra)


def test_moe_flops_count_the_active_experts_by_hand():
    shape = ModelShape.from_hf_config(_tiny_moe_config())
    # Per layer and token: q 64*128 = 8,192, k and v 2*64*64 = 8,192, o 128*64 = 8,192 -> 24,576 MACs;
    # MLP: router 64*8 = 512 + 2 experts of 3*64*32 = 6,144 each -> 12,800 (the dense intermediate_size
    # would give 3*64*128 = 24,576: 1.92x too many). (24,576 + 12,800) * 2 FLOPs * 2 layers = 149,504.
    assert shape.linear_flops_per_token() == 149_504
    # The same shape with every layer dense: (24,576 + 24,576) * 2 * 2 = 196,608 (the count the MoE
    # layers must not fall back to).
    assert dataclasses.replace(shape, moe_layers=0).linear_flops_per_token() == 196_608


def test_moe_counts_agree_with_torch_flop_counter():
    """A second count: FlopCounterMode on transformers' Qwen3-MoE (routed experts, no shared one) and
    Qwen2-MoE (a gated shared expert of width 48 and a dense layer, mlp_only_layers=[1]), with the
    experts run one by one on the tokens routed to them (experts_implementation="eager")."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    eager = dict(attn_implementation="eager", experts_implementation="eager")
    qwen2 = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                           mlp_only_layers=[1], **eager)
    s = 5
    for model_class, config in ((Qwen3MoeForCausalLM, _tiny_moe_config(**eager)), (Qwen2MoeForCausalLM, qwen2)):
        torch.manual_seed(0)
        model = model_class(config)
        shape = ModelShape.from_hf_config(config)
        counter = FlopCounterMode(display=False)
        with counter:
            model(input_ids=torch.arange(s).unsqueeze(0))
        extra = 4 * shape.num_layers * shape.num_heads * shape.head_dim * (s * s - s * (s + 1) // 2)  # eager s^2
        assert _model_work(counter) == forward_flops(shape, torch.tensor([s]), logit_tokens=s) + extra, model_class
    assert (ModelShape.from_hf_config(qwen2).moe_layers, ModelShape.from_hf_config(qwen2).shared_expert_gate) == (2, True)


def test_moe_flops_of_qwen3_30b_a3b_match_its_active_parameters():
    from nemo_sspo.models.published import published_config

    # Active parameters per token (tests/unit/megatron/test_parameter_counts.py, the card's "3.3B activated"):
    # 3,353,032,704. Of those, norms (48 * (2*128 + 2*2048) + 2048 = 210,944) and the embedding
    # (151,936 * 2048 = 311,164,928: a lookup) do no matmul; every other weight is one multiply-add
    # per token: 2 FLOPs each, the untied output layer included.
    shape = ModelShape.from_hf_config(published_config("Qwen/Qwen3-30B-A3B"))
    matmul_weights = 3_353_032_704 - 210_944 - 311_164_928
    assert shape.linear_flops_per_token() + 2 * shape.hidden_size * shape.vocab_size == 2 * matmul_weights
