"""Packed sequences in Megatron's THD layout (``nemo_sspo.megatron.packed_seq``) and how
``forward_logits`` routes a packed row by layer spec.

TransformerEngine cannot run on this CPU-only machine, so the TE spec is stood in for in two ways,
both named in the tests: (1) a wrapper module that records the keyword arguments ``forward_logits``
passes to the model; (2) a real Megatron ``GPTModel`` (local spec) marked as TE-built, with each
layer's core attention replaced by a plain causal softmax attention within each
``[cu_seqlens[i], cu_seqlens[i+1])`` span (what TE's ``TEDotProductAttention`` computes for
``qkv_format='thd'``). Everything around the attention kernel is Megatron's own code: the embedding,
the rotary table sized from ``max_seqlen``, ``_apply_rotary_pos_emb_thd`` (per-sequence positions),
the ``[T, 1, H]`` reshapes, the MLPs and the output layer. TE's kernels themselves are checked by
``tests/gpu/run_checks.sh``.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from nemo_sspo.megatron import build_policy_model, destroy_parallel, get_parallel_groups, initialize_parallel
from nemo_sspo.algorithms.micro_batches import packed_positions
from nemo_sspo.megatron import model as model_module
from nemo_sspo.megatron.model import forward_hidden, forward_logits, uses_transformer_engine
from nemo_sspo.megatron.packed_seq import packed_seq_params, padded_width, thd_alignment

VOCAB = 100


@pytest.fixture(scope="module")
def parallel_1():
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    yield get_parallel_groups()
    destroy_parallel()


def _model():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False, rope_theta=500.0,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return build_policy_model(config).eval()


class _Recorder(torch.nn.Module):
    """Stand-in (1): forwards to the wrapped model (found by ``unwrap_model`` through ``.module``,
    like DDP) and records each call's positional and keyword arguments."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.module(*args, **kwargs)


