"""Rollouts as tensors between ranks: one lossless codec, derived from the dataclasses' fields, for
every transport (the bridge's point-to-point sends and the collectives inside the training side).

The codec walks a class's fields in declaration order (``dataclasses.fields``, a NamedTuple's
``_fields``), recursing into nested dataclasses, NamedTuples, lists and tuples, and splits the value
into two parts:

- the **header**, one ``int64`` vector. It opens with the tensor table: the number of tensors, then
  per tensor its dtype code (the position in :data:`_DTYPES`), its number of dimensions and its
  shape. The field values follow in field order: an int or bool as itself, a float as the 64 bits of
  its float64 (exact), a string as its utf-8 byte length, a list or a variable tuple as its length
  then its items, an optional field as a presence flag (0 or 1) then its value when present. A
  tensor field adds nothing there (its place in the table is its place in field order).
- the **tensors**, in field order, then one ``uint8`` blob holding every string's utf-8 bytes back to
  back (possibly empty).

So a new field of a supported type travels without an edit here, and a field of any other type
raises :class:`TypeError` naming its class and field when the class is first encoded or decoded.
Supported: ``torch.Tensor`` (any dtype of :data:`_DTYPES`), ``int``, ``float``, ``bool``, ``str``,
``X | None``, ``list[X]``, ``tuple[X, Y, ...]``, ``tuple[X, ...]``, dataclasses and NamedTuples of
those.

On the wire (:func:`send_rollout`, :func:`broadcast_rollout`) a message is a fixed ``int64 [2]``
prefix (the header's length and the tag of what follows; the tag is 0 in a collective), then the
header, then one ``uint8`` buffer holding every tensor's bytes in order, each starting at a multiple
of 8 bytes (left out when it is empty). Raw bytes let any dtype travel over gloo and NCCL alike, and
three messages a rollout keep the per-message cost of a small rollout low; the receiver sizes the
header from the prefix and the buffer from the header. A decoded tensor is a CPU view of the
received buffer.

The design of the rollout ranks' protocol is in :mod:`nemo_sspo.rollouts.worker`'s docstring.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nemo_sspo.parallel.metric_reduce import collective_device
from nemo_sspo.rollouts.records import RolloutPosition, VersionedRollout

__all__ = ["broadcast_rollout", "decode", "encode", "recv_free_rollout", "recv_rollout", "send_rollout", "send_start"]

T = TypeVar("T")

_START_TAG = 0  # step tags start at 1
_END_TAG = 2**31 - 1  # free-running: the number of rollouts sent, after the stop notice
_ROLLOUT_TAG = 2**31 - 2  # free-running: every rollout's prefix (received from any rollout rank)
_PREFIX = 2  # the wire prefix: the header's length, the tag of the header and tensors that follow

# A dtype's code on the wire is its index here: append, never reorder.
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


# ---- the codec --------------------------------------------------------------------------------------------------


class _Writer:
    """What :func:`encode` collects while walking a value: header values, tensors, string bytes."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.tensors: list[torch.Tensor] = []
        self.texts: list[bytes] = []


class _Reader:
    """What :func:`decode` consumes while walking a class: header values, tensors, the string blob."""

    def __init__(self, values: list[int], tensors: Iterator[torch.Tensor], blob: bytes) -> None:
        self.values, self.position = values, 0
        self.tensors, self.blob, self.blob_offset = tensors, blob, 0

    def take(self) -> int:
        value = self.values[self.position]
        self.position += 1
        return value


# A field's coder: (write(value, writer), read(reader) -> value), built once per annotation.
_Coder = tuple[Callable[[Any, _Writer], None], Callable[[_Reader], Any]]


def _tensor_coder() -> _Coder:
    def write(value, w: _Writer) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in _DTYPE_CODES:
            raise TypeError(f"tensor dtype {value.dtype} has no wire code (codec._DTYPES)")
        w.tensors.append(value)

    return write, lambda r: next(r.tensors)


