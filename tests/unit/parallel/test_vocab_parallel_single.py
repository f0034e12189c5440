"""Single-process (tp_group=None) checks of vocab_parallel_logprobs_entropy and vocab_shard_range.

References are independent: torch.log_softmax + gather, -sum p log p, float64 autograd,
torch.autograd.gradcheck (finite differences) and hand-worked values.
"""

import math

import pytest
import torch

from nemo_sspo.parallel import vocab_parallel_logprobs_entropy, vocab_shard_range


def _run(logits, targets, **kwargs):
    kwargs.setdefault("vocab_size", logits.shape[1])
    return vocab_parallel_logprobs_entropy(logits, targets, tp_group=None, vocab_start=0, **kwargs)


def _reference(logits, targets, vocab_size, temperature=1.0):
    logp_all = torch.log_softmax(logits[:, :vocab_size].double() / temperature, dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, -(logp_all.exp() * logp_all).sum(-1)


def _random(n=5, v=40, scale=3.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(n, v, generator=gen)).to(dtype)
    return logits, torch.randint(0, v, (n,), generator=gen)


def test_hand_worked_uniform_and_two_token_values():
    # Uniform over 4 ids: log p = log 1/4 = -1.386294, H = log 4 = 1.386294.
    # Logits [0, log 3] over 2 ids: p = [1/4, 3/4], log p_0 = -1.386294,
    # H = -(1/4 log 1/4 + 3/4 log 3/4) = 0.346574 + 0.215762 = 0.562335.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -50.0, -50.0]])
    logprobs, entropy = _run(logits, torch.tensor([2, 0]))  # e^-50 terms are below 1e-20
    torch.testing.assert_close(logprobs, torch.tensor([-1.386294, -1.386294]), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, torch.tensor([1.386294, 0.562335]), rtol=0, atol=1e-5)


def test_world_size_one_matches_log_softmax_gather_fp32():
    logits, targets = _random(n=7, v=1000)
    logprobs, entropy = _run(logits, targets)
    fp32_logp = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(
        logprobs, fp32_logp.gather(1, targets.unsqueeze(-1)).squeeze(-1), rtol=0, atol=2e-6
    )
    torch.testing.assert_close(entropy, -(fp32_logp.exp() * fp32_logp).sum(-1), rtol=0, atol=2e-6)
    assert logprobs.dtype == entropy.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_temperature_padding_and_gradients_vs_float64(dtype):
    # V=13 true ids in a 16-column shard; padding columns hold a value that would dominate.
    logits, targets = _random(n=6, v=16, dtype=dtype, seed=1)
    logits[:, 13:] = 30.0
    targets = targets % 13
    grads = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))
    untouched = logits.clone()
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = _run(leaf, targets, vocab_size=13, temperature=0.7, chunk_size=4)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()

    ref_leaf = logits.double().requires_grad_(True)
    ref_lp, ref_h = _reference(ref_leaf, targets, 13, temperature=0.7)
    ((grads[0].double() * ref_lp).sum() + (grads[1].double() * ref_h).sum()).backward()
    # fp32 accumulation of exactly representable inputs: ~1e-6 on values ~10; the gradient is
    # rounded once to the input dtype (relative 2^-8 for bf16, 2^-11 for fp16).
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), rtol=0, atol=1e-5)
    rtol = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=rtol, atol=1e-6)
    assert torch.all(leaf.grad[:, 13:] == 0)
    assert torch.equal(leaf.detach(), untouched)  # docs/pitfalls.md#p7: input never modified


def test_p7_input_unchanged_and_entropy_after_logprobs_from_same_tensor():
    # docs/pitfalls.md#p7: an in-place max subtraction would corrupt the caller's tensor; a second call on the
    # same tensor and a clone-based reference must both still agree.
    logits, targets = _random(n=4, v=32, seed=3)
    leaf = logits.clone().requires_grad_(True)
    first_lp, _ = _run(leaf, targets)
    _, second_h = _run(leaf, targets)
    (first_lp.sum() + second_h.sum()).backward()
    ref_leaf = logits.clone().double().requires_grad_(True)
    ref_lp, ref_h = _reference(ref_leaf, targets, 32)
    (ref_lp.sum() + ref_h.sum()).backward()
    assert torch.equal(leaf.detach(), logits)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=0, atol=1e-6)


def test_p9_chunking_over_tokens_is_exact():
    logits, targets = _random(n=3, v=8, seed=4)
    full_lp, full_h = _run(logits, targets)
    for chunk in (1, 4):
        lp, h = _run(logits, targets, chunk_size=chunk)
        assert torch.equal(h, full_h) and torch.equal(lp, full_lp), chunk


def test_p8_gradcheck_float64_both_outputs_with_padding_and_temperature():
    logits, targets = _random(n=3, v=9, seed=5, dtype=torch.float64)
    targets = targets % 7

    def both(x):
        return _run(x, targets, vocab_size=7, temperature=0.7, chunk_size=2)

    assert torch.autograd.gradcheck(both, (logits.requires_grad_(True),), eps=1e-6, atol=1e-8)


def test_single_output_gradients():
    # Only logprobs used: NLL gradient p - onehot; only entropy used: -p (log p + H).
    logits, targets = _random(n=4, v=12, seed=6, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(targets, 12).double()
    h = -(p * p.log()).sum(-1, keepdim=True)
    for use_entropy, expected in ((False, p - onehot), (True, -p * (p.log() + h))):
        leaf = logits.clone().requires_grad_(True)
        logprobs, entropy = _run(leaf, targets)
        (entropy.sum() if use_entropy else -logprobs.sum()).backward()
        torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=1e-12)