class _VarlenCausalAttention(torch.nn.Module):
    """Stand-in (2) for TE's THD attention: query [T, np, hn], key/value [T, ng, hn] (GQA groups
    repeated per query head as Megatron does), causal attention inside each cu_seqlens span."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        self.seen.append((attention_mask, packed_seq_params))
        cu = packed_seq_params.cu_seqlens_q.tolist()
        repeat = query.shape[1] // key.shape[1]
        parts = []
        for start, end in zip(cu[:-1], cu[1:]):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
            k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
            parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1))
        return torch.cat(parts).reshape(query.shape[0], -1)


def _as_te(model, seen: list):
    for layer in model.decoder.layers:
        layer.self_attention.core_attention = _VarlenCausalAttention(seen)
    model.transformer_impl = "transformer_engine"
    return model


# ---- PackedSeqParams worked by hand ------------------------------------------------------------

def test_params_for_lengths_2_3_4():
    params = packed_seq_params(torch.tensor([2, 3, 4]), "cpu")
    # cu_seqlens = [0, 2, 2+3, 2+3+4] = [0, 2, 5, 9]; the longest sequence has 4 tokens
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 2, 5, 9]
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == 4 and type(params.max_seqlen_q) is int
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    assert params.cp_group is None


def test_params_for_one_sequence_and_for_trailing_padding():
    one = packed_seq_params(torch.tensor([5]), "cpu")
    assert one.cu_seqlens_q.tolist() == [0, 5] and one.max_seqlen_q == 5
    # Padded to 16: the 16 - 9 = 7 filler tokens join the last sequence: 4 + 7 = 11 tokens
    padded = packed_seq_params(torch.tensor([2, 3, 4]), "cpu", total_length=16)
    assert padded.cu_seqlens_q.tolist() == [0, 2, 5, 16] and padded.max_seqlen_kv == 11
    assert padded_width(9, 16) == 16 and padded_width(16, 16) == 16 and padded_width(9, 1) == 9


@pytest.mark.parametrize("lengths, kwargs, message", [
    (torch.tensor([3, 0]), {}, r"must all be >= 1 .*\[3, 0\]"),
    (torch.tensor([], dtype=torch.long), {}, "non-empty 1-D integer"),
    (torch.tensor([2.0, 3.0]), {}, "non-empty 1-D integer"),
    (torch.tensor([2, 3]), {"total_length": 4}, r"total_length=4 is below the packed tokens \(5\)"),
])
def test_params_refuse_bad_lengths(lengths, kwargs, message):
    with pytest.raises(ValueError, match=message):
        packed_seq_params(lengths, "cpu", **kwargs)


class _Config:
    fp8, fp8_recipe, sequence_parallel, tensor_model_parallel_size, context_parallel_size = (
        None, "delayed", False, 2, 1)


@pytest.mark.parametrize("fields, expected", [
    ({}, 1),
    ({"fp8": "hybrid"}, 16),                        # Megatron's get_fp8_align_size
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, 32),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, 128),
    ({"fp8": "hybrid", "sequence_parallel": True}, 32),  # 16 per TP shard x tp 2
])
def test_thd_alignment(fields, expected):
    config = _Config()
    vars(config).update(fields)
    assert thd_alignment(config) == expected


def test_context_parallel_is_refused():
    config = _Config()
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2 .*parallel.pack_sequences=false"):
        thd_alignment(config)


# ---- routing by layer spec ---------------------------------------------------------------------

def test_te_spec_gets_packed_seq_params_and_no_mask(parallel_1):
    seen = []
    model = _Recorder(_as_te(_model(), seen))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = forward_logits(model, ids, packed_positions(torch.tensor([2, 3, 4]))[None],
                                sequence_lengths=torch.tensor([2, 3, 4]))
    (args, kwargs), = model.calls
    assert uses_transformer_engine(model)
    assert args[2] is None and kwargs["packed_seq_params"].cu_seqlens_q.tolist() == [0, 2, 5, 9]
    assert all(mask is None and params is kwargs["packed_seq_params"] for mask, params in seen)
    assert len(seen) == 2 and logits.shape == (1, 9, 128)


def test_local_spec_gets_block_mask_and_no_packed_seq_params(parallel_1):
    model = _Recorder(_model())
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        forward_logits(model, ids, packed_positions(torch.tensor([2, 3]))[None], sequence_lengths=torch.tensor([2, 3]))
    (args, kwargs), = model.calls
    assert not uses_transformer_engine(model) and "packed_seq_params" not in kwargs
    # True = masked: above the diagonal, and across the boundary between positions 1 and 2
    expected = torch.tensor([[0, 1, 1, 1, 1],
                             [0, 0, 1, 1, 1],
                             [1, 1, 0, 1, 1],
                             [1, 1, 0, 0, 1],
                             [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(args[2], expected.view(1, 1, 5, 5))


def test_local_spec_on_cuda_is_refused(parallel_1, monkeypatch):
    # attention_mask_for returns None on a CUDA device (the shim leaves the causal mask to Megatron)
    monkeypatch.setattr(model_module, "attention_mask_for", lambda *args, **kwargs: None)
    model = _model()
    with pytest.raises(ValueError, match=r"parallel\.pack_sequences=true on a CUDA device .*"
                                         r"model\.transformer_impl=transformer_engine"):
        forward_logits(model, torch.zeros(1, 5, dtype=torch.long), packed_positions(torch.tensor([2, 3]))[None],
                       sequence_lengths=torch.tensor([2, 3]))


def test_model_without_a_recorded_spec_is_refused(parallel_1):
    model = _model()
    del model.transformer_impl
    with pytest.raises(ValueError, match="no transformer_impl"):
        uses_transformer_engine(model)
    with pytest.raises(ValueError, match="at least one token"):
        forward_logits(_model(), torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None],
                       sequence_lengths=torch.tensor([5, 0]))


# ---- THD through the real GPTModel equals each sequence alone ----------------------------------

@pytest.mark.parametrize("alignment", [1, 16])
def test_thd_forward_equals_each_sequence_alone(parallel_1, monkeypatch, alignment):
    """Alignment 16 is what FP8 asks for: the 9-token row runs as 16 tokens, the last sequence
    absorbing the 7 fillers; forward_logits returns the 9 real positions."""
    monkeypatch.setattr(model_module, "thd_alignment", lambda config: alignment)
    model = _model()
    lengths = [2, 3, 4]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = [forward_logits(model, part, torch.arange(part.shape[1])[None])
                 for part in ids.split(lengths, dim=1)]
        seen = []
        _as_te(model, seen)
        positions = packed_positions(torch.tensor(lengths))[None]
        packed = forward_logits(model, ids, positions, sequence_lengths=torch.tensor(lengths))
        hidden = forward_hidden(model, ids, positions, sequence_lengths=torch.tensor(lengths))
    assert seen[0][1].cu_seqlens_q.tolist() == ([0, 2, 5, 9] if alignment == 1 else [0, 2, 5, 16])
    assert packed.shape == (1, 9, 128) and hidden.shape == (1, 9, 64)
    # fp32 on CPU: the same arithmetic in a different grouping, so agreement to float rounding
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
    reference = hidden @ model.output_layer.weight.T
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)


def test_startup_refuses_packing_with_the_local_spec_on_cuda(monkeypatch):
    from nemo_sspo.cli import load_config
    from nemo_sspo.trainer.device import check_host

    cfg = load_config(overrides=["model=tiny_random", "model.transformer_impl=local",
                                 "parallel.max_tokens_per_micro_batch=600", "parallel.pack_sequences=true"])
    check_host(cfg)  # CPU: the local spec packs with its block-diagonal mask
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host
    with pytest.raises(ValueError, match=r"parallel\.pack_sequences=true on a CUDA device .*"
                                         r"model\.transformer_impl='local'"):
        check_host(cfg)


# ---- local spec (CPU): rotary positions restart at every packed sequence -----------------------

@pytest.fixture(scope="module")
def long_row_model(parallel_1):
    """A Megatron fp32 model and its float64 Hugging Face twin (same weights).

    Init std 0.1, so that attention logits are O(1) and an error in a rotary angle shows in the
    log-probs.
    """
    from transformers import LlamaForCausalLM

    from nemo_sspo.megatron import load_hf_into_megatron

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                         initializer_range=0.1)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    model = build_policy_model(config).eval()
    load_hf_into_megatron(model, {k: v.clone() for k, v in hf.state_dict().items()}, config)
    return model, hf.double()


@pytest.mark.parametrize("offset", [1, 100, 2000])
def test_local_spec_packed_error_equals_unpacked_error_at_every_offset(long_row_model, offset):
    """Packed after ``offset`` tokens, a sequence's fp32 error equals its error alone.

    A 16-token sequence packed after ``offset`` tokens of another one: its fp32 log-probs are as
    far from float64 as the sequence's own run alone. With running row positions (before the fix)
    the fp32 angle of position p = offset + j carries an error growing with p: measured 1.7e-6,
    2.1e-6 and 2.4e-5 at offsets 1, 100 and 2,000 against 1.5e-6 alone (ratios 1.12, 1.34, 15.6);
    now each equals the alone error (bitwise on this machine). The 10% allowance is for
    kernels that round a longer row differently.
    """
    model, reference = long_row_model
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (16,), generator=gen)
    filler = torch.randint(0, VOCAB, (offset,), generator=gen)
    lengths = torch.tensor([offset, 16])
    with torch.no_grad():
        exact = torch.log_softmax(reference(seq[None]).logits[0], dim=-1)
        alone = forward_logits(model, seq[None], torch.arange(16)[None])[0, :, :VOCAB]  # no padding
        alone = torch.log_softmax(alone.double(), dim=-1)
        packed = forward_logits(model, torch.cat([filler, seq])[None], packed_positions(lengths)[None],
                                sequence_lengths=lengths)
        packed = torch.log_softmax(packed[0, offset:, :VOCAB].double(), dim=-1)
    alone_error = float((alone - exact).abs().max())
    packed_error = float((packed - exact).abs().max())
    assert 1e-7 < alone_error < 1e-5  # fp32 rounding, not a broken model
    assert packed_error <= 1.1 * alone_error, (packed_error, alone_error)


def test_packed_row_positions_must_restart(parallel_1):
    with pytest.raises(ValueError, match=r"must restart at 0 at every sequence .*got \[0, 1, 2, 3, 4\]"):
        forward_logits(_model(), torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None],
                       sequence_lengths=torch.tensor([2, 3]))
