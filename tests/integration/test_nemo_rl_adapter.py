"""NeMo-RL adapter called as NeMo-RL's Megatron policy worker calls a loss function.

NeMo-RL itself cannot be installed here (PyPI ``nemo-rl`` 0.0.0 is an empty placeholder; the
real package is installed from its repository with its GPU stack), so the host is represented
by what the adapter reads from it: its ``LossType`` / ``LossInputType`` enums (a two-line stand-in
module with the documented member values) and its calling convention, reproduced here: the
``BatchedDataDict`` keys and layout, global ``global_valid_seqs`` / ``global_valid_toks``
normalisers over all micro-batches and data-parallel ranks, and vocab-parallel logits with the
rank and group, over a real gloo tensor-parallel group of 2 processes. Data parallelism enters
this loss only through the global normalisers (the loss runs no data-parallel collective), so
each process plays both data-parallel ranks in turn, two micro-batches each.

Reference: our native loss on the float64 full-vocabulary logits of the whole global batch.
Tolerances: float64 on both sides, differing only in summation order: rtol 1e-9 (metrics are
float32 (sum, count) pairs: rtol 1e-6).
"""

from __future__ import annotations

import enum
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_sspo.algorithms.losses import get_policy_loss
from tests.integration import _host_batches as hb

TP, DP, MICRO = 2, 2, 2  # DP ranks are played in turn by each TP process
RTOL, ATOL = 1e-9, 1e-12
_CASES = (("sspo", {}), ("grpo", {"aggregation": "token-mean", "dual_clip_c": 3.0}))


class _LossType(enum.Enum):  # nemo_rl.algorithms.interfaces.LossType (documented values)
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LossInputType(enum.Enum):  # nemo_rl.algorithms.loss.interfaces.LossInputType (2026)
    LOGIT = "logit"
    LOGPROB = "logprob"


def _stub_modules(protocol: str) -> dict[str, types.ModuleType]:
    """sys.modules entries standing in for NeMo-RL's interface module of ``protocol``."""
    names = ["nemo_rl", "nemo_rl.algorithms"]
    leaf = "nemo_rl.algorithms.interfaces"
    if protocol == "2026":
        names.append("nemo_rl.algorithms.loss")
        leaf = "nemo_rl.algorithms.loss.interfaces"
    modules = {name: types.ModuleType(name) for name in names + [leaf]}
    modules[leaf].LossType = _LossType
    if protocol == "2026":
        modules[leaf].LossInputType = _LossInputType
    return modules


def _host_data(batch, rows) -> dict[str, torch.Tensor]:
    """NeMo-RL's micro-batch layout ([B, S] token columns, read as [:, 1:] by the loss)."""
    mask = batch["mask"][rows]
    sample_mask = torch.ones(mask.shape[0])
    if rows.start == 0:
        sample_mask[1] = 0.0  # a sample the host masks out (sample_mask = 0)
    token_mask = F.pad(mask.float(), (1, 0))
    return {
        "input_ids": batch["ids"][rows],
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": batch["advantages"][rows, None] * token_mask,
        "prev_logprobs": F.pad(batch["old_logprobs"][rows], (1, 0)),
        "generation_logprobs": F.pad(batch["old_logprobs"][rows], (1, 0)),
        "prev_entropy": F.pad(batch["old_entropy"][rows], (1, 0)),
    }


def _effective_mask(batch):
    mask = batch["mask"].clone()
    mask[1] = False  # sample_mask = 0
    return mask


def _global_counts(batch):
    mask = _effective_mask(batch)
    return torch.tensor(float((mask.sum(1) > 0).sum())), torch.tensor(float(mask.sum()))


