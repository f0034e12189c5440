"""Which rollout rank sends which prompt groups to which training replica, and how a replica stacks them.

The routes are worked out by hand from the two slot splits: rollout rank j of R generates slots
``[j P/R, (j+1) P/R)``, replica d of D trains on ``[d P/D, (d+1) P/D)``.
"""

import pytest
import torch

from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollouts.slots import concat_rollouts
from nemo_sspo.rollouts.slots import SlotRoute, merge_rollouts, slot_routes, slot_rows
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.records import VersionedRollout


@pytest.mark.parametrize("p, d, r, expected", [
    # one rollout rank splits its 4 groups over 2 replicas
    (4, 2, 1, [(0, 0, 0, 2), (0, 1, 2, 4)]),
    # one replica stacks the 2 groups of each of 2 rollout ranks
    (4, 1, 2, [(0, 0, 0, 2), (1, 0, 2, 4)]),
    # equal splits: rollout rank j feeds replica j
    (4, 2, 2, [(0, 0, 0, 2), (1, 1, 2, 4)]),
    # P=6, D=2 (3 each), R=3 (2 each): rank 1's slots 2, 3 straddle the replicas' border at 3
    (6, 2, 3, [(0, 0, 0, 2), (1, 0, 2, 3), (1, 1, 3, 4), (2, 1, 4, 6)]),
    # P=6, D=3 (2 each), R=2 (3 each): replica 1's slots 2, 3 come from both rollout ranks
    (6, 3, 2, [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]),
])
def test_slot_routes_by_hand(p, d, r, expected):
    assert slot_routes(p, d, r) == [SlotRoute(*route) for route in expected]


@pytest.mark.parametrize("d, r, name", [(3, 1, "dp_size=3"), (2, 3, "num_rollout_ranks=3"), (2, 0, "num_rollout_ranks=0")])
def test_slot_routes_refuse_uneven_splits(d, r, name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1 and divide prompts_per_step=4"):
        slot_routes(4, d, r)


def _group(prompt_len, response_len, token, reward, key):
    """One prompt group of one response: prompt ``[token] * prompt_len``, response of ``response_len``."""
    batch = RolloutBatch(prompt_ids=torch.full((1, prompt_len), token), prompt_mask=torch.ones(1, prompt_len, dtype=torch.bool),
                         response_ids=torch.full((1, response_len), token + 1),
                         response_mask=torch.ones(1, response_len, dtype=torch.bool),
                         truncated=torch.tensor([response_len == 3]), response_texts=["x" * response_len],
                         rollout_logprobs=torch.full((1, response_len), -0.5 * token))
    return batch, torch.tensor([reward]), key


def test_a_replica_fed_by_two_rollout_ranks_gets_what_a_colocated_generator_builds():
    # Three groups (samples_per_prompt 1) of different prompt / response lengths. A colocated generator of
    # slots 0..2 pads them together; rollout rank 0 (slot 0) and rank 1 (slots 1, 2) each send their rows
    # trimmed to their own padding, and the replica re-pads the stack.
    groups = [_group(1, 3, 5, 1.0, "a" * 32), _group(3, 1, 7, 0.0, "b" * 32), _group(2, 2, 9, 1.0, "c" * 32)]
    whole = concat_rollouts([g[0] for g in groups], pad_id=0)
    rewards = torch.cat([g[1] for g in groups])
    keys = [g[2] for g in groups]
    # rank 0 generated slot 0 twice (a dynamic-sampling refill), rank 1 generated slots 1 and 2 once each
    rank0 = Rollout(batch=groups[0][0], task_rewards=rewards[:1], rewards=rewards[:1], rounds=2, generated_groups=2,
                    prompt_keys=keys[:1], slot_generated=[2])
    rank1 = Rollout(batch=concat_rollouts([g[0] for g in groups[1:]], pad_id=0), task_rewards=rewards[1:],
                    rewards=rewards[1:], rounds=2, generated_groups=2, prompt_keys=keys[1:], slot_generated=[1, 1])
    parts = [VersionedRollout(slot_rows(rank0, 0, 1), version=3, problems_drawn=9, generated=(10.0, 12.0)),
             VersionedRollout(slot_rows(rank1, 0, 2), version=2, problems_drawn=9, generated=(9.5, 11.0))]
    merged = merge_rollouts(parts, pad_id=0)
    mb = merged.rollout.batch
    assert mb.prompt_ids.tolist() == [[0, 0, 5], [7, 7, 7], [0, 9, 9]]  # left-padded to width 3
    assert mb.prompt_mask.tolist() == whole.prompt_mask.tolist()
    assert mb.response_ids.tolist() == [[6, 6, 6], [8, 0, 0], [10, 10, 0]]  # right-padded to width 3
    assert mb.response_mask.tolist() == whole.response_mask.tolist()
    assert mb.rollout_logprobs.tolist() == [[-2.5] * 3, [-3.5, 0.0, 0.0], [-4.5, -4.5, 0.0]]
    assert mb.truncated.tolist() == [True, False, False] and mb.response_texts == ["xxx", "x", "xx"]
    assert merged.rollout.rewards.tolist() == merged.rollout.task_rewards.tolist() == [1.0, 0.0, 1.0]
    assert merged.rollout.prompt_keys == keys
    assert (merged.rollout.rounds, merged.rollout.generated_groups) == (2, 4)  # 2 + 1 + 1 groups generated
    assert (merged.version, merged.problems_drawn, merged.generated) == (2, 9, (9.5, 12.0))  # oldest, spanning


def test_slot_rows_count_the_groups_generated_for_their_slots():
    groups = [_group(1, 1, 5, 1.0, "a" * 32), _group(1, 1, 7, 0.0, "b" * 32), _group(1, 1, 9, 1.0, "c" * 32)]
    rollout = Rollout(batch=concat_rollouts([g[0] for g in groups], pad_id=0), task_rewards=torch.zeros(3),
                      rewards=torch.zeros(3), rounds=3, generated_groups=6, prompt_keys=[g[2] for g in groups],
                      slot_generated=[3, 1, 2])
    assert slot_rows(rollout, 0, 1).generated_groups == 3
    assert slot_rows(rollout, 1, 3).generated_groups == 1 + 2


def test_merge_refuses_rollout_ranks_out_of_step():
    group = _group(1, 1, 5, 1.0, "a" * 32)
    part = Rollout(batch=group[0], task_rewards=group[1], rewards=group[1], rounds=1, generated_groups=1,
                   prompt_keys=[group[2]])
    with pytest.raises(ValueError, match=r"out of step: sampling rounds \[1\], data positions \[2, 3\]"):
        merge_rollouts([VersionedRollout(part, version=0, problems_drawn=n, generated=(0.0, 1.0)) for n in (2, 3)],
                       pad_id=0)
