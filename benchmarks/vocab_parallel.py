"""Benchmark: fused vocab-parallel log-prob + entropy vs unfused baselines (CPU, gloo).

    OMP_NUM_THREADS=1 python benchmarks/vocab_parallel.py [--tokens 4096] [--tp 1 2]

Same random logits ``[N, V]`` (V = 151,936, Qwen2.5's padded vocabulary, no padding columns
here) split over TP ranks (TP=2 runs as 2 gloo processes, one thread each), bf16 and fp32:

- ``fused fwd+bwd`` / ``fused fwd``: ``vocab_parallel_logprobs_entropy`` (fwd under no_grad).
- ``gather fwd+bwd``: all_gather the full vocabulary, then log_softmax + gather + entropy.
- ``megatron CE+H fwd+bwd``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` on a
  clone (it overwrites fp32 input in place), plus a separate full-vocabulary entropy over the
  shard in plain autograd ops (all-reduce MAX, then an autograd all-reduce SUM of the sums).
- ``log_softmax fwd``: bare ``torch.log_softmax`` over the same shard (the speed reference).

Time: best of ``--repeats`` wall-clock runs, max over ranks. Peak extra memory: bytes of live
tensor storages created during the call (outputs and gradients included), tracked by a
TorchDispatchMode with weak references on storages (torch has no CPU allocator statistics).
Memory is measured on 64 and 128 tokens and extrapolated linearly to ``--tokens`` (every
allocation here is per-token or constant; a 256-token check prints the fit error). A method whose
predicted footprint over all ranks exceeds ``--mem-budget-gb`` is timed on fewer tokens and its
time scaled linearly (marked ``*``). Collectives: all_reduce / all_gather calls per call.

Also reports SSPO's policy-loss cost over GRPO's on the same ``[B, T]`` inputs. The last line is
``fused_vs_logsoftmax_time_ratio=<fused fwd / log_softmax, worst config>
fused_vs_gather_peak_mem_ratio=<fused / gather fwd+bwd peak, worst config>``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nemo_sspo.parallel import vocab_parallel_logprobs_entropy, vocab_shard_range

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_MEM_TOKENS = (64, 128)
_CHECK_TOKENS = 256
_COLUMN_BLOCK = 151936 // 8  # logits are generated per column block so any TP split agrees


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated while active (pre-existing storages ignored)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage()._cdata for t in tensors}
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs):
        key = storage._cdata
        if key in self._alive or key in inputs:  # a view/in-place result of an older storage
            return
        nbytes = storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda _ref, k=key, n=nbytes: self._release(k, n))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _release(self, key, nbytes):
        self.live -= nbytes
        del self._alive[key]


class CountCollectives:
    """Counts torch.distributed.all_reduce / all_gather calls (autograd collectives included)."""

    def __init__(self):
        self.calls = 0
        self._saved = {}

    def __enter__(self):
        for name in ("all_reduce", "all_gather"):
            original = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(original))
        return self

    def _wrap(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


_CACHE = {}


def _make_logits(n_tokens, start, end, dtype, seed):
    """Columns [start, end) of the global random logits, identical for any TP split.

    The last result is cached (generation costs seconds at full size); methods never modify it.
    """
    key = (n_tokens, start, end, dtype, seed)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = _generate(n_tokens, start, end, dtype, seed)
    shard = _CACHE[key].detach()
    return shard


def _generate(n_tokens, start, end, dtype, seed):
    blocks = []
    for block_start in range(start - start % _COLUMN_BLOCK, end, _COLUMN_BLOCK):
        gen = torch.Generator().manual_seed(seed * 1000 + block_start // _COLUMN_BLOCK)
        block = 2.0 * torch.randn(n_tokens, _COLUMN_BLOCK, generator=gen)
        lo = max(start, block_start) - block_start
        hi = min(end, block_start + _COLUMN_BLOCK) - block_start
        blocks.append(block[:, lo:hi].to(dtype))
        del block
    return torch.cat(blocks, dim=1)


# ---------------------------------------------------------------------------------------------
# The methods. Each takes (shard, targets, ctx) and runs one forward (+ backward) call.


def _fused(shard, targets, ctx, backward):
    leaf = shard.requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            leaf, targets, tp_group=ctx["group"], vocab_start=ctx["start"], vocab_size=ctx["vocab"]
        )
    if backward:
        (logprobs.sum() + entropy.sum()).backward()
    return logprobs, entropy


def _gather(shard, targets, ctx):
    if ctx["tp"] > 1:
        parts = [torch.empty_like(shard) for _ in range(ctx["tp"])]
        dist.all_gather(parts, shard.detach(), group=ctx["group"])
        full = torch.cat(parts, dim=1).requires_grad_(True)
        del parts
    else:
        full = shard.requires_grad_(True)
    logp_all = torch.log_softmax(full.float(), dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logprobs.sum() + entropy.sum()).backward()
    return full.grad[:, ctx["start"] : ctx["end"]]


def _megatron(shard, targets, ctx):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    leaf = shard.requires_grad_(True)
    nll = vocab_parallel_cross_entropy(leaf.clone(), targets)
    entropy = _autograd_entropy(leaf, ctx["group"])
    (-nll.sum() + entropy.sum()).backward()
    return leaf.grad


def _autograd_entropy(shard, group):
    """Full-vocabulary entropy from a shard in plain autograd ops (baseline)."""
    z = shard.float()
    z_max = z.detach().amax(dim=-1)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    weights = torch.exp(z - z_max.unsqueeze(-1))
    sums = _AllReduceSum.apply(torch.stack([weights.sum(-1), (weights * z).sum(-1)]), group)
    return sums[0].log() + z_max - sums[1] / sums[0]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group; backward is the identity (the loss is replicated on every rank,
    as Megatron's reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, tensor, group):
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _log_softmax(shard, targets, ctx):
    return torch.log_softmax(shard, dim=-1)


_METHODS = {
    "fused fwd+bwd": lambda s, t, c: _fused(s, t, c, backward=True),
    "fused fwd": lambda s, t, c: _fused(s, t, c, backward=False),
    "gather fwd+bwd": _gather,
    "megatron CE+H fwd+bwd": _megatron,
    "log_softmax fwd": _log_softmax,
}


def _patch_megatron_groups(group):
    """Megatron's CE reads the global parallel state; point its getters at our group."""
    import megatron.core.tensor_parallel.cross_entropy as ce

    ce.get_tensor_model_parallel_group = lambda: group
    ce.get_tensor_model_parallel_rank = lambda: dist.get_rank(group)
    ce.get_tensor_model_parallel_world_size = lambda: dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Measurement


