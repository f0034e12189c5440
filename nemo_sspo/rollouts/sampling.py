"""One step's rollouts on a generator rank: prompts -> groups of G responses -> rewards, with DAPO
dynamic sampling and overlong reward shaping.

Slots. A step trains on ``rollout.prompts_per_step`` prompt groups, the *slots* 0..P-1 (global
prompt indices); data-parallel rank d owns slots ``[d P/dp, (d+1) P/dp)``. The group of slot k in
round r is sampled with the seed :func:`generation_seed` ``(trainer.seed, step, r, k)``.

Dynamic sampling (``rollout.sampling.dynamic_sampling``; DAPO, arXiv 2503.14476 section 3.2, eq. 11): a slot
whose G task rewards are all equal carries no learning signal (advantage 0); it stays *open* and is
refilled with a fresh prompt in the next round, until no slot is open or
``rollout.sampling.max_sampling_rounds`` rounds have run. In each round every generator rank draws the same
U prompts from its identically seeded prompt stream (U = open slots over all ranks, known from one
all-reduce of the open flags over the generators' data-parallel group) and gives the j-th to the
j-th open slot. Whether a slot is open depends only on its own candidates, so the kept groups and
every response are the same for any data-parallel split, and every rank ends with exactly P/dp
groups (the same rows per update on every rank). The filter reads the task reward (DAPO filters on
accuracy), not the shaped one.

A generator built with ``shared_stream=False`` (a free-running rollout rank, which generates at its
own pace) instead draws only its own slots' problems from a prompt stream of its own (a
:class:`nemo_sspo.data.ShardedSource` of the common one) and refills only its own slots: no
all-reduce, and its rollouts depend on nothing the other generators do.

At the round limit the step still trains on the full batch: each still-open slot keeps its last
(zero-variance) group, whose advantage is 0; rank 0 logs a warning with the counts, and the metrics
``rollout/sampling_rounds`` and ``rollout/kept_group_frac`` (groups with reward variance / groups
generated) show it. Refilling slot by slot generates only the missing groups (no surplus to throw
away) but may need more, smaller rounds than over-sampling whole batches.

Overlong shaping (``reward.overlong_buffer_len`` > 0; DAPO eq. 13) adds
``overlong_reward_shaping(length, rollout.sampling.max_new_tokens, overlong_buffer_len, overlong_penalty)``
to the task reward of every response. The advantages still give a group whose task rewards are all
equal advantage 0 (``group_advantages(..., task_rewards=...)``), so the shaped rewards of such a
group, kept at the round limit or sampled without dynamic sampling, carry no signal.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_sspo.algorithms import overlong_reward_shaping, select_nonzero_variance_groups
from nemo_sspo.data import render_prompt
from nemo_sspo.parallel.metric_reduce import collective_device
from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollout.partial import generate_with_refits
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.slots import concat_rollouts

__all__ = ["RefitHooks", "RolloutSampler", "generation_seed", "prompt_key"]


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitHooks:
    """How a generation with partial rollouts (``rollout.schedule.partial``) learns of and takes new weights.

    Attributes:
        version: the version of the weights the engine holds now.
        pending: whether new weights wait (polled between decode steps).
        take: loads them; returns their version, or None when the run stops instead.
    """

    version: Callable[[], int]
    pending: Callable[[], bool]
    take: Callable[[], int | None]


def generation_seed(seed: int, step: int, round_: int, slot: int) -> int:
    """Sampling seed of slot ``slot``'s group in round ``round_`` of ``step``: a 63-bit hash of the
    four numbers only (never of the data-parallel split).
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{round_}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def prompt_key(question: str) -> str:
    """A stable key of a problem: 32 hex digits of a hash of its text.

    The same in every process and run, and short enough to keep one entry per training problem in a
    checkpoint.
    """
    return hashlib.blake2b(question.encode(), digest_size=16).hexdigest()


