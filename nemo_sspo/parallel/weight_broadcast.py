"""Weight broadcast from the trainer's export rank to rollout ranks, bucket by bucket.

The non-colocated refit (``rollout.schedule.placement: separate``): the trainer's export rank streams its
HF-named weight buckets (``nemo_sspo.megatron.iter_hf_weight_buckets``, ``rollout.refit.bucket_mb``)
over a dedicated group (:mod:`nemo_sspo.parallel.world_split`, ``refit``) whose group rank 0 it is;
every other member receives each bucket as it comes and hands it to its engine, so a rollout rank
holds its model plus one bucket, never the model twice.

Wire format per bucket, all plain tensors (no pickling): a header ``int64 [3]`` = (tensor count,
name bytes, payload bytes), a table ``int64 [n, 2 + MAX_DIMS]`` = (dtype code, ndim, dims...), the
names as UTF-8 bytes joined by newlines, and one ``uint8`` payload holding each tensor's bytes in
order, each padded to a multiple of 8 bytes (so every view is aligned for its dtype). A header
``(0, version, 1)`` (``(0, 0, 0)`` when the sender gives no version) ends the stream. The
receiver's tensors are views of the payload with the sender's dtype and shape, so they equal the
export bit for bit.

Every tensor of the stream lives on the group's device
(:func:`nemo_sspo.parallel.metric_reduce.collective_device`): over an NCCL refit group the export's GPU
tensors are packed into a GPU payload and received into GPU buffers, so no weight byte passes
through host memory; over gloo (CPU runs, or a GPU run whose refit group is gloo) the payload is on
the host and the sender copies each GPU tensor there. :attr:`BroadcastStats.bytes_to_host` counts
the weight bytes the sender copied from a device to the host (0 when the export is on the CPU,
since nothing is then a device copy, and 0 over NCCL). The small header, table and names tensors
(metadata, ``16 * (2 + MAX_DIMS)`` bytes per weight plus the names) go to the host on the receiver
(it reads the sizes from them) and are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Iterable, Sequence

import torch
import torch.distributed as dist

from nemo_sspo.parallel.metric_reduce import collective_device

__all__ = ["BroadcastStats", "EncodedBuckets", "MAX_DIMS", "PendingBroadcast", "encode_weight_buckets",
           "post_broadcast", "post_weight_broadcast", "receive_weight_buckets", "send_weight_buckets"]

MAX_DIMS = 8
"""Most dimensions of a tensor the wire format carries."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ALIGN = 8


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class BroadcastStats:
    """What one refit sent.

    Attributes:
        buckets: buckets sent.
        bytes: payload bytes sent (weights only).
        seconds: wall time from the first header to the end marker, export included.
        bytes_to_host: weight bytes the sender copied from a device to host memory to send them
            (module docstring; 0 over NCCL and for a CPU export).
    """

    buckets: int
    bytes: int
    seconds: float
    bytes_to_host: int

    @property
    def seconds_per_gb(self) -> float:
        """Seconds per 10^9 payload bytes (0.0 when nothing was sent)."""
        return self.seconds / (self.bytes / 1e9) if self.bytes else 0.0