def _targets(n_tokens, vocab, seed):
    return torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed))


def _peak_bytes(method, n_tokens, dtype, ctx):
    shard = _make_logits(n_tokens, ctx["start"], ctx["end"], dtype, seed=1)
    targets = _targets(n_tokens, ctx["vocab"], seed=2)
    with LiveBytes() as tracker:
        result = method(shard, targets, ctx)
        del result
    return tracker.peak


def _memory_plan(method, dtype, ctx, args):
    """Peak extra bytes at ``--tokens`` (linear fit), its fit error, and the tokens to time."""
    peaks = [_peak_bytes(method, n, dtype, ctx) for n in _MEM_TOKENS]
    per_token = (peaks[1] - peaks[0]) / (_MEM_TOKENS[1] - _MEM_TOKENS[0])
    constant = peaks[0] - per_token * _MEM_TOKENS[0]
    check = _peak_bytes(method, _CHECK_TOKENS, dtype, ctx)
    fit_error = abs(constant + per_token * _CHECK_TOKENS - check) / check
    input_bytes = args.tokens * (ctx["end"] - ctx["start"]) * dtype.itemsize
    n_time = args.tokens
    while n_time > _MEM_TOKENS[1] and (
        ctx["tp"] * (input_bytes + constant + per_token * n_time) > args.mem_budget_gb * 2**30
    ):
        n_time //= 2
    return constant + per_token * args.tokens, fit_error, n_time


def _time_once(method, shard, targets, ctx):
    """Seconds of one call (slowest rank) and the number of collectives it issued."""
    dist.barrier(group=ctx["group"])
    with CountCollectives() as counter:
        start = time.perf_counter()
        result = method(shard, targets, ctx)
        elapsed = time.perf_counter() - start
    del result
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx["group"])
    return slowest.item(), counter.calls


def _measure_dtype(dtype, ctx, args):
    """All methods on one dtype; repeats interleave the methods so load spikes hit them alike."""
    plans = {name: _memory_plan(method, dtype, ctx, args) for name, method in _METHODS.items()}
    shard = _make_logits(args.tokens, ctx["start"], ctx["end"], dtype, seed=0)
    targets = _targets(args.tokens, ctx["vocab"], seed=3)
    best = dict.fromkeys(_METHODS, float("inf"))
    calls = {}
    for _ in range(args.repeats):
        for name, method in _METHODS.items():
            n_time = plans[name][2]
            rows = shard[:n_time].detach()
            seconds, calls[name] = _time_once(method, rows, targets[:n_time], ctx)
            best[name] = min(best[name], seconds * args.tokens / n_time)
    return [
        dict(method=name, dtype=dtype, tp=ctx["tp"], ms=1e3 * best[name], n_time=plans[name][2],
             scaled=plans[name][2] != args.tokens, peak_mb=plans[name][0] / 2**20,
             calls=calls[name], fit_error=plans[name][1])
        for name in _METHODS
    ]


