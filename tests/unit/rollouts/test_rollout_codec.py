"""The rollout codec (nemo_sspo.rollouts.codec) in one process: every field of every rollout dataclass
round-trips (values built from the fields' annotations, so a field the codec drops fails here
without an edit), the header's layout worked out by hand, and the errors for what cannot travel.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, replace

import pytest
import torch

from nemo_sspo.rollouts.codec import _pack, _unpack, decode, encode, tensor_specs
from nemo_sspo.rollouts.records import Piece, Rollout, RolloutPosition, VersionedRollout
from tests.unit._rollout_values import ROLLOUT_CLASSES, assert_same, build


def _round_trip(obj):
    """Encoded, packed into one buffer as the transports send it, unpacked and decoded."""
    header, tensors = encode(obj)
    assert header.dtype == torch.int64 and header.dim() == 1
    return _unpack(type(obj), header.clone(), _pack(header, tensors, torch.device("cpu")).clone())


def _leaf_fields(cls) -> int:
    """Fields of ``cls`` counted down through nested records (a lower bound of the values compared)."""
    if not isinstance(cls, type) or not (dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")):
        return 1
    return sum(_leaf_fields(tp) for tp in typing.get_type_hints(cls).values())


def _defaults(cls) -> dict:
    """Each field's default value, for the fields that have one."""
    if not dataclasses.is_dataclass(cls):
        return dict(cls._field_defaults)
    defaults = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


@pytest.mark.parametrize("present", [True, False], ids=["values", "empty"])
@pytest.mark.parametrize("cls", ROLLOUT_CLASSES, ids=lambda cls: cls.__name__)
def test_every_field_of_every_rollout_class_round_trips(cls, present):
    sent = build(cls, present=present)
    if present:  # every field with a default holds another value, so a field dropped on decode shows
        for name, default in _defaults(cls).items():
            value = getattr(sent, name)
            assert value is not None if default is None else value != default, name
    compared = assert_same(_round_trip(sent), sent)
    assert compared >= _leaf_fields(cls)


def test_routes_and_token_versions_each_present_or_absent():
    full = build(VersionedRollout, present=True, seed=5)
    batch = full.rollout.batch
    assert batch.routes is not None and batch.token_versions is not None
    for routes, versions in ((batch.routes, None), (None, batch.token_versions), (None, None)):
        rollout = replace(full.rollout, batch=replace(batch, routes=routes, token_versions=versions))
        sent = replace(full, rollout=rollout)
        assert_same(_round_trip(sent), sent)
    # router-replay routes as the engine records them: int16 [B, S, L, k]
    routes = torch.tensor([[[[0, 31999], [7, -1]]]], dtype=torch.int16).expand(2, 3, 2, 2)
    sent = replace(full, rollout=replace(full.rollout, batch=replace(batch, routes=routes)))
    got = _round_trip(sent)
    assert got.rollout.batch.routes.dtype == torch.int16 and got.rollout.batch.routes.shape == (2, 3, 2, 2)
    assert got.rollout.batch.routes[1, 2, 0].tolist() == [0, 31999]


def test_texts_empty_and_non_ascii():
    full = build(Rollout, present=True)
    texts = ["", "caf\u00e9", "", "\u4e2d\u6587\U0001F600", "a\0b"]
    sent = replace(full, batch=replace(full.batch, response_texts=texts), prompt_keys=["0123456789abcdef" * 2])
    got = _round_trip(sent)
    assert got.batch.response_texts == texts and got.prompt_keys == ["0123456789abcdef" * 2]
    none = replace(full, batch=replace(full.batch, response_texts=[""] * 3))
    assert _round_trip(none).batch.response_texts == ["", "", ""]


@dataclass
class _Texts:
    names: list[str]
    tag: str | None


def test_the_header_layout_by_hand():
    # tensor table: 1 tensor (the string blob: uint8 code 1, 1 dimension, 0 bytes), then the fields 3, 7
    header, tensors = encode(RolloutPosition(3, 7))
    assert header.tolist() == [1, 1, 1, 0, 3, 7] and len(tensors) == 1 and tensors[0].numel() == 0
    # floats as their float64 bits: 0.5 = 0x3FE0000000000000, -2.0 = 0xC000000000000000 (signed int64)
    header, _ = encode(Piece(1, 2, 3, (0.5, -2.0)))
    assert header.tolist() == [1, 1, 1, 0, 1, 2, 3, 0x3FE0000000000000, 0xC000000000000000 - 2**64]
    # strings: their utf-8 lengths (e-acute is 2 bytes), the bytes in the blob; None as presence flag 0
    header, tensors = encode(_Texts(["\u00e9", ""], None))
    assert header.tolist() == [1, 1, 1, 2, 2, 2, 0, 0]
    assert bytes(tensors[0].tolist()) == b"\xc3\xa9"
    # tensors: dtype code (bool 0, int16 3, float32 8), dimensions, shape, in field order, the blob last
    rollout = Rollout(batch=build(Rollout, present=True).batch, task_rewards=torch.zeros(4), rewards=torch.ones(4),
                      rounds=2, generated_groups=1, prompt_keys=[])
    specs = tensor_specs(encode(rollout)[0])
    assert specs[-3:] == [(torch.float32, (4,)), (torch.float32, (4,)), (torch.uint8, (sum(
        len(t.encode()) for t in rollout.batch.response_texts),))]


@dataclass
class _Masks:
    flags: torch.Tensor
    ids: torch.Tensor
    word: str


def test_the_packed_buffer_by_hand():
    # bool [3] at bytes 0-2, padded to 8; int64 [2] at 8-23; the blob "hi" at 24-25, padded to 32
    sent = _Masks(torch.tensor([True, False, True]), torch.tensor([258, -1]), "hi")
    header, tensors = encode(sent)
    packed = _pack(header, tensors, torch.device("cpu"))
    assert packed.numel() == 32
    assert packed[:3].tolist() == [1, 0, 1]
    assert packed[8:24].tolist() == [2, 1, 0, 0, 0, 0, 0, 0] + [255] * 8  # little-endian 258 = 0x0102, then -1
    assert bytes(packed[24:26].tolist()) == b"hi"
    assert_same(_unpack(_Masks, header, packed), sent)


@dataclass
class _Bad:
    scores: dict[str, int]


@dataclass
class _Outer:
    inner: _Bad


def test_a_field_that_cannot_travel_is_named():
    with pytest.raises(TypeError, match=r"_Bad\.scores: type dict\[str, int\] cannot travel"):
        encode(_Bad({"a": 1}))
    with pytest.raises(TypeError, match=r"_Bad\.scores"):
        decode(_Bad, torch.tensor([1, 1, 1, 0]), [torch.zeros(0, dtype=torch.uint8)])
    with pytest.raises(TypeError, match=r"_Outer\.inner: _Bad\.scores"):
        encode(_Outer(_Bad({})))
    rollout = build(Rollout, present=True)
    with pytest.raises(TypeError, match=r"Rollout\.task_rewards: expected a torch\.Tensor, got list"):
        encode(replace(rollout, task_rewards=[1.0]))
    with pytest.raises(TypeError, match=r"Rollout\.batch: RolloutBatch\.prompt_ids: tensor dtype torch\.complex64"):
        encode(replace(rollout, batch=replace(rollout.batch, prompt_ids=torch.zeros(2, dtype=torch.complex64))))
    with pytest.raises(TypeError, match="dataclass or NamedTuple instance, got dict"):
        encode({"a": 1})