def _worker(tp_rank, world_size):
    """One tensor-parallel rank; it plays DP rank 0 then 1, two micro-batches each, as NeMo-RL's
    worker loops over its micro-batches (returns one result per (TP, DP) rank)."""
    sys.modules.update(_stub_modules("2025"))
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss, token_logprobs_and_entropy

    tp_group = dist.group.WORLD
    batch = hb.global_batch()
    valid_seqs, valid_toks = _global_counts(batch)
    per_rank = hb.ROWS // DP
    columns = slice(tp_rank * hb.VOCAB_PADDED // TP, (tp_rank + 1) * hb.VOCAB_PADDED // TP)
    results = [{} for _ in range(DP)]
    for dp_rank, result in enumerate(results):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        for name, fields in _CASES:
            config = get_policy_loss(name).config_cls(**fields)
            loss_fn = NeMoRLPolicyLoss(name, config, tables=hb.tables(), vocab_size=hb.VOCAB)
            shard = batch["logits"][rows, :, columns].clone().requires_grad_(True)
            total, metrics = 0.0, []
            for start in range(0, per_rank, MICRO):
                micro = slice(rows.start + start, rows.start + start + MICRO)
                loss, mb_metrics = loss_fn(
                    shard[start:start + MICRO], _host_data(batch, micro), valid_seqs, valid_toks,
                    vocab_parallel_rank=tp_rank, vocab_parallel_group=tp_group,
                    context_parallel_group=None)
                total = total + loss
                metrics.append(mb_metrics)
            total.backward()
            result[name] = (float(total.detach()), shard.grad, metrics, loss_fn.loss_type.value)
        result["helper"] = token_logprobs_and_entropy(
            batch["logits"][rows, :, columns], batch["ids"][rows], vocab_parallel_rank=tp_rank,
            vocab_parallel_group=tp_group, vocab_size=hb.VOCAB)
    return results


def test_loss_matches_native_under_tp2_with_global_normalisers(run_distributed):
    by_tp = run_distributed(_worker, TP)
    results = {(tp, dp): by_tp[tp][dp] for tp in range(TP) for dp in range(DP)}
    batch = hb.global_batch()
    mask = _effective_mask(batch)
    per_rank = hb.ROWS // DP
    for name, fields in _CASES:
        config = get_policy_loss(name).config_cls(**fields)
        num, den, logits, metrics = hb.native_loss(name, config, batch, slice(None), mask)
        (num / den).backward()
        expected_type = "token_level" if fields.get("aggregation") == "token-mean" else (
            "sequence_level")
        # The sum over micro-batches and DP ranks is the global loss; TP ranks agree.
        for dp in range(DP):
            assert results[0, dp][name][0] == pytest.approx(results[1, dp][name][0], rel=RTOL)
        total = sum(results[0, dp][name][0] for dp in range(DP))
        assert total == pytest.approx((num / den).detach().item(), rel=RTOL)
        for (tp, dp), result in results.items():
            rows = slice(dp * per_rank, (dp + 1) * per_rank)
            cols = slice(tp * hb.VOCAB_PADDED // TP, (tp + 1) * hb.VOCAB_PADDED // TP)
            torch.testing.assert_close(result[name][1], logits.grad[rows, :, cols], rtol=RTOL,
                                       atol=ATOL)
            assert result[name][3] == expected_type
        # Metric pairs summed over micro-batches and DP ranks give the global metric.
        key = "policy/clipfrac_tokens"
        pairs = [m for dp in range(DP) for m in results[0, dp][name][2]]
        clipped, count = (sum(m[f"{key}/{part}"] for m in pairs) for part in ("sum", "count"))
        assert clipped / count == pytest.approx(float(metrics[key].total / metrics[key].count),
                                                rel=1e-6)
        assert 0 < clipped < count  # the inputs clip some tokens, not all
    # token_logprobs_and_entropy: NeMo-RL layout [B, S] with column 0 empty.
    ref_lp, ref_ent = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    for (_tp, dp), result in results.items():
        rows = slice(dp * per_rank, (dp + 1) * per_rank)
        logprobs, entropy = result["helper"]
        torch.testing.assert_close(logprobs[:, 1:], ref_lp[rows], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(entropy[:, 1:], ref_ent[rows], rtol=RTOL, atol=ATOL)
        assert not logprobs[:, 0].any()


@pytest.fixture
def host(monkeypatch):
    """Install a stand-in for NeMo-RL's interface module; returns the adapter module."""
    def install(protocol):
        for name, module in _stub_modules(protocol).items():
            monkeypatch.setitem(sys.modules, name, module)
        from nemo_sspo.integrations import nemo_rl
        return nemo_rl
    return install


def test_2026_protocol_with_host_logprobs(host):
    """Keyword call with next_token_logprobs, as NeMo-RL's prepare_loss_input path does."""
    nemo_rl = host("2026")
    batch = hb.global_batch(1)
    loss_fn = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB)
    assert loss_fn.input_type is _LossInputType.LOGPROB
    assert loss_fn.loss_type is _LossType.SEQUENCE_LEVEL
    valid_seqs, valid_toks = _global_counts(batch)
    logprobs, _ = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    loss, metrics = loss_fn(data=_host_data(batch, slice(0, hb.ROWS)),
                            global_valid_seqs=valid_seqs, global_valid_toks=valid_toks,
                            next_token_logprobs=logprobs)
    config = get_policy_loss("sspo").config_cls()
    num, den, _, _ = hb.native_loss("sspo", config, batch, slice(None), _effective_mask(batch))
    assert loss.detach().item() == pytest.approx((num / den).detach().item(), rel=RTOL)
    assert metrics["num_valid_samples"] == hb.ROWS - 1


def test_current_policy_entropy_source_and_errors(host):
    nemo_rl = host("2025")
    batch = hb.global_batch(2)
    data = _host_data(batch, slice(0, hb.ROWS))
    seqs, toks = _global_counts(batch)
    logits = batch["logits"]
    # On-policy (old = current): "current" entropy equals data's exact old entropy.
    _, entropy = hb.full_vocab_logprobs_entropy(logits, batch["ids"])
    data["prev_entropy"] = F.pad(entropy, (1, 0))
    from_data = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB)
    current = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB,
                                       old_entropy_source="current")
    assert float(current(logits, data, seqs, toks)[0]) == pytest.approx(
        float(from_data(logits, data, seqs, toks)[0]), rel=RTOL)
    with pytest.raises(ValueError, match="exactly one"):
        from_data(logits, data, seqs, toks, next_token_logprobs=torch.zeros(1))
    del data["prev_entropy"]
    with pytest.raises(ValueError, match="prev_entropy"):
        from_data(logits, data, seqs, toks)
    with pytest.raises(ValueError, match="old_entropy_source"):
        nemo_rl.NeMoRLPolicyLoss("sspo", old_entropy_source="rollout")
    with pytest.raises(ValueError, match="segmentation 'newline'"):
        nemo_rl.NeMoRLPolicyLoss("sspo")(logits[:2], _host_data(batch, slice(0, 2)), seqs, toks)