def _worker(rank, port, queue, world_size, args):
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30)
    )
    _patch_megatron_groups(dist.group.WORLD)  # Megatron needs a real group even at TP=1
    start, end = vocab_shard_range(args.vocab, rank, world_size)
    # TP=1 is the single-process path: tp_group=None, no communication at all.
    group = dist.group.WORLD if world_size > 1 else None
    ctx = dict(group=group, tp=world_size, start=start, end=end, vocab=args.vocab)
    rows = [row for name in args.dtypes for row in _measure_dtype(_DTYPES[name], ctx, args)]
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world_size: int, worker, *worker_args) -> list:
    """Spawns ``world_size`` processes running ``worker(rank, port, queue, *worker_args)`` on a free
    local port; returns what rank 0 puts on the queue. Raises RuntimeError if a rank fails."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(rank, port, queue, *worker_args)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"rank of a {world_size}-process run exited with {proc.exitcode}")
    return rows


def _run_tp(tp, args):
    return run_ranks(tp, _worker, tp, args)


def _loss_costs(args):
    """Wall-clock ms of policy-loss fwd+bwd for SSPO and GRPO on the same [B, T] inputs."""
    from nemo_sspo.algorithms.losses import LossInputs, make_policy_loss

    gen = torch.Generator().manual_seed(4)
    batch = 8
    length = max(args.tokens // batch, 1)
    old_logprobs = -torch.rand(batch, length, generator=gen) * 3
    logprobs_base = old_logprobs + 0.05 * torch.randn(batch, length, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    segment_ids = (torch.arange(length) // 25).expand(batch, length).contiguous()  # 25-token lines
    old_entropy = torch.rand(batch, length, generator=gen)
    costs = {}
    for name in ("grpo", "sspo"):
        loss_fn = make_policy_loss(name)  # the config class's defaults
        best = float("inf")
        for _ in range(5):
            logprobs = logprobs_base.clone().requires_grad_(True)
            start = time.perf_counter()
            # Building the inputs is timed too: it holds the shape checks the old call ran inside.
            inputs = LossInputs(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                                response_mask=mask, segment_ids=segment_ids, old_entropy=old_entropy)
            loss_fn(inputs).per_token_loss.sum().backward()
            best = min(best, time.perf_counter() - start)
        costs[name] = 1e3 * best
    return costs


def _print_table(rows):
    print(f"{'TP':>2} {'dtype':>8} {'method':<22} {'time ms':>10} {'peak extra MB':>14} "
          f"{'collectives':>11}")
    for row in rows:
        mark = f"* ({row['n_time']} tok)" if row["scaled"] else ""
        print(
            f"{row['tp']:>2} {str(row['dtype']).replace('torch.', ''):>8} {row['method']:<22} "
            f"{row['ms']:>10.1f} {row['peak_mb']:>14.1f} {row['calls']:>11} {mark}"
        )
    worst_fit = max(row["fit_error"] for row in rows)
    print(f"memory: LiveBytes dispatch mode, linear fit over {_MEM_TOKENS} tokens; worst fit error "
          f"at {_CHECK_TOKENS} tokens {100 * worst_fit:.2f}%. * = timed on fewer tokens, scaled.")


def _ratios(rows):
    def pick(tp, dtype, method, key):
        match = (tp, dtype, method)
        return next(r[key] for r in rows if (r["tp"], r["dtype"], r["method"]) == match)

    configs = {(r["tp"], r["dtype"]) for r in rows}
    time_ratio = max(
        pick(*c, "fused fwd", "ms") / pick(*c, "log_softmax fwd", "ms") for c in configs
    )
    mem_ratio = max(
        pick(*c, "fused fwd+bwd", "peak_mb") / pick(*c, "gather fwd+bwd", "peak_mb")
        for c in configs
    )
    return time_ratio, mem_ratio


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens N (default 4096)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size V")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes to run")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(_DTYPES))
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per method (best kept)")
    parser.add_argument("--mem-budget-gb", type=float, default=6.0,
                        help="max predicted footprint over all ranks of one timed run")
    args = parser.parse_args()
    if args.vocab % _COLUMN_BLOCK:
        parser.error(f"--vocab must be a multiple of {_COLUMN_BLOCK}")
    torch.set_num_threads(1)
    rows = [row for tp in args.tp for row in _run_tp(tp, args)]
    _print_table(rows)
    costs = _loss_costs(args)
    print(f"policy loss fwd+bwd on [8, {args.tokens // 8}]: grpo {costs['grpo']:.2f} ms, "
          f"sspo {costs['sspo']:.2f} ms, sspo/grpo {costs['sspo'] / costs['grpo']:.2f}")
    time_ratio, mem_ratio = _ratios(rows)
    print(
        f"fused_vs_logsoftmax_time_ratio={time_ratio:.3f} "
        f"fused_vs_gather_peak_mem_ratio={mem_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
