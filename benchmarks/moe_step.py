"""Step time of the tiny Qwen3-MoE training step at EP 1 and EP 2, on the same total cores.

One step = the old-policy forward (recording routes, as router replay R2 does) + forward/backward
over the micro-batches + the Adam step, on one fixed global batch of random token rows (no
rollout: generation does not depend on the trainer's EP). Layouts, on ``--threads`` cores in all:

- ``ep1``: one process with all the threads, all experts, the whole batch;
- ``ep1_half``: the same on half the threads (on a shared machine, intra-op threads that wait for
  each other under contention can cost more than they give; this row shows it);
- ``dp2``: two data-parallel processes (half the threads each), EP 1: every replica holds all
  experts, no token leaves its replica;
- ``ep2``: the same two processes with EP 2: each replica holds 4 of the 8 experts, and every MoE
  layer all-gathers both replicas' tokens and reduce-scatters the outputs over gloo.

Each layout runs ``--warmup`` untimed steps, then ``--steps`` timed ones (the median is printed).
It also prints HF's load-balancing loss (``moe/aux_loss``, coefficient ``--aux-coef``) and the
expert load (the most-loaded expert's tokens over the mean, worst layer) of the last step; both
must agree across layouts, which checks that the layouts ran the same step. The last line gives
the ratios.

    python benchmarks/moe_step.py [--rows 16] [--tokens 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from vocab_parallel import run_ranks  # benchmarks/ is the script's directory, first on sys.path

LAYOUTS = {"ep1": (1, 1, 1), "ep1_half": (1, 1, 2), "dp2": (2, 1, 2), "ep2": (2, 2, 2)}
"""name -> (processes, EP, divisor of --threads giving each process's threads)."""


def _batch(rows: int, tokens: int, vocab: int):
    """A global batch of ``rows`` rows, prompt 1/4 and response 3/4 of ``tokens`` (ragged), seeded."""
    from nemo_sspo.algorithms.batch import pack_rollouts

    generator = torch.Generator().manual_seed(0)
    prompt, response = tokens // 4, tokens - tokens // 4
    response_lengths = torch.randint(response // 2, response + 1, (rows,), generator=generator)
    response_mask = torch.arange(response)[None, :] < response_lengths[:, None]
    return pack_rollouts(torch.randint(1, vocab, (rows, prompt), generator=generator),
                         torch.ones(rows, prompt, dtype=torch.bool),
                         torch.randint(1, vocab, (rows, response), generator=generator) * response_mask,
                         response_mask, torch.where(response_mask, 0, -1), torch.randn(rows, generator=generator),
                         pad_id=0)


def _step(ddp, optimizer, batch, spec, layout, groups, num_experts):
    from nemo_sspo.megatron.router_replay import expert_load_pair
    from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch

    scored = compute_old_logprobs(ddp, batch, spec, layout, dp_group=groups.dp_group, record_routes=True)
    sums, _ = train_on_batch(ddp, optimizer, scored, spec, layout, dp_group=groups.dp_group)
    sums["moe/expert_load_max_over_mean"] = expert_load_pair(scored.routes, scored.row_lengths(), num_experts,
                                                             dp_group=groups.dp_group)
    return sums


def _worker(rank: int, port: int, queue, world: int, ep: int, threads: int, args) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    from nemo_sspo.algorithms.losses import make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups, initialize_parallel,
                                    load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.moe import num_experts
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import wrap_for_training
    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    config, state, _ = load_hf_checkpoint("tiny-random-qwen3-moe")
    initialize_parallel(tp_size=1, pp_size=1, seed=0, ep_size=ep)
    groups = get_parallel_groups()
    model = build_policy_model(config)
    load_hf_into_megatron(model, state, config)
    ddp, optimizer = wrap_for_training(model, lr=1e-5, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                       adam_eps=1e-8, clip_grad=0.0)
    vocab_start, vocab_size = vocab_shard(model)
    spec = LossSpec(loss=make_policy_loss("grpo"), tp_group=None, vocab_start=vocab_start, vocab_size=vocab_size,
                    temperature=1.0, max_response_length=args.tokens, output_chunk_size=128,
                    router_aux_loss_coef=args.aux_coef)
    rows = args.rows // world
    batch = _batch(args.rows, args.tokens, config.vocab_size).select(slice(rank * rows, (rank + 1) * rows))
    layout = MicroBatchLayout(micro_batch_size=args.micro_batch_size)
    seconds = []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        sums = _step(ddp, optimizer, batch, spec, layout, groups, num_experts(config))
        dist.barrier()
        if index >= args.warmup:
            seconds.append(time.perf_counter() - start)
    metrics = reduce_metric_sums(sums, dp_group=groups.dp_group, pp_group=groups.pp_group,
                                 last_stage_rank=groups.pp_last_rank, is_last_stage=groups.is_last_stage)
    if rank == 0:
        queue.put((statistics.median(seconds), metrics["moe/aux_loss"], metrics["moe/expert_load_max_over_mean"]))
    destroy_parallel()
    dist.destroy_process_group()


def _run(world: int, ep: int, threads: int, args) -> tuple:
    """Spawns ``world`` ranks of one layout; returns rank 0's (s/step, aux loss, expert load)."""
    return run_ranks(world, _worker, world, ep, threads, args)


def main() -> None:
    """Prints one line per layout, then the ratios (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the global batch")
    parser.add_argument("--tokens", type=int, default=256, help="prompt + response width of a row")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads over all processes")
    parser.add_argument("--aux-coef", type=float, default=0.001, help="model.router_aux_loss_coef")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.rows % (2 * args.micro_batch_size) or args.threads % 2:
        parser.error("--rows must split into 2 ranks of whole micro-batches, --threads over 2 processes")
    results = {}
    for name, (world, ep, divisor) in LAYOUTS.items():
        threads = args.threads // divisor
        results[name] = _run(world, ep, threads, args)
        seconds, aux, load = results[name]
        print(f"{name}: {world} process(es) x {threads} thread(s), EP {ep}: {seconds:.3f} s/step, "
              f"moe/aux_loss={aux:.6f}, expert load max/mean={load:.3f}", flush=True)
    ep1, ep1_half, dp2, ep2 = (results[name][0] for name in LAYOUTS)
    print(f"ep2_over_ep1_step_time={ep2 / ep1:.3f} ep2_over_ep1_half_step_time={ep2 / ep1_half:.3f} "
          f"ep2_over_dp2_step_time={ep2 / dp2:.3f}")


if __name__ == "__main__":
    main()
