"""NeMoRLPolicyLoss against figures recorded from the real NeMo-RL (tools/record_nemo_rl.py).

``data/nemo_rl_recorded.json`` holds, for fixed small batches, NeMo-RL's own ``ClippedPGLossFn``
loss and gradient with respect to the logits, run through the host's own input preparation and
wrappers at the commit named in the file (``host_commit``). NeMo-RL cannot be installed in CI, so
its interface module is stood in for with the enum values recorded from it, and the host's calls
are reproduced: ``next_token_logprobs`` from the logits, one call per micro-batch (per sequence
when packed) with the global counts, losses summed.

Tolerances: the host ran in float32 (its log-prob path casts logits to float32); ours runs in
float64 from the same float32 logits, so figures agree to float32 rounding: atol 2e-6 on losses,
1e-6 on gradients (entries are O(0.1)).
"""

from __future__ import annotations

import enum
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from nemo_sspo.algorithms.losses import (
    LossInputs,
    build_policy_loss_config,
    make_policy_loss,
    policy_loss_sums,
)
from nemo_sspo.algorithms.segmentation import build_segment_tables, segment_ids

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

RECORD = json.loads((Path(__file__).parent / "data" / "nemo_rl_recorded.json").read_text())
LOSS_ATOL, GRAD_ATOL = 2e-6, 1e-6
_UNPACKED = [name for name in RECORD["cases"]
             if not name.startswith("packed") and name != "reference_kl"]


@pytest.fixture
def nemo_rl(monkeypatch):
    """sys.modules stand-in for nemo_rl.algorithms.loss.interfaces with the recorded enums."""
    names = ["nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss",
             "nemo_rl.algorithms.loss.interfaces"]
    modules = {name: types.ModuleType(name) for name in names}
    for enum_name, members in RECORD["enums"].items():
        setattr(modules[names[-1]], enum_name, enum.Enum(enum_name, members))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    from nemo_sspo.integrations import nemo_rl as adapter
    return adapter


def _batch(keys=None) -> dict[str, torch.Tensor]:
    batch = {key: torch.tensor(value, dtype=torch.float64) for key, value in
             RECORD["batch"].items() if keys is None or key in keys or key == "logits"}
    for key in ("input_ids", "input_lengths"):
        if key in batch:
            batch[key] = batch[key].long()
    return batch


def _global_counts(batch):
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    return batch["sample_mask"].sum(), mask.sum()


def _logprobs(logits, ids):
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


class _ToyTokenizer:
    def __len__(self):
        return len(RECORD["batch"]["logits"][0][0])

    def decode(self, ids):
        return "t\n" if ids[0] == RECORD["sspo_newline_id"] else f"t{ids[0]}"


def _data(batch, rows):
    return {key: value[rows] for key, value in batch.items() if key != "logits"}


@pytest.mark.parametrize("name", _UNPACKED)
def test_unpacked_cases_match_recorded_host(nemo_rl, name):
    case = RECORD["cases"][name]
    loss_fn = nemo_rl.NeMoRLPolicyLoss(case["loss_name"], case["config"])
    assert loss_fn.input_type.value == "logprob"
    assert loss_fn.loss_type.value == ("token_level" if case["host_config"]["token_level_loss"]
                                       else "sequence_level")
    batch = _batch()
    seqs, toks = _global_counts(batch)
    logits = batch["logits"].clone().requires_grad_(True)
    total = 0.0
    for start, stop in case.get("micro_batches", [[0, logits.shape[0]]]):
        rows = slice(start, stop)
        loss, metrics = loss_fn(_data(batch, rows), seqs, toks,
                                next_token_logprobs=_logprobs(logits[rows], batch["input_ids"][rows]))
        total = total + loss
    total.backward()
    assert float(total.detach()) == pytest.approx(case["loss"], abs=LOSS_ATOL)
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)
    assert metrics["num_valid_samples"] == case["metrics"][-1]["num_valid_samples"]


def test_reference_kl_value_matches_and_gradient_differs_by_the_score_term(nemo_rl):
    """GRPO token-mean with a k3 reference KL (coefficient 0.05).

    The loss values agree. The gradients differ by design: NeMo-RL multiplies the per-token k3
    by exp(log pi - sg(log pi)) (value 1; its docs cite arXiv 2506.09477), which adds the
    score-function term coef * k3_t * grad log pi_t / N; ours differentiates k3 alone. Adding
    that term, computed here from the batch, to our gradient gives the host's.
    """
    case = RECORD["cases"]["reference_kl"]
    loss_fn = nemo_rl.NeMoRLPolicyLoss(case["loss_name"], case["config"])
    batch = _batch()
    seqs, toks = _global_counts(batch)
    logits = batch["logits"].clone().requires_grad_(True)
    logprobs = _logprobs(logits, batch["input_ids"])
    loss, _ = loss_fn(_data(batch, slice(None)), seqs, toks, next_token_logprobs=logprobs)
    assert float(loss.detach()) == pytest.approx(case["loss"], abs=LOSS_ATOL)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    log_ratio = (batch["reference_policy_logprobs"][:, 1:] - logprobs).detach()
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    score = case["config"]["kl_coef"] * (k3 * logprobs * mask).sum() / toks
    (loss + score).backward()
    torch.testing.assert_close(logits.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)


