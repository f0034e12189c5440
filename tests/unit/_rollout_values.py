"""Rollout dataclass instances built from their fields' annotations, and a field-by-field equality
check (shared by the codec's unit and distributed tests).

:func:`build` fills every field of a class from its annotation, so a field added to a rollout
dataclass is filled, sent and compared without an edit here; an annotation this module does not
know fails loudly (teach :func:`_value` the new type, and the codec if it cannot carry it).
"""

from __future__ import annotations

import dataclasses
import types
import typing

import torch

from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollouts.records import Piece, Rollout, RolloutPosition, VersionedRollout
from nemo_sspo.rollouts.source import StepRollout

# Every class that travels between ranks (top level or nested).
ROLLOUT_CLASSES = (RolloutBatch, Rollout, VersionedRollout, Piece, RolloutPosition, StepRollout)

# Tensors cycle through these dtypes (bool and int16 included: masks and routes).
_DTYPES = (torch.bool, torch.int16, torch.float32, torch.int64, torch.uint8, torch.float64, torch.int32,
           torch.bfloat16, torch.int8, torch.float16)

# Non-ASCII text of 1-, 2-, 3- and 4-byte utf-8 characters, and the empty string.
_TEXTS = ("ab\u00e9 \u4e2d\u6587 \U0001F600", "", "x = \u221a2 \u2248 1.414")


class _Counter:
    """Distinct values for successive fields, so that a field swapped with another fails."""

    def __init__(self, seed: int) -> None:
        self.next = seed

    def __call__(self) -> int:
        self.next += 1
        return self.next


def build(cls, *, present: bool, seed: int = 0):
    """An instance of ``cls`` with every field set from its annotation.

    Args:
        cls: a dataclass or NamedTuple.
        present: True: optional fields hold values, lists hold 3 items, tensors have elements;
            False: optional fields None, lists empty, tensors have a zero-sized first dimension.
        seed: offsets every number (two seeds give different instances).

    Raises:
        AssertionError: an annotation :func:`_value` does not know.
    """
    return _value(cls, _Counter(seed), present, f"{cls.__name__}")


def _value(tp, count: _Counter, present: bool, where: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is torch.Tensor:
        n = count()
        dtype = _DTYPES[n % len(_DTYPES)]
        shape = (2 + n % 3, 3, 2, 2) if "routes" in where else (2 + n % 3, 1 + n % 4)
        if not present:
            shape = (0, *shape[1:])
        values = torch.arange(_numel(shape), dtype=torch.float64).reshape(shape) * 1.25 + n
        return (values.remainder(2) > 0.5) if dtype is torch.bool else values.to(dtype)
    if tp is bool:
        return True  # every bool field's default is False
    if tp is int:
        return -(2**40) + 7 * count()  # past 32 bits, negative, never a default 0
    if tp is float:
        return 1.7e9 + count() / 3  # a unix time in seconds that no microsecond count holds exactly
    if tp is str:
        return _TEXTS[count() % len(_TEXTS)] if present else ""
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(arg for arg in args if arg is not type(None))
        return _value(inner, count, present, where) if present else None
    if origin is list and len(args) == 1:
        return [_value(args[0], count, present, f"{where}[{i}]") for i in range(3 if present else 0)]
    if origin is tuple and args and Ellipsis not in args:
        return tuple(_value(arg, count, present, f"{where}[{i}]") for i, arg in enumerate(args))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _value(hints[f.name], count, present, f"{where}.{f.name}")
                     for f in dataclasses.fields(tp)})
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
        hints = typing.get_type_hints(tp)
        return tp(**{name: _value(hints[name], count, present, f"{where}.{name}") for name in tp._fields})
    raise AssertionError(f"{where}: no test value for annotation {tp!r}; teach tests/unit/_rollout_values.py "
                         "(and rollouts/codec.py if it cannot carry it)")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def assert_same(got, expected, where: str = "") -> int:
    """Asserts ``got`` equals ``expected`` field by field: tensors in dtype, shape and values,
    floats bit for bit, everything else by type and ``==``.

    Returns:
        The number of values compared (tensors, numbers, strings, Nones, lists and tuples).
    """
    where = where or type(expected).__name__
    assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.device.type == "cpu", f"{where}: on {got.device}"
        assert got.dtype == expected.dtype and got.shape == expected.shape, \
            f"{where}: {got.dtype} {tuple(got.shape)} != {expected.dtype} {tuple(expected.shape)}"
        assert torch.equal(got, expected), f"{where}: values differ"
        return 1
    if dataclasses.is_dataclass(expected):
        return sum(assert_same(getattr(got, f.name), getattr(expected, f.name), f"{where}.{f.name}")
                   for f in dataclasses.fields(expected))
    if isinstance(expected, tuple) and hasattr(expected, "_fields"):
        return sum(assert_same(getattr(got, name), getattr(expected, name), f"{where}.{name}")
                   for name in expected._fields)
    if isinstance(expected, list | tuple):
        assert len(got) == len(expected), f"{where}: {len(got)} items != {len(expected)}"
        return 1 + sum(assert_same(g, e, f"{where}[{i}]") for i, (g, e) in enumerate(zip(got, expected, strict=True)))
    if isinstance(expected, float):
        assert got.hex() == expected.hex(), f"{where}: {got!r} != {expected!r}"
        return 1
    assert got == expected, f"{where}: {got!r} != {expected!r}"
    return 1
