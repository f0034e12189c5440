"""In-process training runs on the tiny random Llama, shared by the loop tests.

Sized for 2 CPU cores: the Qwen-Math template (~60 prompt tokens instead of ~185 for chat-boxed),
8-token responses, 2 x 2 responses per step, one checkpoint load per test module, no HF checkpoint.
The math-verify reward pool is replaced by a stub reward passed to the trainer (``reward=``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.rewards import register_reward
from nemo_sspo.trainer import loop, policy
from nemo_sspo.trainer.setup import start_parallel
from tests.unit.loss_cases import hand_aggregate

TINY = [
    "model=tiny_random", "data.template=qwen-math", "trainer.max_steps=2", "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2", "rollout.sampling.max_new_tokens=8", "parallel.micro_batch_size=2",
    "trainer.minibatches_per_step=2", "trainer.save_hf_checkpoint=false", "trainer.overwrite_output_dir=true",
]


class ParityReward:
    """1 for responses with an even character count, else 0: varied rewards from a random model."""

    def __init__(self, **_):
        pass

    def __call__(self, responses, answers):
        return [float(len(r) % 2 == 0) for r in responses]

    def close(self):
        pass


PARITY_REWARD = "test_parity"
"""``reward.name`` of :class:`ParityReward` (registered on import), for runs configured by overrides alone."""
register_reward(PARITY_REWARD, lambda section: ParityReward())


class OddAnswerReward(ParityReward):
    """Rewards vary (1, 0, 1, 0, ... within a group) only for problems with an odd answer; a problem
    with an even answer gets 0 for every response (a zero-variance group)."""

    def __call__(self, responses, answers):
        return [float(int(a) % 2 == 1 and i % 2 == 0) for i, a in enumerate(answers)]


class ZeroReward(ParityReward):
    """0 for everything: no group ever has reward variance."""

    def __call__(self, responses, answers):
        return [0.0] * len(responses)


def record_updates(monkeypatch, store):
    """Wraps the policy's optimizer step: appends ``(mini_batch, metric_sums)`` for every update, in
    order (with ``trainer.minibatches_per_step=2``, entries 0 and 1 belong to step 1)."""
    inner = policy.train_on_batch

    def wrapped(model, optimizer, batch, *args, **kwargs):
        sums, grad_norm = inner(model, optimizer, batch, *args, **kwargs)
        store.append((batch, dict(sums)))  # MetricPairs are immutable
        return sums, grad_norm

    monkeypatch.setattr(policy, "train_on_batch", wrapped)


def observe(trainer, event: str, record) -> None:
    """Calls ``record(data)`` for every step event ``event`` of ``trainer`` (a step observer,
    :mod:`nemo_sspo.trainer.step_metrics`: ``rollout``, ``advantages``, ``batch``, ``update``, ...)."""
    trainer.metrics.observers.append(lambda step, name, data: record(data) if name == event else None)


def record_rollouts(trainer, store) -> None:
    """Appends the :class:`~nemo_sspo.rollouts.records.Rollout` every step trains on."""
    observe(trainer, "rollout", lambda got: store.append(got.versioned.rollout))


def record_prepared(trainer, store) -> None:
    """Appends ``(rollout, batch)`` for every step: its rollout and the policy batch prepared from it."""
    rollouts = []
    record_rollouts(trainer, rollouts)
    observe(trainer, "batch", lambda batch: store.append((rollouts[-1], batch)))


def generate(trainer, step: int):
    """Step ``step``'s rollout generated now from the engine's weights, outside a step (colocated)."""
    return trainer.source.producer.produce(step, 0).rollout


def record_step_starts() -> dict[int, float]:
    """Wraps ``GRPOTrainer.train_step`` in this process: the returned dict gets step -> its
    ``time.monotonic()`` start (for tests that time how long a failing step took)."""
    starts, inner = {}, loop.GRPOTrainer.train_step

    def timed_step(self, step):
        starts[step] = time.monotonic()
        return inner(self, step)

    loop.GRPOTrainer.train_step = timed_step
    return starts


def on_policy_loss(batch, aggregation: str, max_response_length: int) -> tuple[float, float]:
    """(loss, denominator) of a mini-batch whose ratios are all 1 under a ratio loss: every token's
    loss is -A_i, reduced by hand (``tests.unit.loss_cases.hand_aggregate``)."""
    per_token = -batch.advantages.double()[:, None].expand(batch.loss_mask.shape)
    return hand_aggregate(per_token, batch.loss_mask, aggregation, max_response_length)


def make_trainer(monkeypatch, tmp_path, overrides, *, checkpoint=None, reward=ParityReward, engine=None):
    """A :class:`loop.GRPOTrainer` on ``TINY + overrides`` writing to ``tmp_path``, scoring with a
    ``reward()`` it is given (no math-verify pool) and generating with ``engine`` (None: the
    configured one); call ``destroy_parallel()`` when done (``run`` does)."""
    cfg = load_config(overrides=[*TINY, f"trainer.output_dir={tmp_path}", *overrides])
    return loop.GRPOTrainer(cfg, start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint,
                            reward=reward(), engine=engine)


def run(monkeypatch, tmp_path, overrides, *, checkpoint=None, reward=ParityReward, capture=None):
    """``trainer.fit()`` history; ``capture(trainer)`` may wrap trainer methods before the run. Megatron's
    parallel state is torn down whatever happens, a trainer that refuses to start included."""
    try:
        trainer = make_trainer(monkeypatch, tmp_path, overrides, checkpoint=checkpoint, reward=reward)
        if capture is not None:
            capture(trainer)
        return trainer.fit()
    finally:
        destroy_parallel()


def untimed(record: dict) -> dict:
    """A metrics record without its wall-clock values (``timing/``, ``throughput/``): what two runs of the
    same seed must agree on."""
    return {k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/"))}


def records_by_step(path: Path) -> dict[int, dict]:
    """A ``metrics.jsonl``'s records by step, :func:`untimed`."""
    return {r["step"]: untimed(r) for r in map(json.loads, path.read_text().splitlines())}
