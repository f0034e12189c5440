"""Benchmark: a rollout between training ranks, pickled (``broadcast_object_list``) vs the rollout codec.

    OMP_NUM_THREADS=1 python benchmarks/rollout_transport.py [--shapes tiny 7b] [--repeats 5]

Two gloo processes on this machine broadcast a :class:`~nemo_sspo.rollouts.records.VersionedRollout`
from rank 0 to rank 1, as every training step does inside a replica (``SeparateSource.share``, the
trainer's model-parallel share) and across the training ranks (free-running), two ways:

- ``pickle``: ``torch.distributed.broadcast_object_list([rollout])``, what those paths did before the
  codec; its bytes are the pickle's (``pickle.dumps``, as torch's ``_object_to_tensor`` writes it)
  plus torch's 8-byte size;
- ``codec``: :func:`nemo_sspo.rollouts.codec.broadcast_rollout`; its bytes are the prefix, the header
  and every tensor's bytes.

Shapes (``--shapes``): ``tiny``: 4 prompts x 2 responses, prompts 8 and responses 16 tokens;
``7b``: the 7B recipe's step, 128 prompts x 8 responses, prompts 1,024 and responses 3,000 tokens.
Every rollout has token versions (a partial rollout's ``int64 [B, T]``) and response texts of 4
characters per response token. Seconds: per broadcast, the slower rank's wall time from a barrier to
holding the rollout (encode / pickle and decode / unpickle included), the median of ``--repeats``.
The last line is ``codec_vs_pickle_seconds=<codec / pickle at the largest shape>``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import statistics
import time

import torch
import torch.distributed as dist

from vocab_parallel import run_ranks  # benchmarks/ is the script's directory, first on sys.path

_SHAPES = {"tiny": (4, 2, 8, 16), "7b": (128, 8, 1024, 3000)}  # prompts, responses each, prompt and response tokens


def _rollout(prompts: int, group: int, prompt_len: int, response_len: int):
    """A versioned rollout of the shape, every tensor field filled (no routes: a dense model)."""
    from nemo_sspo.rollout import RolloutBatch
    from nemo_sspo.rollouts.records import Rollout, VersionedRollout

    gen = torch.Generator().manual_seed(0)
    rows = prompts * group
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)
    response_mask = torch.arange(response_len) < lengths[:, None]
    batch = RolloutBatch(
        prompt_ids=torch.randint(0, 150_000, (rows, prompt_len), generator=gen),
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.bool),
        response_ids=torch.randint(0, 150_000, (rows, response_len), generator=gen),
        response_mask=response_mask, truncated=lengths == response_len,
        response_texts=["word" * int(n) for n in lengths],
        rollout_logprobs=-torch.rand(rows, response_len, generator=gen) * response_mask,
        token_versions=torch.where(response_mask, 3, -1))
    rewards = torch.rand(rows, generator=gen)
    rollout = Rollout(batch=batch, task_rewards=rewards, rewards=rewards, rounds=1, generated_groups=prompts,
                      prompt_keys=[f"{i:032x}" for i in range(prompts)], scored_responses=rows)
    return VersionedRollout(rollout, version=3, problems_drawn=prompts, generated=(1.7e9, 1.7e9 + 61.5))


def _codec_bytes(versioned) -> int:
    from nemo_sspo.rollouts.codec import encode

    header, tensors = encode(versioned)
    return 16 + header.numel() * 8 + sum(t.numel() * t.element_size() for t in tensors)


def _timed(call, repeats: int) -> float:
    """Median over ``repeats`` of the slower rank's seconds from a barrier to ``call()`` returning."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def _worker(rank, port, queue, shapes, repeats):
    from nemo_sspo.rollouts.codec import broadcast_rollout
    from nemo_sspo.rollouts.records import VersionedRollout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=900))
    rows = []
    for name in shapes:
        versioned = _rollout(*_SHAPES[name]) if rank == 0 else None

        def pickled(versioned=versioned):
            box = [versioned]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def codec(versioned=versioned):
            return broadcast_rollout(versioned, cls=VersionedRollout, src=0)

        pickle_s, codec_s = _timed(pickled, repeats), _timed(codec, repeats)
        if rank == 0:
            rows.append((name, len(pickle.dumps(versioned)) + 8, _codec_bytes(versioned), pickle_s, codec_s))
        del versioned
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    """Runs the two-process broadcasts and prints the table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(_SHAPES), default=list(_SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = run_ranks(2, _worker, args.shapes, args.repeats)
    print(f"{'shape':<6} {'rows x prompt + response':>26} {'pickle MB':>10} {'codec MB':>9} {'bytes':>6} "
          f"{'pickle s':>9} {'codec s':>8} {'seconds':>8}")
    for name, pickle_bytes, codec_bytes, pickle_s, codec_s in rows:
        prompts, group, prompt_len, response_len = _SHAPES[name]
        shape = f"{prompts * group} x {prompt_len} + {response_len}"
        print(f"{name:<6} {shape:>26} {pickle_bytes / 1e6:>10.3f} {codec_bytes / 1e6:>9.3f} "
              f"{codec_bytes / pickle_bytes:>6.3f} {pickle_s:>9.4f} {codec_s:>8.4f} {codec_s / pickle_s:>8.3f}")
    print(f"codec_vs_pickle_seconds={rows[-1][4] / rows[-1][3]:.3f}")


if __name__ == "__main__":
    main()
