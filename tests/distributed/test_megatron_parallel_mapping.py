"""TP / PP / TP x PP Megatron GPTModel loaded from HF Llama weights: logits and refit export.

One world-4 spawn runs every layout (TP=2 x DP=2, PP=2 x DP=2, TP=2 x PP=2) for tied and untied
embeddings. The reference is transformers' LlamaForCausalLM on the full model in one process, so
the check covers QKV grouping + TP slicing, gate/up halves, PP layer offsets, vocab padding, the
pipeline schedule under the CPU shims, and the TP/PP gathers of the export.
"""

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_sspo.megatron import cpu_device_context, export_hf_state_dict, forward_logits, vocab_shard
from tests.distributed._megatron_layouts import check_world_4_layouts, megatron_layout
from tests.unit.mapping_cases import TINY, VOCAB, assert_same_tensors, megatron_copy

SEQ, MICRO_BATCH, MICROBATCHES = 6, 2, 2


def _llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(**(TINY | dict(num_hidden_layers=4, tie_word_embeddings=tied)))


def _pipeline_logits(model, batches):
    """Run Megatron's forward-only schedule; returns the last stage's logits per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected = []

    def loss_func(output):
        collected.append(output.detach())
        return output.sum() * 0.0, {}

    def forward_step(data_iterator, stage_model):
        ids = next(data_iterator)
        positions = torch.arange(SEQ).expand_as(ids)
        return forward_logits(stage_model, ids, positions), loss_func

    with cpu_device_context(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
            forward_only=True,
        )
    return collected


def _check_layout(tp: int, pp: int, tied: bool) -> None:
    config = _llama_config(tied)
    torch.manual_seed(1234)  # the same HF weights and inputs on every rank
    hf_model = LlamaForCausalLM(config).eval()
    hf_state = hf_model.state_dict()
    batches = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ)) for _ in range(MICROBATCHES)]
    with torch.no_grad():
        expected = [hf_model(ids).logits for ids in batches]

    with megatron_layout(tp, pp) as groups:
        model = megatron_copy(config, hf_state)
        logits = _pipeline_logits(model, batches)
        if groups.is_last_stage:
            vocab_start, true_vocab = vocab_shard(model)
            v_local = logits[0].shape[-1]
            # padded vocab 128 * tp: V_local = 128 for every tp
            assert (vocab_start, true_vocab, v_local) == (groups.tp_rank * 128, VOCAB, 128)
            for local, reference in zip(logits, expected):
                shards = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
                full = torch.cat(shards, dim=-1)
                torch.testing.assert_close(full[..., :VOCAB], reference, atol=1e-5, rtol=1e-5)
                assert torch.count_nonzero(full[..., VOCAB:]) == 0  # zero pad rows -> zero logits
        else:
            assert logits == []
        assert_same_tensors(export_hf_state_dict(model, config), hf_state, f"(tp={tp}, pp={pp}, tied={tied})")


def _all_layouts(rank: int, world_size: int) -> None:
    check_world_4_layouts(_check_layout)


def test_tp_pp_logits_and_export_match_hf(run_distributed):
    # 4 spawned ranks each import Megatron + transformers on a shared 2-core host: allow 300 s.
    run_distributed(_all_layouts, 4, timeout_s=300)