def _int_write(value, w: _Writer) -> None:
    w.values.append(int(value))


def _float_write(value, w: _Writer) -> None:
    w.values.append(struct.unpack("<q", struct.pack("<d", float(value)))[0])


def _float_read(r: _Reader) -> float:
    return struct.unpack("<d", struct.pack("<q", r.take()))[0]


def _str_write(value, w: _Writer) -> None:
    if not isinstance(value, str):
        raise TypeError(f"expected a str, got {type(value).__name__}")
    encoded = value.encode()
    w.values.append(len(encoded))
    w.texts.append(encoded)


def _str_read(r: _Reader) -> str:
    length = r.take()
    text = r.blob[r.blob_offset:r.blob_offset + length].decode()
    r.blob_offset += length
    return text


def _optional_coder(inner: _Coder) -> _Coder:
    write_inner, read_inner = inner

    def write(value, w: _Writer) -> None:
        w.values.append(int(value is not None))
        if value is not None:
            write_inner(value, w)

    return write, lambda r: read_inner(r) if r.take() else None


def _sequence_coder(inner: _Coder, build: Callable) -> _Coder:
    """A list or ``tuple[X, ...]``: its length, then its items."""
    write_inner, read_inner = inner

    def write(value, w: _Writer) -> None:
        w.values.append(len(value))
        for item in value:
            write_inner(item, w)

    return write, lambda r: build(read_inner(r) for _ in range(r.take()))


def _fixed_tuple_coder(items: list[_Coder]) -> _Coder:
    def write(value, w: _Writer) -> None:
        if len(value) != len(items):
            raise TypeError(f"expected a tuple of {len(items)} items, got {len(value)}")
        for (write_item, _), item in zip(items, value, strict=True):
            write_item(item, w)

    return write, lambda r: tuple(read_item(r) for _, read_item in items)


def _record_coder(cls: type) -> _Coder:
    """A dataclass or NamedTuple: its fields in declaration order."""
    names, coders = _record_fields(cls)

    def write(value, w: _Writer) -> None:
        if not isinstance(value, cls):
            raise TypeError(f"expected a {cls.__name__}, got {type(value).__name__}")
        for name, (write_field, _) in zip(names, coders, strict=True):
            try:
                write_field(getattr(value, name), w)
            except TypeError as err:
                raise TypeError(f"{cls.__name__}.{name}: {err}") from None

    return write, lambda r: cls(**{name: read_field(r) for name, (_, read_field) in zip(names, coders, strict=True)})


def _is_record(tp) -> bool:
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or (issubclass(tp, tuple) and hasattr(tp, "_fields")))


@cache
def _record_fields(cls: type) -> tuple[tuple[str, ...], tuple[_Coder, ...]]:
    """A record class's field names and coders, in declaration order.

    Raises:
        TypeError: naming the class and field, for a field the codec cannot carry.
    """
    hints = typing.get_type_hints(cls)
    if dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        skipped = [f.name for f in fields if not f.init]
        if skipped:
            raise TypeError(f"{cls.__name__}.{skipped[0]}: a field outside __init__ cannot travel")
        names = tuple(f.name for f in fields)
    else:
        names = tuple(cls._fields)
    coders = []
    for name in names:
        try:
            coders.append(_coder(hints[name]))
        except TypeError as err:
            raise TypeError(f"{cls.__name__}.{name}: {err}") from None
    return names, tuple(coders)


