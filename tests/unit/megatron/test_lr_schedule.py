"""The learning-rate schedule (``optim.lr_schedule``, megatron-core's ``OptimizerParamScheduler``
behind :func:`nemo_sspo.megatron.training.build_lr_scheduler`): the rate of every update against
values worked out by hand. The scheduler only writes the optimizer's ``param_groups``, so a torch
Adam over one parameter stands for the Megatron optimizer here; the loop passes the real one."""

import math

import pytest
import torch

from nemo_sspo.megatron.training import build_lr_scheduler


def _rates(updates: int, **schedule) -> list[float]:
    """The learning rate of updates 1..``updates``, stepped as apply_optimizer_step steps it."""
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, lr=1.0, **schedule)
    rates = []
    for _ in range(updates):
        scheduler.step(1)  # apply_optimizer_step advances the schedule before each update
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


def test_cosine_with_warmup_by_hand():
    # warmup 2: updates 1, 2 at 1/2, 2/2. Then r = (k - 2) / (6 - 2) for k = 3..6:
    # 0.1 + 0.9 (1 + cos(pi r)) / 2 = 0.1 + 0.45 (1 + cos(pi r)); past update 6: min_lr 0.1.
    expected = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * (k - 2) / 4)) for k in range(3, 7)] + [0.1, 0.1]
    assert _rates(8, min_lr=0.1, schedule="cosine", warmup_steps=2, decay_steps=6) == pytest.approx(expected, abs=1e-12)
    assert expected[2:6] == pytest.approx([0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)),
                                           0.1], abs=1e-12)


def test_linear_without_warmup_and_constant():
    # linear from 1 to 0 over 4 updates: 1 - k/4 for k = 1..4, then 0
    assert _rates(5, min_lr=0.0, schedule="linear", warmup_steps=0, decay_steps=4) == pytest.approx(
        [0.75, 0.5, 0.25, 0.0, 0.0], abs=1e-12)
    assert _rates(4, min_lr=0.0, schedule="constant", warmup_steps=3, decay_steps=10) == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 1.0], abs=1e-12)


def test_resume_restores_the_update_count_and_keeps_this_runs_settings():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = build_lr_scheduler(optimizer, lr=1.0, min_lr=0.0, schedule="linear", warmup_steps=0, decay_steps=10)
    for _ in range(4):
        first.step(1)
    # the resumed run halves lr (an allowed change): update 5 of 10 runs at 0.5 x (1 - 5/10)
    resumed = build_lr_scheduler(optimizer, lr=0.5, min_lr=0.0, schedule="linear", warmup_steps=0, decay_steps=10)
    resumed.load_state_dict(first.state_dict())
    resumed.step(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize("bad", [dict(schedule="exp", warmup_steps=0, decay_steps=4, min_lr=0.0),
                                 dict(schedule="linear", warmup_steps=4, decay_steps=4, min_lr=0.0),
                                 dict(schedule="linear", warmup_steps=0, decay_steps=4, min_lr=2.0)])
def test_bad_settings_are_refused(bad):
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="schedule|decay_steps"):
        build_lr_scheduler(optimizer, lr=1.0, **bad)
