"""make_actor_loss_func against figures recorded from NeMo-Aligner's own actors.

``data/nemo_aligner_recorded.json`` (tools/record_nemo_aligner.py) holds the losses and logits
gradients of NeMo-Aligner 0.7.0's PPO actor (a GRPO-style batch and a PPO batch with per-token
GAE advantages) and REINFORCE actor, and of the unreleased GRPO branch's actor (7b3805a) on a batch
with one zero-advantage group, each on one micro-batch with a one-rank vocab-parallel group.

Tolerances: the hosts ran in float32; ours runs in float64 from the same float32 logits: atol
2e-6 on losses, 1e-6 on gradients (entries are O(0.1)).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func
from tests.integration import _host_batches as hb

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

RECORD = json.loads((Path(__file__).parent / "data" / "nemo_aligner_recorded.json").read_text())
LOSS_ATOL, GRAD_ATOL = 2e-6, 1e-6
# Our GRPO set up as the host actors' clipped surrogate: eps 0.2, mean over the micro-batch's
# valid tokens.
_GRPO = {"eps_low": RECORD["ratio_eps"], "eps_high": RECORD["ratio_eps"],
         "aggregation": "token-mean"}


def _case(name):
    case = RECORD["cases"][name]
    batch = {key: torch.tensor(value, dtype=torch.float64) for key, value in case["batch"].items()}
    batch["response_tokens"] = batch["response_tokens"].long()
    logits = batch.pop("logits").requires_grad_(True)
    return case, batch, logits


def _ours(batch, logits, **kwargs):
    loss, metrics = make_actor_loss_func(batch, loss_name="grpo", loss_config=_GRPO,
                                         tp_group=None, dp_group=None, **kwargs)(logits)
    loss.backward()
    return float(loss.detach()), metrics


@pytest.mark.parametrize("name, layout", [("ppo_actor_grpo_batch", "tokens"),
                                          ("ppo_actor_gae_batch", "gae")])
def test_release_ppo_actor(name, layout):
    """GRPO-style batch (one truncated response) and PPO's GAE batch through the 0.7.0 actor."""
    case, batch, logits = _case(name)
    loss, metrics = _ours(batch, logits, advantage_layout=layout)
    assert loss == pytest.approx(case["loss"], abs=LOSS_ATOL)
    assert float(metrics["loss"]) == pytest.approx(case["metrics"]["loss"], abs=LOSS_ATOL)
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)


def test_gae_batch_is_refused_for_a_segment_loss():
    """SSPO needs one advantage per response: the GAE layout and the GAE values are refused."""
    _, batch, logits = _case("ppo_actor_gae_batch")
    with pytest.raises(ValueError, match="'gae'.*'sspo' has segmentation 'newline'"):
        make_actor_loss_func(batch, loss_name="sspo", tables=hb.tables(), tp_group=None,
                             dp_group=None, advantage_layout="gae")
    with pytest.raises(ValueError, match="advantages vary within a response"):
        _ours(batch, logits)  # the default "tokens" layout checks A is constant per response


def test_release_reinforce_actor():
    """The REINFORCE batch has no prev_logprobs: on-policy, our ratio is 1, so the gradient of
    -A_i r_t equals the host's gradient of -A_i log pi_t, and our loss value is
    -(sum over valid tokens of A_i) / (number of valid tokens), worked out here from the batch."""
    case, batch, logits = _case("reinforce_actor")
    assert "prev_logprobs" not in batch and "advantages" not in batch
    loss, _ = _ours(batch, logits, advantage_layout="reinforce")
    mask = batch["mask"].bool()
    advantage = (batch["rewards_with_kl"] - batch["baseline"]).reshape(-1)
    expected = -float((advantage[:, None] * mask).sum() / mask.sum())
    assert loss == pytest.approx(expected, rel=1e-12)
    assert loss != pytest.approx(case["loss"], abs=1e-3)  # the host's value is -A log pi's mean
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)


def test_grpo_branch_zero_advantage_rule():
    """Rows 2-3 form a group with all-zero advantages. The branch's actor leaves their tokens out
    of the mean (mask_rule="grpo_branch" reproduces it); 0.7.0's rule keeps them in the
    denominator, which shrinks the loss by valid tokens / non-zero-advantage tokens."""
    case, batch, logits = _case("grpo_branch_zero_advantage_group")
    loss, _ = _ours(batch, logits, mask_rule="grpo_branch")
    assert loss == pytest.approx(case["loss"], abs=LOSS_ATOL)
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)
    mask = batch["mask"].bool()
    kept = mask & (batch["advantages"] != 0)
    release_mask = mask & batch["is_end"].bool()[:, None]
    assert not kept[2:].any() and release_mask[3].any()  # row 3: zero advantage, ended
    release, _ = _ours(batch, logits.detach().clone().requires_grad_(True))
    # Same numerator (zero-advantage tokens add 0); denominators |kept| vs |release_mask|.
    assert release == pytest.approx(case["loss"] * float(kept.sum() / release_mask.sum()),
                                    abs=LOSS_ATOL)
    with pytest.raises(ValueError, match="mask_rule='grpo_branch' reads batch\\['advantages'\\]"):
        make_actor_loss_func(batch, loss_name="grpo", tp_group=None, dp_group=None,
                             advantage_layout="reinforce", mask_rule="grpo_branch")


def test_reinforce_batch_missing_key_is_named_without_entropy_advice():
    _, batch, _ = _case("reinforce_actor")
    del batch["baseline"]
    with pytest.raises(ValueError, match=r"lacks \['baseline'\]; the NeMo-Aligner 'reinforce' "
                                         r"actor batch needs .*'baseline'\]$"):
        make_actor_loss_func(batch, loss_name="grpo", tp_group=None, dp_group=None,
                             advantage_layout="reinforce")
    with pytest.raises(ValueError, match="old_entropy_source='data'"):
        make_actor_loss_func(batch, loss_name="grpo", tp_group=None, dp_group=None,
                             old_entropy_source="data")