def _coder(tp) -> _Coder:
    """The coder of one annotation (module docstring: what is supported).

    Raises:
        TypeError: an annotation the codec cannot carry.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is torch.Tensor:
        return _tensor_coder()
    if tp in (int, bool):
        return _int_write, (lambda r: r.take()) if tp is int else (lambda r: bool(r.take()))
    if tp is float:
        return _float_write, _float_read
    if tp is str:
        return _str_write, _str_read
    if origin in (typing.Union, types.UnionType):
        present = [arg for arg in args if arg is not type(None)]
        if len(present) == 1 and len(args) == 2:
            return _optional_coder(_coder(present[0]))
    if origin is list and len(args) == 1:
        return _sequence_coder(_coder(args[0]), list)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence_coder(_coder(args[0]), tuple)
    if origin is tuple and args and Ellipsis not in args:
        return _fixed_tuple_coder([_coder(arg) for arg in args])
    if _is_record(tp):
        return _record_coder(tp)
    raise TypeError(f"type {tp!r} cannot travel (rollouts.codec: tensors, int, float, bool, str, X | None, lists, "
                    f"tuples, dataclasses and NamedTuples of those)")


def encode(obj) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A dataclass or NamedTuple instance as a header and tensors (module docstring).

    Args:
        obj: an instance of a dataclass or NamedTuple whose fields the codec carries.

    Returns:
        ``(header, tensors)``: ``header`` int64 ``[H]`` on the CPU (tensor table and field values);
        ``tensors`` the instance's tensors in field order (as they are, on their devices), then the
        ``uint8`` blob of its strings' utf-8 bytes.

    Raises:
        TypeError: naming the class and field, for a field of a type the codec cannot carry or a
            value that does not match its annotation.
    """
    if not _is_record(type(obj)):
        raise TypeError(f"encode takes a dataclass or NamedTuple instance, got {type(obj).__name__}")
    writer = _Writer()
    _record_coder(type(obj))[0](obj, writer)
    blob = torch.frombuffer(bytearray(b"".join(writer.texts)), dtype=torch.uint8) if writer.texts else \
        torch.zeros(0, dtype=torch.uint8)
    tensors = [*writer.tensors, blob]
    table = [len(tensors)]
    for tensor in tensors:
        table += [_DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape]
    return torch.tensor(table + writer.values, dtype=torch.int64), tensors