def post_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor):
    """Starts a broadcast of ``tensor`` from group rank 0 over ``group`` (in place on the others).

    Returns:
        The asynchronous work; keep ``tensor`` alive until its ``wait()`` has returned.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    post_broadcast(group, tensor).wait()


def _failed(receivers: Sequence[int], count: int, err: RuntimeError) -> RuntimeError:
    return RuntimeError(f"weight broadcast to rollout rank(s) {list(receivers)} failed after {count} bucket(s): "
                        f"a rollout rank died or stopped receiving within the timeout ({err})")


def _end_marker(version: int | None, device: torch.device) -> torch.Tensor:
    """The header that ends a stream (module docstring)."""
    values = [0, 0, 0] if version is None else [0, version, 1]
    return torch.tensor(values, dtype=torch.int64).to(device)


def _encode(bucket: dict[str, torch.Tensor], device: torch.device
            ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """``((header, table, names, payload), bytes copied device -> host)`` of one bucket, every tensor
    on ``device`` (module docstring).
    """
    table = torch.zeros(len(bucket), 2 + MAX_DIMS, dtype=torch.int64)
    chunks, to_host = [], 0
    for row, (name, tensor) in enumerate(bucket.items()):
        if tensor.dtype not in _CODES or tensor.dim() > MAX_DIMS:
            raise ValueError(f"weight {name!r}: dtype {tensor.dtype} / {tensor.dim()} dimensions cannot be sent "
                             f"(dtypes {', '.join(map(str, _DTYPES))}; at most {MAX_DIMS} dimensions)")
        table[row, 0], table[row, 1] = _CODES[tensor.dtype], tensor.dim()
        table[row, 2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        if tensor.device.type != "cpu" and device.type == "cpu":
            to_host += tensor.numel() * tensor.element_size()
        raw = tensor.detach().contiguous().to(device).reshape(-1).view(torch.uint8)
        chunks.append(torch.nn.functional.pad(raw, (0, _padded(raw.numel()) - raw.numel())))
    names = torch.frombuffer(bytearray("\n".join(bucket).encode()), dtype=torch.uint8)
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device)
    header = torch.tensor([len(bucket), names.numel(), payload.numel()], dtype=torch.int64)
    return (header.to(device), table.to(device), names.to(device), payload), to_host


def send_weight_buckets(buckets: Iterable[dict[str, torch.Tensor]], *, group: dist.ProcessGroup,
                        receivers: Sequence[int], version: int | None = None) -> BroadcastStats:
    """Broadcasts every non-empty bucket, then the end marker, from group rank 0 (this rank).

    Args:
        buckets: HF name -> tensor dicts, e.g. ``iter_hf_weight_buckets(..., dst_rank=<this rank>)``
            (drawing a bucket may itself be collective over the trainer's model-parallel group).
        group: the refit group (:func:`nemo_sspo.parallel.world_split.split_world`), this rank its rank 0.
        receivers: world ranks of the other members (named in the error when one fails).
        version: the policy version (the step whose update the weights hold), sent in the end
            marker for the receivers' refit check to name; None sends none.

    Returns:
        :class:`BroadcastStats` of this refit.

    Raises:
        ValueError: a tensor of a dtype or rank the wire format does not carry (nothing of that
            bucket was sent).
        RuntimeError: naming ``receivers``, when one of them died or hung past the group's timeout
            (gloo's error chained).
    """
    start, count, sent, to_host = time.perf_counter(), 0, 0, 0
    device = collective_device(group)
    try:
        for bucket in buckets:
            if not bucket:
                continue
            encoded, copied = _encode(bucket, device)
            for tensor in encoded:
                _broadcast(group, tensor)
            count, sent, to_host = count + 1, sent + encoded[3].numel(), to_host + copied
        _broadcast(group, _end_marker(version, device))
    except RuntimeError as err:  # gloo's and NCCL's errors (closed connection, timeout) are RuntimeErrors
        raise _failed(receivers, count, err) from err
    return BroadcastStats(buckets=count, bytes=sent, seconds=time.perf_counter() - start, bytes_to_host=to_host)


@dataclass
class PendingBroadcast:
    """A weight broadcast posted by :func:`post_weight_broadcast` that may still be running.

    Attributes:
        works: each bucket's four works, then the end marker's.
        tensors: the encoded buckets, alive until the works are done.
        receivers: world ranks of the receiving members (named in the error).
        bytes: payload bytes posted.
        start: ``time.perf_counter()`` when the first bucket was posted.
        bytes_to_host: as :attr:`BroadcastStats.bytes_to_host`.
    """

    works: list[list]
    tensors: list[torch.Tensor]
    receivers: Sequence[int]
    bytes: int
    start: float
    bytes_to_host: int

    def is_completed(self) -> bool:
        """Whether every receiver has taken every bucket (or one failed: :meth:`wait` then raises); never blocks."""
        return all(work.is_completed() for bucket in self.works for work in bucket)

    def wait(self) -> BroadcastStats:
        """Waits until every receiver has taken every bucket.

        Returns:
            :class:`BroadcastStats`; ``seconds`` runs from the first post to the end of this wait
            (so it includes the time the receivers took to join, not only the transfer).

        Raises:
            RuntimeError: naming ``receivers``, as :func:`send_weight_buckets`.
        """
        done = 0
        try:
            for bucket in self.works:
                for work in bucket:
                    work.wait()
                done += 1
        except RuntimeError as err:
            raise _failed(self.receivers, done, err) from err
        self.tensors.clear()
        return BroadcastStats(buckets=len(self.works) - 1, bytes=self.bytes, seconds=time.perf_counter() - self.start,
                              bytes_to_host=self.bytes_to_host)


@dataclass
class EncodedBuckets:
    """An export encoded once for :func:`post_weight_broadcast` (possibly over several groups).

    Attributes:
        buckets: each bucket's (header, table, names, payload) tensors, on the groups' device.
        bytes: payload bytes.
        bytes_to_host: as :attr:`BroadcastStats.bytes_to_host`.
        start: ``time.perf_counter()`` when encoding began.
    """

    buckets: list[tuple[torch.Tensor, ...]]
    bytes: int
    bytes_to_host: int
    start: float


def encode_weight_buckets(buckets: Iterable[dict[str, torch.Tensor]], device: torch.device) -> EncodedBuckets:
    """Encodes every non-empty bucket (the wire format of :func:`send_weight_buckets`) on ``device``.

    Args:
        buckets: as :func:`send_weight_buckets` (drawing them may be collective; that part runs now).
        device: the groups' device (:func:`nemo_sspo.parallel.metric_reduce.collective_device`).

    Raises:
        ValueError: as :func:`send_weight_buckets`.
    """
    start, encoded, sent, to_host = time.perf_counter(), [], 0, 0
    for bucket in buckets:
        if not bucket:
            continue
        tensors, copied = _encode(bucket, device)
        encoded.append(tensors)
        sent, to_host = sent + tensors[3].numel(), to_host + copied
    return EncodedBuckets(buckets=encoded, bytes=sent, bytes_to_host=to_host, start=start)


def post_weight_broadcast(encoded: EncodedBuckets, *, group: dist.ProcessGroup,
                          receivers: Sequence[int]) -> PendingBroadcast:
    """Posts the whole broadcast of :func:`send_weight_buckets` without waiting for the receivers.

    The wire format is the same, so the receivers take it with :func:`receive_weight_buckets`, bucket
    by bucket, whenever they join. The price: this rank keeps every encoded bucket (one copy of the
    exported model, on the group's device) until each :meth:`PendingBroadcast.wait` of it returns;
    one encoding may be posted over several groups. The free-running schedule uses it so the
    trainer's next step need not wait for a rollout rank that is still generating.

    Args:
        encoded: the export, from :func:`encode_weight_buckets`.
        group: a group whose rank 0 is this rank.
        receivers: world ranks of the other members (named in errors).

    Returns:
        The :class:`PendingBroadcast`.
    """
    device = collective_device(group)
    end = _end_marker(None, device)
    works = [[post_broadcast(group, tensor) for tensor in bucket] for bucket in encoded.buckets]
    works.append([post_broadcast(group, end)])
    tensors = [tensor for bucket in encoded.buckets for tensor in bucket] + [end]
    return PendingBroadcast(works=works, tensors=tensors, receivers=receivers, bytes=encoded.bytes,
                            start=encoded.start, bytes_to_host=encoded.bytes_to_host)


def receive_weight_buckets(*, group: dist.ProcessGroup) -> Generator[dict[str, torch.Tensor], None, int | None]:
    """Yields the buckets group rank 0 sends, in order, until its end marker.

    Each yielded tensor is a view of that bucket's payload buffer (on the group's device: host memory
    over gloo, the current GPU over NCCL; the sender's dtype and shape); consume a bucket (copy it
    into the engine) before asking for the next.

    Args:
        group: the refit group; this rank is not its rank 0.

    Yields:
        HF name -> tensor dicts, one per bucket sent.

    Returns:
        The version the sender put in the end marker, or None (the value of the generator's
        ``StopIteration``, e.g. ``version = yield from receive_weight_buckets(...)``).

    Raises:
        RuntimeError: naming training rank 0, when it died or hung past the group's timeout (gloo's
            or NCCL's error chained).
    """
    device = collective_device(group)
    while True:
        try:
            header = torch.zeros(3, dtype=torch.int64, device=device)
            _broadcast(group, header)
            n, name_bytes, payload_bytes = header.tolist()
            if n == 0:
                return name_bytes if payload_bytes == 1 else None  # the end marker (module docstring)
            table = torch.zeros(n, 2 + MAX_DIMS, dtype=torch.int64, device=device)
            names = torch.zeros(name_bytes, dtype=torch.uint8, device=device)
            payload = torch.zeros(payload_bytes, dtype=torch.uint8, device=device)
            for tensor in (table, names, payload):
                _broadcast(group, tensor)
        except RuntimeError as err:
            raise RuntimeError(f"weight broadcast from training rank 0 failed: the trainer died or stopped "
                               f"sending within the timeout ({err})") from err
        yield _decode(table, names, payload)


def _decode(table: torch.Tensor, names: torch.Tensor, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    bucket, offset = {}, 0
    for name, row in zip(bytes(names.tolist()).decode().split("\n"), table.tolist(), strict=True):
        dtype, shape = _DTYPES[row[0]], row[2:2 + row[1]]
        size = dtype.itemsize * int(torch.Size(shape).numel())
        bucket[name] = payload[offset:offset + size].view(dtype).reshape(shape)
        offset += _padded(size)
    return bucket