def test_missing_host_raises_import_error_naming_nemo_rl(monkeypatch):
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.interfaces",
                 "nemo_rl.algorithms.loss", "nemo_rl.algorithms.loss.interfaces"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss

    with pytest.raises(ImportError, match="NeMo-RL.*github.com/NVIDIA-NeMo/RL"):
        NeMoRLPolicyLoss("sspo")


def test_example_recipe_fragment_builds_the_loss(host):
    """examples/integrations/nemo_rl/sspo_grpo.yaml through NeMoRLPolicyLoss.from_config."""
    import os

    from omegaconf import OmegaConf

    nemo_rl = host("2025")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "integrations",
                        "nemo_rl", "sspo_grpo.yaml")
    recipe = OmegaConf.load(path)
    loss_fn = nemo_rl.NeMoRLPolicyLoss.from_config(recipe.nemo_sspo, tokenizer=hb.ToyTokenizer())
    assert loss_fn.loss_config == get_policy_loss("sspo").config_cls(alpha=0.0, beta=0.8, gamma=1.75)
    assert loss_fn.old_entropy_source == "current"
    # The segment tables come from the recipe's tokenizer: ToyTokenizer decodes exactly NEWLINE_IDS
    # to text containing "\n".
    assert loss_fn.tables.newline.nonzero().flatten().tolist() == sorted(hb.NEWLINE_IDS)
    # "current" is exact only with one optimizer step per rollout batch, as the fragment sets.
    assert recipe.policy.train_global_batch_size == (
        recipe.grpo.num_prompts_per_step * recipe.grpo.num_generations_per_prompt)
    with pytest.raises(ValueError, match="needs loss_name"):
        nemo_rl.NeMoRLPolicyLoss.from_config({"loss": "sspo"})
