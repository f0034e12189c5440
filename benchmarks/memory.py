"""Benchmark: the memory plan's figures beside measured bytes, feature by feature, and the step time
that recomputation costs (CPU, gloo).

    OMP_NUM_THREADS=1 python benchmarks/memory.py [--hidden 256] [--layers 4] [--seq 256] [--repeats 5]

A Llama-shaped random model (default hidden 256, 4 layers, SwiGLU 688, 8 heads / 2 KV heads,
vocabulary 1,000, untied head) built as Megatron GPTModel with the local spec, fp32 unless noted:

- optimizer, gradients and weights per rank: megatron's DDP + Adam built and stepped once, their
  tensors counted (``tests/unit/_memory_cases.counted_state_bytes``) against
  ``nemo_sspo.megatron.memory.model_state_bytes``: fp32, bf16, and the distributed optimizer over DP 2
  (2 gloo processes; the plan gives the mean of the ranks);
- saved activations of one micro-batch's forward (``saved_tensors_hooks``, distinct storages,
  parameters excluded) against ``activation_bytes(...).saved``: recompute none / selective / full,
  padded rows / one packed row, TP 1 / 2 (sequence parallelism, PP 2, EP 2, bf16 and every tiny model
  family: the grid tests, tests/unit/megatron/test_memory_grid.py and tests/distributed/test_memory_grid_parallel.py);
- step time: forward + backward of the padded micro-batch, median of ``--repeats`` after one warm-up,
  recompute none against selective and full, in the same process.

The last line is ``recompute_full_step_time_ratio=<full / none>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (tests/unit/_memory_cases.py)

from vocab_parallel import run_ranks  # noqa: E402  benchmarks/ is the script's directory


def _config(args):
    from tests.unit._memory_cases import llama

    return llama(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                 max_position_embeddings=4 * args.seq)


def _inputs(args, config):
    from tests.unit._memory_cases import padded_and_packed_inputs

    third = args.seq * 2 // 3
    return padded_and_packed_inputs(config.vocab_size, 2, args.seq, [third, third, 2 * args.seq - 2 * third])


def _activation_rows(args, tp):
    """``[(feature, measured, planned)]`` of the saved activations on this rank."""
    from nemo_sspo.megatron import build_policy_model
    from nemo_sspo.megatron.memory import activation_bytes
    from tests.unit._memory_cases import recompute, saved_activation_bytes

    config = _config(args)
    (ids, pos), (packed, packed_pos, lengths) = _inputs(args, config)
    rows = []
    for granularity in ("none", "selective", "full"):
        with recompute(None if granularity == "none" else granularity):
            torch.manual_seed(0)
            model = build_policy_model(config).train()
            for layout, inputs, shape in (("padded", (ids, pos, None), (2, args.seq)),
                                          ("packed", (packed, packed_pos, lengths), (1, 2 * args.seq))):
                measured = saved_activation_bytes(model, *inputs)
                planned = activation_bytes(config, tokens=shape[0] * shape[1], rows=shape[0], seq=shape[1], tp=tp,
                                           pp=1, stage=0, act_bytes=4, impl="local", recompute=granularity).saved
                rows.append((f"activations TP={tp} recompute={granularity} {layout}", measured, planned))
    return rows


def _state_rows(args, precision, distributed, dp):
    from nemo_sspo.megatron.memory import model_state_bytes, rank_parameters
    from tests.unit._memory_cases import build_trained, counted_state_bytes

    config = _config(args)
    counted = counted_state_bytes(*build_trained(config, precision=precision, distributed=distributed))
    planned = model_state_bytes(rank_parameters(config, tp=1, pp=1), param_bytes=2 if precision == "bf16" else 4,
                                dp=dp, distributed_optimizer=distributed)
    label = f"{precision} DP={dp} distributed_optimizer={distributed}"
    return [(f"{term} {label}", counted[term], getattr(planned, term))
            for term in ("weights", "gradients", "optimizer")]


def _step_times(args):
    """Median seconds of forward + backward of the padded micro-batch per recompute setting."""
    from nemo_sspo.megatron import build_policy_model
    from nemo_sspo.megatron.model import forward_hidden
    from tests.unit._memory_cases import recompute

    config = _config(args)
    (ids, pos), _ = _inputs(args, config)
    times = {}
    for granularity in ("none", "selective", "full"):
        with recompute(None if granularity == "none" else granularity):
            torch.manual_seed(0)
            model = build_policy_model(config).train()
            samples = []
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                forward_hidden(model, ids, pos).pow(2).mean().backward()
                samples.append(time.perf_counter() - start)
            times[granularity] = statistics.median(samples[1:])
    return times


def _two_rank_worker(rank, port, queue, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from nemo_sspo.megatron import destroy_parallel, initialize_parallel

    initialize_parallel(tp_size=2, pp_size=1, seed=3)
    rows = _activation_rows(args, tp=2)
    destroy_parallel()
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    states = _state_rows(args, "bf16", True, dp=2)
    destroy_parallel()
    gathered = [None, None]
    dist.all_gather_object(gathered, states)
    # optimizer: each rank holds its shard; the plan's figure is the mean of the two
    rows += [(f"{name} (rank 0 / rank 1)", f"{a:,} / {b:,}", planned) if name.startswith("optimizer")
             else (name, a, planned) for (name, a, planned), (_, b, _) in zip(gathered[0], gathered[1], strict=True)]
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from nemo_sspo.megatron import destroy_parallel, initialize_parallel

    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    rows = _activation_rows(args, tp=1)
    for precision in ("fp32", "bf16"):
        for distributed in (False, True):
            rows += _state_rows(args, precision, distributed, dp=1)
    times = _step_times(args)
    destroy_parallel()
    rows += run_ranks(2, _two_rank_worker, args)
    print(f"{'feature':<60} {'measured bytes':>22} {'planned bytes':>15} {'planned/measured':>17}")
    for name, measured, planned in rows:
        ratio = f"{planned / measured:.3f}" if isinstance(measured, int) else ""
        shown = f"{measured:,}" if isinstance(measured, int) else measured
        print(f"{name:<60} {shown:>22} {planned:>15,.0f} {ratio:>17}")
    for granularity, seconds in times.items():
        print(f"step time (forward + backward) recompute={granularity}: {1000 * seconds:.1f} ms")
    print(f"recompute_selective_step_time_ratio={times['selective'] / times['none']:.3f}")
    print(f"recompute_full_step_time_ratio={times['full'] / times['none']:.3f}")


if __name__ == "__main__":
    main()