def tensor_specs(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The ``(dtype, shape)`` of each tensor a header announces, in order (the blob last).

    Args:
        header: int64 ``[H]``, as :func:`encode` returns it.
    """
    return _read_table(header.tolist())[0]


def _read_table(values: list[int]) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], int]:
    """The tensor table at the start of a header's values, and where the field values begin."""
    specs, position = [], 1
    for _ in range(values[0]):
        code, ndim = values[position], values[position + 1]
        specs.append((_DTYPES[code], tuple(values[position + 2:position + 2 + ndim])))
        position += 2 + ndim
    return specs, position


def decode(cls: type[T], header: torch.Tensor, tensors: list[torch.Tensor]) -> T:
    """The ``cls`` instance that :func:`encode` turned into ``header`` and ``tensors``.

    Args:
        cls: the instance's dataclass or NamedTuple class.
        header: int64 ``[H]``.
        tensors: the tensors the header announces, in order (the string blob last); decoded tensors
            are these objects.

    Returns:
        The instance, every field equal to the encoded one's.

    Raises:
        TypeError: naming the class and field, for a field of a type the codec cannot carry.
    """
    if not _is_record(cls):
        raise TypeError(f"decode takes a dataclass or NamedTuple class, got {cls!r}")
    values = header.tolist()
    _, start = _read_table(values)
    reader = _Reader(values, iter(tensors[:-1]), tensors[-1].numpy().tobytes())
    reader.position = start
    return _record_coder(cls)[1](reader)


# ---- the transports ---------------------------------------------------------------------------------------------

_ALIGN = 8  # each tensor starts at a multiple of 8 bytes in the packed buffer (any dtype views in place)


def _layout(header: torch.Tensor) -> tuple[list[tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Each announced tensor's ``(byte offset, dtype, shape)`` in the packed buffer, and its size."""
    layout, size = [], 0
    for dtype, shape in tensor_specs(header):
        layout.append((size, dtype, shape))
        size += -(-_numel(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return layout, size


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _pack(header: torch.Tensor, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes in one ``uint8`` buffer on ``device``, at the offsets of :func:`_layout`."""
    layout, size = _layout(header)
    packed = torch.empty(size, dtype=torch.uint8, device=device)
    for (offset, _, _), tensor in zip(layout, tensors, strict=True):
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        packed[offset:offset + raw.numel()].copy_(raw)
    return packed


def _unpack(cls: type[T], header: torch.Tensor, packed: torch.Tensor) -> T:
    """Decodes a received packed buffer: every tensor a CPU view of it."""
    header, packed = header.cpu(), packed.cpu()
    layout, _ = _layout(header)
    tensors = [packed[offset:offset + _numel(shape) * dtype.itemsize].view(dtype).reshape(shape)
               for offset, dtype, shape in layout]
    return decode(cls, header, tensors)


def broadcast_rollout(obj: T | None, *, cls: type[T], src: int, group=None) -> T:
    """Broadcasts a rollout dataclass (any class :func:`encode` takes) from world rank ``src`` to every
    rank of ``group``: the prefix, the header, then the packed tensors (module docstring).

    Collective over ``group``; its tensors live on :func:`~nemo_sspo.parallel.metric_reduce.collective_device`
    (CUDA under NCCL) for the broadcasts only.

    Args:
        obj: the instance on ``src``; ignored elsewhere (pass None).
        cls: its class, the same on every rank.
        src: the sending rank's world rank (a member of ``group``).
        group: the process group; None is the default group.

    Returns:
        On ``src``, ``obj`` itself; elsewhere an equal instance whose tensors are on the CPU.

    Raises:
        TypeError: on ``src``, naming the class and field, for a field the codec cannot carry.
    """
    if dist.get_world_size(group) == 1:
        return obj
    device = collective_device(group)
    if dist.get_rank() == src:
        header, tensors = encode(obj)
        prefix = torch.tensor([header.numel(), 0], dtype=torch.int64)
        for message in (prefix.to(device), header.to(device), _pack(header, tensors, device)):
            if message.numel():
                dist.broadcast(message, src=src, group=group)
        return obj
    prefix = torch.zeros(_PREFIX, dtype=torch.int64, device=device)
    dist.broadcast(prefix, src=src, group=group)
    header = torch.zeros(int(prefix[0]), dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    packed = torch.empty(_layout(header.cpu())[1], dtype=torch.uint8, device=device)
    if packed.numel():
        dist.broadcast(packed, src=src, group=group)
    return _unpack(cls, header, packed)


@dataclass
class _Sent:
    """Tensors of an asynchronous send, kept alive until its works complete."""

    tensors: list[torch.Tensor]
    works: list


def send_rollout(versioned: VersionedRollout, *, dst: int, group: dist.ProcessGroup, tag: int,
                 header_tag: int | None = None) -> _Sent:
    """Starts sending a versioned rollout to world rank ``dst`` over ``group`` (module docstring).

    Args:
        versioned: the rollout, its policy version(s) and data position.
        dst: the receiving rank (rank numbering of ``group``).
        group: the bridge group (gloo: the tensors are sent from the CPU).
        tag: message tag of the header and tensors, the same on both sides (lock-step: the step;
            free-running: the rollout's number).
        header_tag: the prefix's tag, when it differs from ``tag`` (free-running: :data:`_ROLLOUT_TAG`).

    Returns:
        The pending send; call ``wait`` on each of its works (or keep it) before dropping it.

    Raises:
        TypeError: naming the class and field, for a field the codec cannot carry.
    """
    header, tensors = encode(versioned)
    prefix = torch.tensor([header.numel(), tag], dtype=torch.int64)
    packed = _pack(header, tensors, torch.device("cpu"))
    parts = [header, packed] if packed.numel() else [header]
    works = [group.send([prefix], dst, tag if header_tag is None else header_tag)]
    return _Sent([prefix, *parts], works + [group.send([t], dst, tag) for t in parts])


def recv_rollout(*, src: int, group: dist.ProcessGroup, tag: int, what: str | None = None) -> VersionedRollout:
    """Receives what :func:`send_rollout` sent from world rank ``src`` with ``tag`` (prefix included).

    Args:
        src: the sending rollout rank (world rank).
        group: the bridge group.
        tag: the message tag (the step).
        what: the awaited rollout, for the error (default ``"rollout for step <tag>"``).

    Returns:
        The rollout, its tensors on the CPU.

    Raises:
        RuntimeError: naming ``src`` and ``what``, when it died or sent nothing within the group's timeout.
    """
    what = what or f"rollout for step {tag}"
    try:
        prefix = _recv(torch.zeros(_PREFIX, dtype=torch.int64), src, group, tag)
    except RuntimeError as err:
        raise _silent(src, what, err) from err
    return _recv_rest(prefix, src, group, what)


def recv_free_rollout(*, group: dist.ProcessGroup, sources: list[int], src: int | None = None,
                      what: str) -> tuple[int, int, VersionedRollout]:
    """Receives the next free-running rollout (prefix tag :data:`_ROLLOUT_TAG`) from world rank ``src``,
    or with ``src`` None from whichever of ``sources`` sends first.

    Args:
        group: the bridge group.
        sources: world ranks of the rollout ranks (named in the error).
        src: the sender, or None for any.
        what: the awaited rollout, for the error.

    Returns:
        ``(src, number, rollout)``: its sender's world rank, its number (the tag of its header and
        tensors) and the rollout, its tensors on the CPU.

    Raises:
        RuntimeError: naming the rank(s) and ``what``, when none sent within the group's timeout.
    """
    prefix = torch.zeros(_PREFIX, dtype=torch.int64)
    try:
        if src is None:
            work = group.recv_anysource([prefix], _ROLLOUT_TAG)
            work.wait()
            src = work.source_rank()
        else:
            _recv(prefix, src, group, _ROLLOUT_TAG)
    except RuntimeError as err:
        raise _silent(sources if src is None else src, what, err) from err
    return src, int(prefix[1]), _recv_rest(prefix, src, group, what)


def _silent(src: int | list[int], what: str, err: RuntimeError) -> RuntimeError:
    if isinstance(src, int):
        return RuntimeError(f"rollout rank {src} sent no {what} (it died or hung past the timeout): {err}")
    return RuntimeError(f"no rollout rank of {src} sent {what} (they died or hung past the timeout): {err}")


def _recv_rest(prefix: torch.Tensor, src: int, group: dist.ProcessGroup, what: str) -> VersionedRollout:
    """The header and tensors that follow a received ``prefix`` from ``src`` (on the tag it names)."""
    length, tag = prefix.tolist()
    try:
        header = _recv(torch.zeros(length, dtype=torch.int64), src, group, tag)
        packed = torch.empty(_layout(header)[1], dtype=torch.uint8)
        if packed.numel():
            _recv(packed, src, group, tag)
    except RuntimeError as err:
        raise _silent(src, what, err) from err
    return _unpack(VersionedRollout, header, packed)


def send_start(completed_steps: int, position: RolloutPosition, replicas: list[int], *, dst: int,
               group: dist.ProcessGroup) -> None:
    """Training rank 0 tells rollout rank ``dst`` where the run starts (once to each rollout rank).

    The message holds the steps already done, ``dst``'s position (all 0 for a fresh run; a resumed
    run's weights follow, as a refit) and the world rank that receives each data-parallel replica's
    rollouts (its first model-parallel rank), in data-parallel order.

    Raises:
        RuntimeError: naming ``dst``, when it died or did not listen within the group's timeout.
    """
    message = torch.tensor([completed_steps, *position, len(replicas), *replicas], dtype=torch.int64)
    try:
        group.send([message[:4].clone()], dst, _START_TAG).wait()
        group.send([message[4:].clone()], dst, _START_TAG).wait()
    except RuntimeError as err:
        raise RuntimeError(f"rollout rank {dst} did not take the start of the run (it died or hung past the "
                           f"timeout): {err}") from err


def _recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int) -> torch.Tensor:
    group.recv([tensor], src, tag).wait()
    return tensor
