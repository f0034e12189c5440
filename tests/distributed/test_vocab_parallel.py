"""vocab_parallel_logprobs_entropy on real gloo groups at TP 1, 2 and 4 (two spawns in total).

Every check compares with a float64 full-vocabulary reference (log_softmax over the true
vocabulary of logits / temperature, gather, -sum p log p; gradients by float64 autograd) or with
central finite differences, never with the function's own output.
"""

import torch
import torch.distributed as dist

from nemo_sspo.parallel import vocab_parallel_logprobs_entropy, vocab_shard_range

# (true vocab V, padded vocab, temperature): V=13 in 16 leaves the last TP-4 shard one real
# column; V=11 in 16 makes the last TP-4 shard pure padding.
_CASES = [(13, 16, 1.0), (13, 16, 0.7), (11, 16, 0.7)]
_DTYPES = [torch.float32, torch.bfloat16]
_N, _CHUNK = 6, 4  # two chunks, the second one short


def _inputs(seed, vocab_size, padded, dtype):
    """Identical on every rank: logits [N, padded] in ``dtype`` (padding columns set to a large
    garbage value that would dominate if it leaked), targets [N] covering the vocab edges."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(_N, padded, generator=gen, dtype=torch.float64)
    logits[:, vocab_size:] = 30.0
    targets = torch.randint(0, vocab_size, (_N,), generator=gen)
    targets[0], targets[1] = 0, vocab_size - 1
    grads = torch.randn(2, _N, generator=gen, dtype=torch.float64)
    return logits.to(dtype), targets, grads


def _reference(logits, targets, vocab_size, temperature, grads):
    """float64 full-vocabulary logprobs, entropy and d(g_lp.logp + g_H.H)/d logits [N, padded]."""
    full = logits.to(torch.float64).requires_grad_(True)
    logp_all = torch.log_softmax(full[:, :vocab_size] / temperature, dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), full.grad


def _tolerances(dtype):
    # Forward accumulates in fp32 on exactly representable inputs: errors ~1e-6 on values ~10.
    # bf16 gradients are rounded to 8 significant bits: relative error <= 2^-8.
    fwd = dict(rtol=0.0, atol=1e-5)
    bwd = dict(rtol=2.0**-8, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=0.0, atol=1e-6)
    return fwd, bwd


def _check_against_reference(group, seed):
    """All cases x dtypes on ``group``: forward, gradients, input unchanged, collective count."""
    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    for case_id, (vocab_size, padded, temperature) in enumerate(_CASES):
        start, end = vocab_shard_range(padded, tp_rank, tp_size)
        for dtype in _DTYPES:
            full, targets, grads = _inputs(seed + case_id, vocab_size, padded, dtype)
            ref_lp, ref_h, ref_grad = _reference(full, targets, vocab_size, temperature, grads)
            shard = full[:, start:end].clone().requires_grad_(True)
            untouched = shard.detach().clone()
            calls = _count_all_reduce()
            try:
                logprobs, entropy = vocab_parallel_logprobs_entropy(
                    shard, targets, tp_group=group, vocab_start=start, vocab_size=vocab_size,
                    temperature=temperature, chunk_size=_CHUNK,
                )
                forward_calls = len(calls)
                loss = (grads[0].float() * logprobs).sum() + (grads[1].float() * entropy).sum()
                loss.backward()
            finally:
                _restore_all_reduce()
            fwd_tol, bwd_tol = _tolerances(dtype)
            where = f"TP={tp_size} rank={tp_rank} V={vocab_size}/{padded} T={temperature} {dtype}"
            assert logprobs.dtype == entropy.dtype == torch.float32, where
            torch.testing.assert_close(logprobs.double(), ref_lp, **fwd_tol, msg=where)
            torch.testing.assert_close(entropy.double(), ref_h, **fwd_tol, msg=where)
            assert shard.grad.dtype == dtype, where
            torch.testing.assert_close(
                shard.grad.double(), ref_grad[:, start:end], **bwd_tol, msg=where
            )
            assert torch.equal(shard.detach(), untouched), f"input modified (docs/pitfalls.md#p7): {where}"
            # Two chunks x (MAX + SUM) in forward; backward must not communicate.
            assert forward_calls == 4 and len(calls) == 4, f"all_reduce calls {calls}: {where}"


_ORIGINAL_ALL_REDUCE = dist.all_reduce


def _count_all_reduce():
    calls = []

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(tuple(tensor.shape))
        return _ORIGINAL_ALL_REDUCE(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    return calls


def _restore_all_reduce():
    dist.all_reduce = _ORIGINAL_ALL_REDUCE


def _check_finite_differences(group, seed):
    """docs/pitfalls.md#p8: float64 analytic gradient of g_lp.logp + g_H.H equals central differences, padding
    columns included (their derivative must be exactly 0)."""
    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    vocab_size, padded, temperature = 7, 8, 0.7
    full, targets, grads = _inputs(seed, vocab_size, padded, torch.float64)
    full, targets, grads = full[:3], targets[:3], grads[:, :3]
    start, end = vocab_shard_range(padded, tp_rank, tp_size)

    def objective(shard):
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            shard, targets, tp_group=group, vocab_start=start, vocab_size=vocab_size,
            temperature=temperature, chunk_size=2,
        )
        return (grads[0] * logprobs).sum() + (grads[1] * entropy).sum()

    shard = full[:, start:end].clone().requires_grad_(True)
    objective(shard).backward()
    eps, numeric = 1e-6, torch.zeros_like(shard)
    with torch.no_grad():
        for row in range(full.shape[0]):
            for col in range(padded):  # every rank evaluates every perturbation (collectives)
                values = []
                for sign in (1.0, -1.0):
                    bumped = full.clone()
                    bumped[row, col] += sign * eps
                    values.append(objective(bumped[:, start:end].contiguous()))
                if start <= col < end:
                    numeric[row, col - start] = (values[0] - values[1]) / (2 * eps)
    torch.testing.assert_close(shard.grad, numeric, rtol=0.0, atol=1e-8)
    assert torch.all(numeric[:, max(vocab_size - start, 0):] == 0)


def _check_p6(group):
    """docs/pitfalls.md#p6, TP=2, V=4 split [0,1 | 2,3], all logits 0, target 3: p = 1/4 everywhere, so
    d(-log p_3)/dz = p - onehot = [0.25, 0.25, 0.25, 0.25 - 1 = -0.75]."""
    tp_rank = dist.get_rank(group)
    start, end = vocab_shard_range(4, tp_rank, 2)
    shard = torch.zeros(1, 2, requires_grad=True)
    logprobs, _ = vocab_parallel_logprobs_entropy(
        shard, torch.tensor([3]), tp_group=group, vocab_start=start, vocab_size=4
    )
    (-logprobs).sum().backward()
    expected = [[0.25, 0.25]] if tp_rank == 0 else [[0.25, -0.75]]
    torch.testing.assert_close(shard.grad, torch.tensor(expected), rtol=0.0, atol=1e-7)
    # log p_3 = log 1/4 = -1.3862944
    torch.testing.assert_close(logprobs, torch.tensor([-1.3862944]), rtol=0.0, atol=1e-6)


def _check_gathered_logits_refused(group):
    """TP=2, V=4: a host that passes the full logits [0, 1, 2, 3] with vocab_start = rank * 2
    would get, for target 3, log p = 3 - log(2 (e^2 + e^3)) = -2.5528 instead of
    3 - log(1 + e + e^2 + e^3) = -0.4402. Rank 1 names its layout; rank 0's tensor looks like a
    padded shard locally, so it learns of the fault from the poisoned sums. Neither may hang."""
    tp_rank = dist.get_rank(group)
    full = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    try:
        vocab_parallel_logprobs_entropy(
            full, torch.tensor([3]), tp_group=group, vocab_start=2 * tp_rank, vocab_size=4
        )
    except ValueError as err:
        expected = "expected vocab_start=4" if tp_rank else "another rank's shard does not fit"
        assert expected in str(err), str(err)
    else:
        raise AssertionError("full-vocabulary logits with a sharded vocab_start were accepted")
    start, _ = vocab_shard_range(4, tp_rank, 2)  # the correct shard gives -0.4402
    logprobs, _ = vocab_parallel_logprobs_entropy(
        full[:, start:start + 2], torch.tensor([3]), tp_group=group, vocab_start=start, vocab_size=4
    )
    torch.testing.assert_close(logprobs, torch.tensor([-0.4401897]), rtol=0.0, atol=1e-6)


def _check_neg_inf_shard(group):
    """TP=2, logits [0, ln 2 | -inf, -inf], target 1: rank 1's shard holds no probability.
    p = [1/3, 2/3, 0, 0]: log p_1 = ln(2/3) = -0.405465, H = (1/3) ln 3 + (2/3) ln(3/2) = 0.636514;
    gradient of log p_1 + H: d/dz_0 = -1/3 - (1/3)(ln(1/3) + H) = -1/3 + 0.154033 = -0.179300,
    d/dz_1 = 1/3 - (2/3)(ln(2/3) + H) = 1/3 - 0.154033 = 0.179300 (a softmax gradient sums to 0),
    and exactly 0 on rank 1."""
    import math

    tp_rank = dist.get_rank(group)
    rows = [[0.0, math.log(2.0)], [-math.inf, -math.inf]]
    shard = torch.tensor([rows[tp_rank]], requires_grad=True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        shard, torch.tensor([1]), tp_group=group, vocab_start=2 * tp_rank, vocab_size=4
    )
    torch.testing.assert_close(logprobs, torch.tensor([-0.405465]), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(entropy, torch.tensor([0.636514]), rtol=0.0, atol=1e-6)
    (logprobs + entropy).sum().backward()
    expected = [[-0.179300, 0.179300]] if tp_rank == 0 else [[0.0, 0.0]]
    torch.testing.assert_close(shard.grad, torch.tensor(expected), rtol=0.0, atol=2e-6)


def _singleton_groups(world_size):
    """One TP=1 group per rank (every rank must create every group)."""
    groups = [dist.new_group([rank]) for rank in range(world_size)]
    return groups[dist.get_rank()]


def _world2_checks(rank, world_size):
    tp1 = _singleton_groups(world_size)
    _check_against_reference(tp1, seed=100)
    _check_against_reference(dist.group.WORLD, seed=200)
    _check_finite_differences(tp1, seed=300)
    _check_finite_differences(dist.group.WORLD, seed=400)
    _check_p6(dist.group.WORLD)
    _check_gathered_logits_refused(dist.group.WORLD)
    _check_neg_inf_shard(dist.group.WORLD)
    return "ok"


def _world4_checks(rank, world_size):
    _check_against_reference(dist.group.WORLD, seed=500)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _check_against_reference(pairs[rank // 2], seed=600)
    return "ok"


def test_tp1_tp2_reference_finite_differences_p6_layout_and_neg_inf(run_distributed):
    assert run_distributed(_world2_checks, 2) == ["ok", "ok"]


def test_tp4_and_tp2_subgroups_reference(run_distributed):
    assert run_distributed(_world4_checks, 4) == ["ok"] * 4