def test_no_megatron_global_state_and_no_communication(monkeypatch):
    # Distributed functions take their group explicitly: never Megatron's global parallel state.
    import megatron.core.parallel_state as parallel_state

    def forbidden(*args, **kwargs):
        raise AssertionError("global parallel state was read")

    for name in (
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size",
    ):
        monkeypatch.setattr(parallel_state, name, forbidden)
    monkeypatch.setattr(torch.distributed, "all_reduce", forbidden)
    logits, targets = _random(n=3, v=10, seed=7)
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = _run(leaf, targets)
    (logprobs.sum() + entropy.sum()).backward()
    ref_lp, ref_h = _reference(logits, targets, 10)
    torch.testing.assert_close(logprobs.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0, atol=1e-5)


def test_empty_batch():
    empty = torch.zeros(0, 5, requires_grad=True)
    logprobs, entropy = _run(empty, torch.zeros(0, dtype=torch.long))
    assert logprobs.shape == entropy.shape == (0,)


def test_vocab_shard_range():
    # 16 padded ids over 4 ranks: 4 ids each; rank 2 holds [8, 12).
    assert vocab_shard_range(16, 2, 4) == (8, 12)
    assert vocab_shard_range(151936, 1, 2) == (75968, 151936)
    for bad in ((15, 0, 4), (16, 4, 4), (16, 0, 0)):
        with pytest.raises(ValueError):
            vocab_shard_range(*bad)


@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(logits=torch.zeros(2, 3, 4)), "logits"),
        (dict(targets=torch.zeros(2, dtype=torch.int32)), "targets"),
        (dict(targets=torch.tensor([0, 4])), "targets"),
        (dict(targets=torch.tensor([-100, 1])), "targets"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(vocab_start=4), "tp_group"),
        (dict(vocab_start=0, vocab_size=5), "vocab_size=5"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, argument):
    kwargs = dict(
        logits=torch.zeros(2, 4), targets=torch.tensor([0, 1]), tp_group=None, vocab_start=0,
        vocab_size=4,
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=argument):
        vocab_parallel_logprobs_entropy(kwargs.pop("logits"), kwargs.pop("targets"), **kwargs)


def test_neg_inf_logit_is_probability_zero_with_zero_gradient():
    # Logits [0, ln 2, ln 3, -inf]: p = [1/6, 2/6, 3/6, 0]. Target 2: log p = ln(1/2) = -0.693147.
    # H = (1/6) ln 6 + (1/3) ln 3 + (1/2) ln 2 = 0.298627 + 0.366204 + 0.346574 = 1.011404.
    # d(log p_2 + H)/dz_v = (1[v=2] - p_v) - p_v (ln p_v + H): for v = 0, 1, 2
    # -1/6 + 0.130059 = -0.036608; -1/3 + 0.029069 = -0.304264; 1/2 - 0.159128 = 0.340872; 0 at -inf.
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), -math.inf]], requires_grad=True)
    logprobs, entropy = _run(logits, torch.tensor([2]))
    torch.testing.assert_close(logprobs, torch.tensor([-0.693147]), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, torch.tensor([1.011404]), rtol=0, atol=1e-6)
    (logprobs + entropy).sum().backward()
    expected = torch.tensor([[-0.036608, -0.304264, 0.340872, 0.0]])
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_neg_inf_columns_match_reference_without_them(dtype):
    # Masking ids with -inf must equal dropping those columns (float64 reference over the rest);
    # temperature and a whole row block of -inf (CPU blocks split rows) included.
    logits, targets = _random(n=6, v=12, dtype=dtype, seed=7)
    keep = torch.tensor([0, 2, 3, 5, 8, 9, 11])
    masked = torch.full_like(logits, -math.inf)
    masked[:, keep] = logits[:, keep]
    targets = keep[targets % len(keep)]
    masked.requires_grad_(True)
    logprobs, entropy = _run(masked, targets, temperature=0.7)
    (logprobs.sum() + 0.5 * entropy.sum()).backward()
    dense = logits[:, keep].double().requires_grad_(True)
    ref_all = torch.log_softmax(dense / 0.7, dim=-1)
    local_targets = torch.searchsorted(keep, targets)
    ref_lp = ref_all.gather(1, local_targets[:, None])[:, 0]
    ref_h = -(ref_all.exp() * ref_all).sum(-1)
    (ref_lp.sum() + 0.5 * ref_h.sum()).backward()
    tol = dict(rtol=2.0**-7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=0, atol=2e-6)
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), rtol=0, atol=2e-6)
    grad = masked.grad.double()
    torch.testing.assert_close(grad[:, keep], dense.grad, **tol)
    dropped = torch.ones(12, dtype=torch.bool)
    dropped[keep] = False
    assert torch.equal(grad[:, dropped], torch.zeros(6, int(dropped.sum()), dtype=torch.float64))


@pytest.mark.parametrize(
    "row, target, message",
    [
        ([0.0, float("nan"), 1.0, 2.0], 0, "NaN or \\+inf"),
        ([0.0, float("inf"), 1.0, 2.0], 0, "NaN or \\+inf"),
        ([0.0, 1.0, 2.0, -math.inf], 3, "target id 3 has logit -inf"),
        ([-math.inf] * 4, 1, "-inf"),
    ],
)
def test_non_finite_logits_raise_naming_the_cause(row, target, message):
    # A finite row next to the bad one: the error names the bad row (row 1).
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], row])
    with pytest.raises(ValueError, match=f"row 1: .*{message}"):
        _run(logits, torch.tensor([0, target]))
