"""Token balance across data-parallel ranks: rows move so that every rank computes about as many tokens.

Each data-parallel rank rolls out its own prompt groups, so one rank may draw the long responses of
a step and the others wait for it at every collective of the step. With token-budget micro-batches
the trainer therefore redistributes each mini-batch's rows by the lengths of every rank's rows
(:func:`nemo_sspo.algorithms.micro_batches.balanced_partition`: equal row counts, about equal
tokens) before the old/reference log-prob passes and the update. The step is unchanged: the loss
is a sum of per-row numerators over a global denominator (:mod:`nemo_sspo.megatron.step`), whatever
rank holds a row; only the Clip-Cov/KL-Cov per-micro-batch selection depends on the split, as it
does on the micro-batch size. verl (``balance_batch``: a Karmarkar-Karp partition with equal row
counts per rank, on its single controller), NeMo-RL and slime also balance their batches by
sequence length; the longest-first partition and this exchange over a process group are ours.

Balancing evens out tokens, not micro-batch counts: every rank still plans its own micro-batches.
:func:`agree_micro_batch_count` is the one all-reduce by which the ranks agree on how many passes
each runs (the trainer pads to it with empty micro-batches,
:func:`nemo_sspo.algorithms.micro_batches.pad_micro_batches`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.batch import PolicyBatch, concat_policy_batches
from nemo_sspo.algorithms.micro_batches import balanced_partition
from nemo_sspo.parallel.metric_reduce import collective_device

__all__ = ["agree_micro_batch_count", "balance_across_data_parallel"]


def agree_micro_batch_count(count: int, dp_group) -> int:
    """The largest micro-batch count of any data-parallel rank (one all-reduce MAX of an int).

    Collective over ``dp_group``: every rank must call it, once per pass over a mini-batch.
    Pipeline and tensor-parallel peers plan the same micro-batches, so each of their data-parallel
    groups agrees on the same number.

    Args:
        count: micro-batches this rank planned.
        dp_group: the data-parallel process group, or None (one rank: ``count`` comes back).

    Returns:
        ``max`` of ``count`` over the group's ranks.
    """
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=collective_device(dp_group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=dp_group)
    return int(value.item())


def _rows(batch: PolicyBatch, rows: list[int], lengths: list[int]) -> PolicyBatch:
    """Copies of ``rows`` cut to their longest (an index tensor copies: a pickled view would send
    its whole storage).
    """
    width = max((lengths[r] for r in rows), default=0)
    return batch.narrow(width).select(torch.tensor(rows, dtype=torch.long))


def balance_across_data_parallel(batch: PolicyBatch, dp_group) -> PolicyBatch:
    """This rank's share of the rows of every data-parallel rank's ``batch``, balanced by tokens.

    Collective over ``dp_group``: one ``all_gather_object`` of the row lengths, then one
    ``scatter_object_list`` per rank that sends each other rank only the rows it receives. Every
    rank of a model-parallel replica holds the same rows with the same lengths (earlier pipeline
    stages lack the log-prob fields only the last one fills) and computes the same partition, so
    tensor- and pipeline-parallel peers keep the same rows. Object collectives work over gloo and
    NCCL alike (NCCL stages the pickles on the current CUDA device).

    Args:
        batch: this rank's rows, ``[B_r, S_r]`` fields on the host (``lengths`` set, or every
            position valid). Whole rows move, with every field the loss reads.
        dp_group: the data-parallel process group, or None (one rank: ``batch`` comes back).

    Returns:
        A :class:`PolicyBatch` of the ``sum_r B_r / size`` rows assigned to this rank, ordered by
        source rank then row, right-padded to the longest of them
        (:func:`nemo_sspo.algorithms.batch.concat_policy_batches`).

    Raises:
        ValueError: on every rank, when the ranks' row counts do not add up to a multiple of the
            group size.
    """
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return batch
    size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    every = [None] * size
    dist.all_gather_object(every, batch.row_lengths().tolist(), group=dp_group)
    owners = [(src, row) for src, lengths in enumerate(every) for row in range(len(lengths))]
    groups = balanced_partition([length for lengths in every for length in lengths], size)
    outgoing = [[owners[i][1] for i in group if owners[i][0] == rank] for group in groups]
    received = []
    for src in range(size):
        send = [_rows(batch, rows, every[rank]) for rows in outgoing] if src == rank else None
        box = [None]
        dist.scatter_object_list(box, send, src=dist.get_global_rank(dp_group, src), group=dp_group)
        received.append(box[0])
    return concat_policy_batches(received)
