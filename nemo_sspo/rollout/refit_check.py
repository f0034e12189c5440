"""``rollout.refit.verify``: after a refit, check bucket by bucket that the engine holds the export.

While the engine loads a refit, each bucket is checksummed as it passes
(:func:`nemo_sspo.parallel.weight_checksum.tensors_checksums`, exact over the bytes), each weight cast
first to the dtype the engine holds it in (so a bf16 engine refitted from an fp32 export is
compared with the export rounded as the engine's copy rounds it). Once the engine has loaded every
bucket (and run whatever it does after the last one), it reads the same names back
(``read_weights``, :class:`nemo_sspo.rollout.RolloutEngine`) and their checksums must equal the
export's; the first bucket that differs raises, naming its first differing weight and the step.

Colocated, the checksummed tensors are the trainer's export itself. On a rollout rank
(``placement: separate``) they are the received buffers, which the broadcast reproduces bit for bit
(``tests/distributed/test_weight_broadcast.py``): the check covers the engine's load, and the step
is the version the trainer put in the stream's end marker. Cost: the checksum passes over each
weight twice on its own device (export and read-back) and one boolean per bucket to the host; the
engine's read-back must not copy (the HF engine returns its parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from nemo_sspo.parallel.weight_checksum import tensors_checksums

__all__ = ["VerifiedRefitEngine", "load_verified"]


def _read_back(engine, names: list[str]) -> dict[str, torch.Tensor]:
    """``engine.read_weights(names)``, refused clearly when the engine cannot read its weights back."""
    read = getattr(engine, "read_weights", None)
    held = read(names) if read is not None else None
    if held is None:
        raise ValueError(f"the refit check needs an engine that reads its weights back under HF names "
                         f"(read_weights); {type(engine).__name__} does not: turn the check off for it")
    missing = [name for name in names if name not in held]
    if missing:
        raise ValueError(f"{type(engine).__name__}.read_weights returned no {missing[:3]} of the refit's weights")
    return held


def _checksummed(buckets: Iterable[dict[str, torch.Tensor]], engine, record: list, end: dict
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """``buckets`` passed through; appends ``(names, [n, 2] checksums in the engine's dtypes)`` of each
    to ``record`` and the stream's return value (a receiver's version) to ``end["version"]``.
    """
    stream = iter(buckets)
    while True:
        try:
            bucket = next(stream)
        except StopIteration as stop:
            end["version"] = stop.value
            return
        names = list(bucket)
        dtypes = {name: tensor.dtype for name, tensor in _read_back(engine, names).items()}
        record.append((names, tensors_checksums(bucket, dtypes)))
        yield bucket
        del bucket  # hold no bucket while the stream produces the next one


def load_verified(engine, buckets: Iterable[dict[str, torch.Tensor]], *, step: int | None) -> int:
    """``engine.load_weight_buckets(buckets)``, then the check of the module docstring.

    Args:
        engine: a rollout engine with ``read_weights`` (:class:`nemo_sspo.rollout.RolloutEngine`).
        buckets: the refit's one-shot iterator of HF name -> tensor dicts (an export, or
            ``receive_weight_buckets``, whose return value is the sender's version).
        step: the step whose update the weights hold, named in the error; None takes the stream's
            version (a rollout rank).

    Returns:
        The number of buckets checked.

    Raises:
        RuntimeError: a bucket whose read-back checksums differ from the export's, naming the step,
            the bucket (0-based, in stream order) and its first differing weight.
        ValueError: the engine cannot read its weights back, or omits some of them.
    """
    record: list[tuple[list[str], torch.Tensor]] = []
    end: dict[str, int | None] = {"version": None}
    engine.load_weight_buckets(_checksummed(buckets, engine, record, end))
    step = step if step is not None else end["version"]
    for index, (names, expected) in enumerate(record):
        held = _read_back(engine, names)
        got = tensors_checksums({name: held[name] for name in names})
        differs = (got.to(expected.device) != expected).any(dim=1)
        if bool(differs.any()):
            first = names[int(differs.nonzero()[0, 0])]
            when = f"step {step}" if step is not None else "an unnamed step (the sender gave no version)"
            raise RuntimeError(f"refit check: after the refit of {when}, the engine's weights of bucket "
                               f"{index} differ from the trainer's export; first differing weight: {first!r} "
                               f"({int(differs.sum())} of the bucket's {len(names)} differ). The engine did not "
                               "load what the trainer sent: the run stops rather than generate from it")
    return len(record)


class VerifiedRefitEngine:
    """A rollout engine whose every refit is :func:`load_verified` (a rollout rank's engine; the step
    comes from the stream). Everything else is the inner engine's.

    Args:
        inner: the engine (it must have ``read_weights``).

    Attributes:
        inner: the wrapped engine.
        verified_buckets: buckets checked by the last refit.
    """

    def __init__(self, inner) -> None:  # noqa: D107 - documented on the class
        self.inner, self.verified_buckets = inner, 0

    def load_weight_buckets(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """The inner engine's refit, then the check (:func:`load_verified`, step from the stream)."""
        self.verified_buckets = load_verified(self.inner, buckets, step=None)

    def __getattr__(self, name: str):
        """Every other attribute (``generate``, ``stop_token_ids``, ``sleep``, ...) is the inner engine's."""
        return getattr(self.inner, name)
