"""fused_linear_logprobs_entropy at TP=2 on real gloo groups against a float64 single-process
reference of the materialised full-vocabulary logits (one spawn).

Rank r holds rows [8r, 8r + 8) of a 16-row output weight whose true vocabulary is 11 ids, so
rank 1's shard has 3 real rows and 5 padding rows. The hidden states are replicated (as Megatron's
output layer sees them without sequence parallelism); the gradient of h must be the sum of both
shards' contributions, the gradient of each weight shard its own rows of the reference.
"""

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.parallel import vocab_shard_range
from nemo_sspo.parallel.fused_output import fused_linear_logprobs_entropy

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

N, H, VOCAB, PADDED, TEMPERATURE = 7, 5, 11, 16, 0.8


def _inputs():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, H, generator=gen, dtype=torch.float64)
    weight[VOCAB:] = 4.0
    targets = torch.randint(0, VOCAB, (N,), generator=gen)
    targets[0], targets[1] = 0, VOCAB - 1  # one target on each rank's edge
    grads = torch.randn(2, N, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, grads


def _reference():
    hidden, weight, targets, grads = _inputs()
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    logp_all = torch.log_softmax((h @ w[:VOCAB].t()) / TEMPERATURE, dim=-1)
    logprobs = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), h.grad, w.grad


def _tp2(rank, world_size):
    hidden, weight, targets, grads = _inputs()
    start, end = vocab_shard_range(PADDED, rank, world_size)
    h = hidden.clone().requires_grad_(True)
    w = weight[start:end].clone().requires_grad_(True)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        logprobs, entropy = fused_linear_logprobs_entropy(
            h, w, targets, tp_group=dist.group.WORLD, vocab_start=start, vocab_size=VOCAB,
            temperature=TEMPERATURE, chunk_size=3)
        forward_calls = list(calls)
        ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    finally:
        dist.all_reduce = original
    return logprobs, entropy, h.grad, w.grad, (start, end), forward_calls, calls[len(forward_calls):]


def test_tp2_matches_float64_reference_and_counts_collectives(run_distributed):
    ref_lp, ref_h, ref_gh, ref_gw = _reference()
    for logprobs, entropy, grad_h, grad_w, (start, end), forward, backward in run_distributed(_tp2, 2):
        torch.testing.assert_close(logprobs, ref_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_h, ref_gh, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_w, ref_gw[start:end], rtol=0, atol=1e-12)
        # 3 chunks of <= 3 tokens: MAX [rows] then SUM [rows, 3] each; backward: one all-reduce
        # of the hidden-state gradient [N, H].
        assert forward == [(3,), (3, 3), (3,), (3, 3), (1,), (1, 3)]
        assert backward == [(N, H)]
