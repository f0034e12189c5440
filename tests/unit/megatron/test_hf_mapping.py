"""Single-process Megatron GPTModel vs transformers' LlamaForCausalLM (the independent reference).

Covers: logits equality (tied / untied embeddings), export round trip, refit into a fresh HF model
after the Megatron weights changed, right padding, input validation, HF key checks, the CPU RNG
tracker (against Megatron's seed rule worked out by hand) and SmolLM2-135M's TP constraints.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_sspo.megatron import (
    build_policy_model,
    cpu_device_context,
    destroy_parallel,
    export_hf_state_dict,
    forward_logits,
    get_parallel_groups,
    initialize_parallel,
    load_hf_into_megatron,
    padded_vocab_size,
    transformer_config_from_hf,
    vocab_shard,
)
from tests.unit.mapping_cases import VOCAB, assert_same_tensors

SEQ = 7
SEED = 11


def _llama_config(tied: bool, **overrides) -> LlamaConfig:
    fields = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied, rope_theta=5000.0,
        max_position_embeddings=32, rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


@pytest.fixture(scope="module")
def parallel_1():
    initialize_parallel(tp_size=1, pp_size=1, seed=SEED)
    yield get_parallel_groups()
    destroy_parallel()


def _pair(tied: bool):
    """(hf_config, HF model, Megatron model loaded from it), both in eval mode."""
    config = _llama_config(tied)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).eval()
    model = build_policy_model(config).eval()
    load_hf_into_megatron(model, hf_model.state_dict(), config)
    return config, hf_model, model


def _inputs(batch: int = 2):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    return ids, torch.arange(SEQ).expand(batch, SEQ)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(parallel_1, tied):
    config, hf_model, model = _pair(tied)
    ids, positions = _inputs()
    with torch.no_grad():
        logits = forward_logits(model, ids, positions)
        expected = hf_model(ids).logits
    assert logits.shape == (2, SEQ, 128)  # vocab 100 padded to a multiple of 128 * tp = 128
    torch.testing.assert_close(logits[..., :VOCAB], expected, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(logits[..., VOCAB:]) == 0  # zero pad rows give exactly-zero logits
    assert vocab_shard(model) == (0, VOCAB)


@pytest.mark.parametrize("tied", [True, False])
def test_export_round_trip_and_refit(parallel_1, tied):
    config, hf_model, model = _pair(tied)
    original = hf_model.state_dict()
    assert_same_tensors(export_hf_state_dict(model, config), original)
    # Refit proof: change the Megatron weights (as an optimizer step would), export, load into a
    # fresh HF model, and compare its logits with Megatron's.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    refit = LlamaForCausalLM(config).eval()
    refit.load_state_dict(export_hf_state_dict(model, config), strict=True)
    ids, positions = _inputs()
    with torch.no_grad():
        logits = forward_logits(model, ids, positions)
        torch.testing.assert_close(refit(ids).logits, logits[..., :VOCAB], atol=1e-5, rtol=1e-5)


def test_right_padding_leaves_valid_positions_unchanged(parallel_1):
    _, _, model = _pair(tied=True)
    ids, positions = _inputs(batch=1)
    valid = 4
    padded = ids.clone()
    padded[:, valid:] = 0
    mask = torch.arange(SEQ).unsqueeze(0) < valid
    with torch.no_grad():
        full = forward_logits(model, padded, positions, attention_mask=mask)
        short = forward_logits(model, ids[:, :valid], positions[:, :valid])
    torch.testing.assert_close(full[:, :valid], short, atol=1e-6, rtol=1e-6)


def test_forward_logits_rejects_left_padding_and_shifted_positions(parallel_1):
    _, _, model = _pair(tied=True)
    ids, positions = _inputs(batch=1)
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="right padding"):
        forward_logits(model, ids, positions, attention_mask=left_padded)
    with pytest.raises(ValueError, match="position_ids"):
        forward_logits(model, ids, positions + 1)


def test_load_reports_missing_and_unexpected_keys(parallel_1):
    config, hf_model, model = _pair(tied=False)
    state = dict(hf_model.state_dict())
    del state["model.layers.2.mlp.up_proj.weight"]
    state["model.layers.3.mlp.up_proj.weight"] = torch.zeros(96, 64)
    expected = r"missing=\['model.layers.2.mlp.up_proj.weight'\], unexpected=\['model.layers.3"
    with pytest.raises(ValueError, match=expected):
        load_hf_into_megatron(model, state, config)


def test_load_rejects_untied_lm_head_for_tied_config(parallel_1):
    config, hf_model, model = _pair(tied=True)
    state = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_hf_into_megatron(model, state, config)


def test_cpu_rng_tracker_follows_megatron_seed_rule(parallel_1):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    # Megatron's rule: model-parallel stream seed = seed + 2718 + tp_rank = 11 + 2718 + 0 = 2729.
    expected = torch.rand(3, generator=torch.Generator().manual_seed(2729))
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        drawn = torch.rand(3)
    assert torch.equal(drawn, expected)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored


def test_cpu_device_context_rewrites_cuda_allocations():
    with cpu_device_context():
        tensor = torch.zeros(2, device="cuda")
        torch.cuda.synchronize()
    assert tensor.device.type == "cpu"


def test_padded_vocab_size_megatron_rule():
    assert padded_vocab_size(100, 1) == 128  # ceil(100 / 128) * 128
    assert padded_vocab_size(100, 2) == 256  # multiple 256
    assert padded_vocab_size(49152, 3) == 49152  # 49152 = 128 * 3 * 128: no padding


def _smollm2_135m_config() -> LlamaConfig:
    # SmolLM2-135M-Instruct's shape (GGUF metadata): hidden 576, 30 layers, 9 heads / 3 KV heads,
    # intermediate 1536, vocab 49,152, tied embeddings, rope_theta 100000, rms eps 1e-5.
    return LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5,
    )


def test_smollm2_shape_constraints():
    config = _smollm2_135m_config()
    megatron_config = transformer_config_from_hf(config, tp_size=3, pp_size=2)
    assert (megatron_config.num_query_groups, megatron_config.kv_channels) == (3, 64)  # 576 / 9
    assert megatron_config.ffn_hidden_size == 1536 and megatron_config.gated_linear_unit
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide the model's num_attention_heads=9 .*use one of 1, 3$"):
        transformer_config_from_hf(config, tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match="pp_size=4 does not divide the model's num_hidden_layers=30: use one of 1, 2, 3, 5, 6, 10, 15, 30$"):
        transformer_config_from_hf(config, tp_size=1, pp_size=4)


def test_kv_heads_must_divide_tp():
    config = _llama_config(tied=True, num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide the model's num_key_value_heads=1 .*use one of 1$"):
        transformer_config_from_hf(config, tp_size=2, pp_size=1)


def test_sequence_parallel_reaches_the_config_and_needs_tp():
    config = _smollm2_135m_config()
    assert transformer_config_from_hf(config, tp_size=3, pp_size=1, sequence_parallel=True).sequence_parallel
    assert not transformer_config_from_hf(config, tp_size=3, pp_size=1).sequence_parallel
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tp_size > 1 .*set sequence_parallel=False"):
        transformer_config_from_hf(config, tp_size=1, pp_size=1, sequence_parallel=True)


def test_local_norms_mark_their_weights_for_the_tp_all_reduce():
    """The local spec's norm (megatron-core's torch norm refuses sequence parallelism) is torch's
    RMSNorm with ``weight.sequence_parallel`` set as the config says: finalize_model_grads sums the
    gradients of exactly those parameters over TP."""
    from types import SimpleNamespace

    from nemo_sspo.megatron.sequence_parallel import SequenceParallelTorchNorm

    for flag in (True, False):
        cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=flag)
        norm = SequenceParallelTorchNorm(cfg, 8, eps=1e-6)
        assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6 and norm.weight.sequence_parallel is flag
    with pytest.raises(ValueError, match="normalization='L2Norm'"):
        SequenceParallelTorchNorm(SimpleNamespace(normalization="L2Norm", sequence_parallel=True), 8)