def _packed_sequences(batch):
    """The recorded packed logits ``[1, N, V]`` (a float64 leaf) and, per packed sequence, what
    SequencePackingLossWrapper hands the loss: its rows of ``batch`` cut to its length, and its
    padded slice of the packed logits."""
    packing = RECORD["packing"]
    packed = torch.tensor(packing["logits"], dtype=torch.float64).requires_grad_(True)
    starts = packing["cu_seqlens_q_padded"]
    pieces = []
    for row, length in enumerate(batch["input_lengths"].tolist()):
        data = {key: (value[row:row + 1, :length] if value.dim() > 1 else value[row:row + 1])
                for key, value in _data(batch, slice(None)).items()}
        pieces.append((data, packed[:, starts[row]:starts[row + 1]]))
    return packed, pieces


@pytest.mark.parametrize("name", ["packed", "packed_fused"])
def test_packed_cases_match_recorded_host(nemo_rl, name):
    """One call per packed sequence on its padded logits slice and unpadded data (what
    SequencePackingLossWrapper does; the fused wrapper's figures must be the same)."""
    case, packing = RECORD["cases"][name], RECORD["packing"]
    loss_fn = nemo_rl.NeMoRLPolicyLoss(case["loss_name"], case["config"])
    batch = _batch()
    seqs, toks = _global_counts(batch)
    packed, pieces = _packed_sequences(batch)
    total = 0.0
    for data, piece in pieces:
        unpadded = piece[:, :data["input_ids"].shape[1]]
        loss, _ = loss_fn(data, seqs, toks, next_token_logprobs=_logprobs(unpadded, data["input_ids"]))
        total = total + loss
    total.backward()
    assert float(total.detach()) == pytest.approx(case["loss"], abs=LOSS_ATOL)
    torch.testing.assert_close(packed.grad, torch.tensor(case["grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)
    # Padding rows of the packed logits get no gradient, in the host and here.
    starts, lengths = packing["cu_seqlens_q_padded"], batch["input_lengths"].tolist()
    pad_row = starts[0] + lengths[0]
    assert not packed.grad[0, pad_row:starts[1]].any()


def _native_sspo(batch, rows, fields):
    """Our native SSPO on float64 full-vocabulary logits: (numerator, logits leaf)."""
    logits = batch["logits"][rows].clone().requires_grad_(True)
    ids = batch["input_ids"][rows]
    mask = (batch["token_mask"][rows, 1:] * batch["sample_mask"][rows, None]).bool()
    logp = torch.log_softmax(logits[:, :-1], -1)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    loss = make_policy_loss("sspo", build_policy_loss_config("sspo", fields))
    segments = segment_ids("newline", ids[:, 1:], mask, build_segment_tables(_ToyTokenizer()))
    inputs = LossInputs(logprobs=logp.gather(-1, ids[:, 1:, None])[..., 0],
                        old_logprobs=batch["prev_logprobs"][rows, 1:],
                        advantages=batch["advantages"][rows, 1], response_mask=mask,
                        segment_ids=segments, old_entropy=torch.where(mask, entropy, 0))
    numerator, _, _ = policy_loss_sums(loss, inputs)
    return numerator, logits


def test_sspo_on_exactly_grpo_train_keys_through_host_wrappers(nemo_rl):
    """The shipped recipe's SSPO on a batch with exactly the keys grpo_train builds.

    Logits path, old entropy from the on-policy logits: the recorded run inside NeMo-RL's own
    wrappers, the same call here, and our native loss on the whole batch agree.
    """
    from omegaconf import OmegaConf
    keys = RECORD["grpo_train_batch_keys"]
    assert {"input_ids", "token_mask", "sample_mask", "advantages", "prev_logprobs",
            "generation_logprobs", "input_lengths", "reference_policy_logprobs"} == set(keys)
    host = RECORD["sspo_through_host"]
    assert (host["input_type"], host["loss_type"]) == ("logit", "sequence_level")
    batch = _batch(keys)
    recipe = Path(__file__).parents[2] / "examples" / "integrations" / "nemo_rl" / "sspo_grpo.yaml"
    section = OmegaConf.to_container(OmegaConf.load(recipe).nemo_sspo)
    assert section == host["section"] and section["loss_name"] == "sspo"
    loss_fn = nemo_rl.NeMoRLPolicyLoss.from_config(section, tokenizer=_ToyTokenizer())
    seqs, toks = _global_counts(batch)
    logits = batch["logits"].clone().requires_grad_(True)
    total = sum(loss_fn(_data(batch, rows), seqs, toks, logits=logits[rows])[0]
                for rows in (slice(0, 2), slice(2, None)))
    total.backward()
    numerator, native_logits = _native_sspo(batch, slice(None), section["config"])
    (numerator / seqs).backward()
    assert float(total.detach()) == pytest.approx(float((numerator / seqs).detach()), rel=1e-12)
    torch.testing.assert_close(logits.grad, native_logits.grad, rtol=1e-9, atol=1e-12)
    assert host["loss"] == pytest.approx(float(total.detach()), abs=LOSS_ATOL)
    torch.testing.assert_close(torch.tensor(host["grad"], dtype=torch.float64), logits.grad,
                               rtol=0, atol=GRAD_ATOL)
    # Packed: SequencePackingLossWrapper handed each padded logits slice with unpadded data.
    packed, pieces = _packed_sequences(batch)
    packed_total = sum(loss_fn(data, seqs, toks, logits=piece)[0] for data, piece in pieces)
    packed_total.backward()
    assert host["packed_loss"] == pytest.approx(float(total.detach()), abs=LOSS_ATOL)
    assert float(packed_total.detach()) == pytest.approx(float(total.detach()), rel=1e-12)
    torch.testing.assert_close(packed.grad, torch.tensor(host["packed_grad"], dtype=torch.float64),
                               rtol=0, atol=GRAD_ATOL)