class RolloutSampler:
    """Generates and scores one step's groups on a generator rank (module docstring).

    Args:
        engine: rollout engine with ``generate(prompts, *, seed) -> RolloutBatch``.
        reward: callable ``(response_texts, answers) -> list[float]``.
        prompts: prompt source (``sample(n)``), seeded identically on every generator rank.
        tokenizer: for the prompt template and padding.
        cfg: the run's ``TrainConfig`` (reads ``rollout``, ``reward``, ``data.template``, ``trainer.seed``).
        groups: this rank's ``ParallelGroups`` (data-parallel rank, size and group).
        shared_stream: True: every generator draws all open slots' problems from identically seeded
            streams and the open slots are all-reduced; False: this generator's own stream and slots
            only (module docstring).
        progress: a :class:`nemo_sspo.trainer.progress.StepProgress` (or any object with its ``phase``), told of
            the responses generated (after each group) and of the scoring (None: nothing
            is shown).
    """

    def __init__(self, *, engine, reward, prompts, tokenizer, cfg, groups, shared_stream: bool = True,
                 progress=None) -> None:
        self.engine, self.reward, self.prompts, self.tokenizer = engine, reward, prompts, tokenizer
        self.progress = progress
        self.cfg, self.groups, self.shared_stream = cfg, groups, shared_stream
        self.slots_per_rank = cfg.rollout.prompts_per_step // groups.dp_size
        self.first_slot = groups.dp_rank * self.slots_per_rank
        self.problems_drawn = 0
        """Problems drawn from ``prompts`` so far: the data position saved in checkpoints."""
        self.refits: RefitHooks | None = None
        """Partial rollouts (a free-running rollout rank sets them): responses continue across refits
        (:func:`nemo_sspo.rollout.partial.generate_with_refits`); None: each group is one ``generate``."""

    def fast_forward(self, problems_drawn: int) -> None:
        """Replays ``problems_drawn`` draws of the (seeded) prompt source, to resume a run's data position.

        Raises:
            ValueError: problems were already drawn by this sampler.
        """
        if self.problems_drawn:
            raise ValueError("fast_forward must run before the first step (problems were already drawn)")
        if problems_drawn:
            self.prompts.sample(problems_drawn)
        self.problems_drawn = problems_drawn

    def collect(self, step: int) -> Rollout:
        """The step's rollout for this rank's slots (collective over the generators when dynamic
        sampling is on).
        """
        ro = self.cfg.rollout
        max_rounds = ro.sampling.max_sampling_rounds if ro.sampling.dynamic_sampling else 1
        slots: list[tuple[RolloutBatch, torch.Tensor, bool] | None] = [None] * self.slots_per_rank
        keys: list[str | None] = [None] * self.slots_per_rank
        generated = [0] * self.slots_per_rank
        open_slots = list(range(ro.prompts_per_step) if self.shared_stream else
                          range(self.first_slot, self.first_slot + self.slots_per_rank))
        total = len(open_slots)
        self._timeouts = 0 if hasattr(self.reward, "timeouts") else None
        self._scored = 0
        rounds = 0
        while open_slots and rounds < max_rounds:
            problems = self.prompts.sample(len(open_slots))
            self.problems_drawn += len(problems)
            mine = [(slot, problem) for slot, problem in zip(open_slots, problems, strict=True)
                    if self.first_slot <= slot < self.first_slot + self.slots_per_rank]
            for (slot, problem), group in zip(mine, self._generate(step, rounds, mine), strict=True):
                slots[slot - self.first_slot] = group
                keys[slot - self.first_slot] = prompt_key(problem.question)
                generated[slot - self.first_slot] += 1
            rounds += 1
            open_slots = self._open_slots(slots) if ro.sampling.dynamic_sampling else []
        if open_slots and (self.groups.dp_rank == 0 or not self.shared_stream):
            logger.warning(
                "step %d: dynamic sampling found %d of %d prompt groups with reward variance after %d rounds "
                "(rollout.sampling.max_sampling_rounds=%d); training on the full batch, the other %d groups have "
                "advantage 0. Raise rollout.sampling.max_sampling_rounds or use easier/harder prompts.",
                step, total - len(open_slots), total, rounds,
                ro.sampling.max_sampling_rounds, len(open_slots))
        batch = concat_rollouts([part for part, _, _ in slots], pad_id=self.tokenizer.pad_token_id)
        task_rewards = torch.cat([rewards for _, rewards, _ in slots])
        return Rollout(batch=batch, task_rewards=task_rewards, rewards=task_rewards + self._shaping(batch),
                       rounds=rounds, generated_groups=sum(generated), prompt_keys=keys, slot_generated=generated,
                       reward_timeouts=self._timeouts, scored_responses=self._scored)

    def _generate(self, step: int, round_: int, work: list) -> list[tuple[RolloutBatch, torch.Tensor, bool]]:
        """``(responses, task rewards [G] float32, has reward variance)`` per ``(slot, problem)``;
        one reward call for the whole round.
        """
        group = self.cfg.rollout.samples_per_prompt
        parts = []
        for slot, problem in work:
            prompt = render_prompt(self.tokenizer, problem.question, self.cfg.data.template)
            seed = generation_seed(self.cfg.trainer.seed, step, round_, slot)
            parts.append(self._sample([prompt] * group, seed))
            if self.progress is not None:
                self.progress.phase("generation", len(parts) * group, len(work) * group, "responses")
        if not parts:
            return []
        texts = [text for part in parts for text in part.response_texts]
        if self.progress is not None:
            self.progress.phase(f"scoring {len(texts)} responses")
        answers = [problem.answer for _, problem in work for _ in range(group)]
        before = getattr(self.reward, "timeouts", 0)
        rewards = torch.tensor(self.reward(texts, answers), dtype=torch.float32)
        self._scored += len(texts)
        if self._timeouts is not None:
            self._timeouts += self.reward.timeouts - before
        varied = set(select_nonzero_variance_groups(rewards, group).tolist())
        return [(part, r, k in varied) for k, (part, r) in enumerate(zip(parts, rewards.split(group), strict=True))]

    def _sample(self, prompts: list[str], seed: int) -> RolloutBatch:
        """One group's responses: one ``generate``, or continued across refits with :attr:`refits`."""
        hooks = self.refits
        if hooks is None:
            return self.engine.generate(prompts, seed=seed)
        return generate_with_refits(self.engine, prompts, seed=seed, version=hooks.version(),
                                    max_new_tokens=self.cfg.rollout.sampling.max_new_tokens, interrupt=hooks.pending,
                                    refit=hooks.take, pad_id=self.tokenizer.pad_token_id,
                                    decode=lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True))

    def _open_slots(self, slots) -> list[int]:
        """Global indices of the slots whose group has no reward variance, over all generators."""
        flags = torch.zeros(self.cfg.rollout.prompts_per_step, dtype=torch.int64)
        for k, (_, _, varied) in enumerate(slots):
            flags[self.first_slot + k] = int(not varied)
        if self.shared_stream and self.groups.dp_size > 1:
            on_device = flags.to(collective_device(self.groups.dp_group))
            dist.all_reduce(on_device, group=self.groups.dp_group)
            flags = on_device.cpu()
        return torch.nonzero(flags).flatten().tolist()

    def _shaping(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B]`` float32 overlong penalty (0 when ``reward.overlong_buffer_len`` is 0)."""
        rw = self.cfg.reward
        lengths = batch.response_mask.sum(dim=1)
        if rw.overlong_buffer_len == 0:
            return torch.zeros(lengths.shape, dtype=torch.float32)
        return overlong_reward_shaping(lengths, self.cfg.rollout.sampling.max_new_tokens, rw.overlong_buffer_len,
                                       rw.overlong_penalty)
