"""fused_linear_logprobs_entropy in one process against an independent float64 reference:
materialised logits h W^T / tau, log_softmax over the true vocabulary, gather, -sum p log p, and
float64 autograd for the gradients of h and W (padding rows of W must get exactly 0)."""

import math

import pytest
import torch

from nemo_sspo.parallel.fused_output import fused_linear_logprobs_entropy

N, H, VOCAB, PADDED = 9, 6, 11, 16  # rows 11..15 of W are Megatron's vocabulary padding


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, H, generator=gen, dtype=torch.float64)
    weight[VOCAB:] = 5.0  # large logits that would dominate if the padding leaked
    targets = torch.randint(0, VOCAB, (N,), generator=gen)
    targets[0], targets[1] = 0, VOCAB - 1
    grads = torch.randn(2, N, generator=gen, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, grads


def _reference(hidden, weight, targets, temperature, grads):
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logp_all = torch.log_softmax((h @ w[:VOCAB].t()) / temperature, dim=-1)
    logprobs = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_matches_materialised_reference(chunk_size, temperature):
    hidden, weight, targets, grads = _inputs(torch.float64)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logprobs, entropy = fused_linear_logprobs_entropy(
        h, w, targets, tp_group=None, vocab_start=0, vocab_size=VOCAB, temperature=temperature,
        chunk_size=chunk_size)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    ref_lp, ref_h, ref_gh, ref_gw = _reference(hidden, weight, targets, temperature, grads)
    torch.testing.assert_close(logprobs, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(h.grad, ref_gh, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, ref_gw, rtol=0, atol=1e-12)
    assert torch.equal(w.grad[VOCAB:], torch.zeros(PADDED - VOCAB, H, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_within_rounding_of_reference(dtype):
    hidden, weight, targets, grads = _inputs(dtype, seed=1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logprobs, entropy = fused_linear_logprobs_entropy(
        h, w, targets, tp_group=None, vocab_start=0, vocab_size=VOCAB, temperature=0.7,
        chunk_size=4)
    ((grads[0].float() * logprobs).sum() + (grads[1].float() * entropy).sum()).backward()
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert h.grad.dtype == w.grad.dtype == dtype
    # Forward: the reduction accumulates in fp32, so on the logits the output layer produces in
    # ``dtype`` (rounded once, as any output layer's) it matches float64 to fp32 precision.
    logp_all = torch.log_softmax((hidden @ weight.t()).double()[:, :VOCAB] / 0.7, dim=-1)
    torch.testing.assert_close(logprobs.double(), logp_all.gather(1, targets[:, None])[:, 0],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(logp_all.exp() * logp_all).sum(-1),
                               rtol=0, atol=1e-5)
    # Gradients: float64 gradients of the same inputs, up to the rounding of the logits and of
    # the gradients to ``dtype`` (2^-8 relative for bf16, ~1e-6 for fp32) times their scale.
    _, _, ref_gh, ref_gw = _reference(hidden, weight, targets, 0.7, grads)
    rel = 2.0**-6 if dtype == torch.bfloat16 else 1e-5
    for got, ref in ((h.grad, ref_gh), (w.grad, ref_gw)):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=rel * float(ref.abs().max()))


def test_hand_worked_two_token_vocabulary():
    # h = [1], W = [[0], [ln 3]]: logits [0, ln 3], p = [1/4, 3/4]. Target 1: log p = ln(3/4)
    # = -0.287682; H = (1/4) ln 4 + (3/4) ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    # d log p_1 / d logits = [-1/4, 1/4]; dlogits/dW_v = h = 1, dlogits/dh = W_v:
    # d/dW = [-0.25, 0.25], d/dh = -0.25 * 0 + 0.25 * ln 3 = 0.274653.
    h = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    logprobs, entropy = fused_linear_logprobs_entropy(h, w, torch.tensor([1]), tp_group=None,
                                                      vocab_start=0, vocab_size=2)
    assert logprobs.item() == pytest.approx(-0.287682, abs=1e-6)
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    logprobs.sum().backward()
    assert w.grad.flatten().tolist() == pytest.approx([-0.25, 0.25], abs=1e-12)
    assert h.grad.item() == pytest.approx(0.25 * math.log(3.0), abs=1e-12)


def test_errors_name_the_argument():
    hidden, weight, targets, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="same H"):
        fused_linear_logprobs_entropy(hidden, weight[:, :3], targets, tp_group=None,
                                      vocab_start=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="one dtype"):
        fused_linear_logprobs_entropy(hidden.double(), weight, targets, tp_group=None,
                                      vocab_start=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="expected vocab_start=0"):
        fused_linear_logprobs_entropy(hidden, weight, targets, tp_group=None, vocab_start=4,
                                      vocab_size=VOCAB)
    bad = hidden.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="row 3: its logits contain NaN"):
        fused_linear_logprobs_entropy(bad, weight, targets, tp_group=None, vocab_start=0,
                                      vocab_size=VOCAB)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_padding_rows_never_enter_a_product(bad):
    # A host's own shard may hold anything past vocab_size. The logits function never reads those
    # columns; the fused layer must not read those rows either: before the fix the backward
    # formed grad_logits @ W over all V_local rows, and its zero padding columns times NaN (or
    # inf) made every entry of dL/dh NaN while the forward outputs stayed right.
    hidden, weight, targets, grads = _inputs(torch.float64, seed=2)
    weight[VOCAB:] = bad
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logprobs, entropy = fused_linear_logprobs_entropy(
        h, w, targets, tp_group=None, vocab_start=0, vocab_size=VOCAB, temperature=0.7,
        chunk_size=4)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    # The float64 reference reads only W[:VOCAB], so its values do not depend on the padding.
    ref_lp, ref_h, ref_gh, ref_gw = _reference(hidden, weight, targets, 0.7, grads)
    torch.testing.assert_close(logprobs, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(h.grad, ref_gh, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad[:VOCAB], ref_gw[:VOCAB], rtol=0, atol=1e-12)
    assert torch.equal(w.grad[VOCAB:], torch.zeros(PADDED - VOCAB, H, dtype=torch.float64))
