"""NeMoRLPolicyLoss called as NeMo-RL's policy worker calls a loss of today's protocol.

The recorded-host figures are in test_nemo_rl_recorded.py; this file covers what those figures do
not: the logits path under Megatron tensor parallelism 2 (NeMo-RL passes no group to a loss, so
the adapter reads Megatron's ``parallel_state``; real gloo processes), packed logits longer than
the unpadded data, the stored-entropy extension, the reference-KL term, the split-API trainer's
metric rescaling, the master-config preparation the launcher runs, and the errors. NeMo-RL's
interface module is a stand-in with its enum values (as recorded from it).

Reference: our native loss on the float64 full-vocabulary logits of the whole global batch;
float64 on both sides, summation order only: rtol 1e-9.
"""

from __future__ import annotations

import ast
import enum
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nemo_sspo.algorithms.losses import get_policy_loss
from tests.integration import _host_batches as hb

TP, DP, MICRO = 2, 2, 2  # DP ranks are played in turn by each TP process
RTOL, ATOL = 1e-9, 1e-12
_EXAMPLE = Path(__file__).parents[2] / "examples" / "integrations" / "nemo_rl"
_ENUMS = {"LossType": {"TOKEN_LEVEL": "token_level", "SEQUENCE_LEVEL": "sequence_level"},
          "LossInputType": {"LOGIT": "logit", "LOGPROB": "logprob"},
          "MetricNormalizer": {"TOKENS": "tokens", "SEQUENCES": "sequences", "NONE": "none"}}


def _install_stand_in(setitem) -> None:
    names = ["nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss",
             "nemo_rl.algorithms.loss.interfaces"]
    modules = {name: types.ModuleType(name) for name in names}
    for name, members in _ENUMS.items():
        setattr(modules[names[-1]], name, enum.Enum(name, members))
    for name, module in modules.items():
        setitem(name, module)


def _host_data(batch, rows, *, entropy_key=True) -> dict[str, torch.Tensor]:
    """grpo_train's batch layout ([B, S] columns, read as [:, 1:] by the loss)."""
    mask = batch["mask"][rows]
    sample_mask = torch.ones(mask.shape[0])
    if rows.start in (0, None):
        sample_mask[1] = 0.0  # a sample the host masks out (sample_mask = 0)
    token_mask = F.pad(mask.float(), (1, 0))
    data = {
        "input_ids": batch["ids"][rows],
        "input_lengths": torch.full((mask.shape[0],), hb.LENGTH),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": batch["advantages"][rows, None].expand(-1, hb.LENGTH).clone(),
        "prev_logprobs": F.pad(batch["old_logprobs"][rows], (1, 0)),
        "generation_logprobs": F.pad(batch["old_logprobs"][rows], (1, 0)),
        "reference_policy_logprobs": torch.zeros(mask.shape[0], hb.LENGTH),
    }
    if entropy_key:
        data["prev_entropy"] = F.pad(batch["old_entropy"][rows], (1, 0))
    return data


def _effective_mask(batch):
    mask = batch["mask"].clone()
    mask[1] = False  # sample_mask = 0
    return mask


def _global_counts(batch):
    mask = _effective_mask(batch)
    return torch.tensor(float((mask.sum(1) > 0).sum())), torch.tensor(float(mask.sum()))


def _on_policy(batch):
    """The batch with old_entropy = the entropy of its own logits (what "current" reads)."""
    _, entropy = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    return dict(batch, old_entropy=torch.where(batch["mask"], entropy, 0))


def _worker(tp_rank, world_size):
    """One TP rank under Megatron's parallel_state, playing DP rank 0 then 1.

    Two micro-batches each; SSPO takes the logits path (the last micro-batch's logits carry 2
    padding positions, as a packed host hands them), GRPO the log-prob path. Last, SSPO on a
    DTensor sharded over the vocabulary (the DTensor worker's logits).
    """
    from megatron.core import parallel_state

    from nemo_sspo.megatron.parallel_setup import initialize_parallel

    _install_stand_in(sys.modules.__setitem__)
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss

    initialize_parallel(tp_size=TP, pp_size=1, seed=0)
    assert parallel_state.get_tensor_model_parallel_rank() == tp_rank
    batch = hb.global_batch()
    valid_seqs, valid_toks = _global_counts(batch)
    per_rank = hb.ROWS // DP
    columns = slice(tp_rank * hb.VOCAB_PADDED // TP, (tp_rank + 1) * hb.VOCAB_PADDED // TP)
    sspo = NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB)
    grpo = NeMoRLPolicyLoss("grpo", {"aggregation": "token-mean", "dual_clip_c": 3.0})
    results = []
    for dp_rank in range(DP):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        shard = batch["logits"][rows, :, columns].clone().requires_grad_(True)
        full = batch["logits"][rows].clone().requires_grad_(True)
        sspo_total = grpo_total = 0.0
        for start in range(0, per_rank, MICRO):
            micro = slice(rows.start + start, rows.start + start + MICRO)
            data = _host_data(batch, micro, entropy_key=False)
            logits = shard[start:start + MICRO]
            if start + MICRO == per_rank:
                logits = torch.cat([logits, torch.full_like(logits[:, :2], 50.0)], dim=1)
            sspo_total = sspo_total + sspo(data, valid_seqs, valid_toks, logits=logits)[0]
            logprobs, _ = hb.full_vocab_logprobs_entropy(full[start:start + MICRO], data["input_ids"])
            grpo_total = grpo_total + grpo(data, valid_seqs, valid_toks,
                                           next_token_logprobs=logprobs)[0]
        (sspo_total + grpo_total).backward()
        results.append({"sspo": (float(sspo_total.detach()), shard.grad),
                        "grpo": (float(grpo_total.detach()), full.grad)})
    # DTensor worker: logits sharded over the vocabulary on a device mesh, no Megatron group.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    local = batch["logits"][:MICRO, :, columns].clone().requires_grad_(True)
    logits = DTensor.from_local(local, init_device_mesh("cpu", (TP,)), [Shard(2)])
    loss, _ = sspo(_host_data(batch, slice(0, MICRO), entropy_key=False), valid_seqs, valid_toks,
                   logits=logits)
    loss.backward()
    results.append({"dtensor": (float(loss.detach()), local.grad)})
    return results


def test_logits_path_under_megatron_tp2_and_logprob_path(run_distributed):
    by_tp = run_distributed(_worker, TP)
    batch = hb.global_batch()
    mask = _effective_mask(batch)
    per_rank = hb.ROWS // DP
    seqs, _ = _global_counts(batch)
    config = get_policy_loss("sspo").config_cls()
    num, _, logits, _ = hb.native_loss("sspo", config, _on_policy(batch), slice(0, MICRO),
                                       mask[:MICRO])
    (num / seqs).backward()
    for tp in range(TP):  # the DTensor worker's vocabulary shards
        loss, grad = by_tp[tp][DP]["dtensor"]
        assert loss == pytest.approx(float((num / seqs).detach()), rel=RTOL)
        cols = slice(tp * hb.VOCAB_PADDED // TP, (tp + 1) * hb.VOCAB_PADDED // TP)
        torch.testing.assert_close(grad, logits.grad[:, :, cols], rtol=RTOL, atol=ATOL)
    for name, fields, source in (("sspo", {}, _on_policy(batch)),
                                 ("grpo", {"aggregation": "token-mean", "dual_clip_c": 3.0},
                                  batch)):
        config = get_policy_loss(name).config_cls(**fields)
        num, den, logits, _ = hb.native_loss(name, config, source, slice(None), mask)
        (num / den).backward()
        total = sum(by_tp[0][dp][name][0] for dp in range(DP))
        assert total == pytest.approx(float((num / den).detach()), rel=RTOL)
        for tp in range(TP):
            for dp in range(DP):
                rows = slice(dp * per_rank, (dp + 1) * per_rank)
                cols = (slice(tp * hb.VOCAB_PADDED // TP, (tp + 1) * hb.VOCAB_PADDED // TP)
                        if name == "sspo" else slice(None))
                assert by_tp[tp][dp][name][0] == pytest.approx(by_tp[0][dp][name][0], rel=RTOL)
                torch.testing.assert_close(by_tp[tp][dp][name][1], logits.grad[rows, :, cols],
                                           rtol=RTOL, atol=ATOL)


@pytest.fixture
def nemo_rl(monkeypatch):
    """The adapter module with NeMo-RL's interface stand-in installed."""
    _install_stand_in(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    from nemo_sspo.integrations import nemo_rl
    return nemo_rl


def test_input_type_follows_the_loss(nemo_rl):
    """LOGIT only where the entropy comes from the logits; the fused-linear path gives none."""
    types_ = {(name, source): nemo_rl.NeMoRLPolicyLoss(name, tables=hb.tables(),
                                                       old_entropy_source=source).input_type.value
              for name in ("sspo", "grpo", "gspo", "cispo") for source in ("current", "batch")}
    assert types_ == {("sspo", "current"): "logit", ("sspo", "batch"): "logprob",
                      **{(n, s): "logprob" for n in ("grpo", "gspo", "cispo")
                         for s in ("current", "batch")}}
    assert nemo_rl.NeMoRLPolicyLoss("grpo", use_fused_linear_logprobs=True).use_fused_linear_logprobs
    with pytest.raises(ValueError, match="use_fused_linear_logprobs=false"):
        nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), use_fused_linear_logprobs=True)


def test_stored_entropy_extension_equals_current_on_policy(nemo_rl):
    """"batch" reads prev_entropy (as token_logprobs_and_entropy stores it); on-policy it equals
    "current"."""
    batch = hb.global_batch(2)
    seqs, toks = _global_counts(batch)
    data = _host_data(batch, slice(0, hb.ROWS))
    logprobs, entropy = nemo_rl.token_logprobs_and_entropy(
        batch["logits"], batch["ids"], vocab_parallel_rank=None, vocab_parallel_group=None,
        vocab_size=hb.VOCAB)
    data["prev_entropy"] = entropy
    stored = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB,
                                      old_entropy_source="batch")
    current = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), vocab_size=hb.VOCAB)
    from_batch, _ = stored(data, seqs, toks, next_token_logprobs=logprobs[:, 1:])
    from_logits, _ = current(data, seqs, toks, logits=batch["logits"])
    assert float(from_batch) == pytest.approx(float(from_logits), rel=RTOL)
    assert not logprobs[:, 0].any() and not entropy[:, 0].any()  # column 0 empty, as prev_logprobs


def test_reference_kl_reads_reference_policy_logprobs(nemo_rl):
    """kl_coef > 0: with log pi_ref = log pi_theta - 0.1 at every valid token, k3 per token is
    exp(-0.1) - 1 + 0.1 = 0.0048374180, so the token-mean loss rises by kl_coef times that."""
    batch = hb.global_batch(3)
    seqs, toks = _global_counts(batch)
    data = _host_data(batch, slice(0, hb.ROWS))
    logprobs, _ = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    data["reference_policy_logprobs"] = F.pad(logprobs - 0.1, (1, 0))
    plain = nemo_rl.NeMoRLPolicyLoss("grpo", {"aggregation": "token-mean"})
    with_kl = nemo_rl.NeMoRLPolicyLoss("grpo", {"aggregation": "token-mean", "kl_coef": 0.5})
    difference = (float(with_kl(data, seqs, toks, next_token_logprobs=logprobs)[0])
                  - float(plain(data, seqs, toks, next_token_logprobs=logprobs)[0]))
    assert difference == pytest.approx(0.5 * (math.exp(-0.1) - 1 + 0.1), rel=1e-9)
    del data["reference_policy_logprobs"]
    with pytest.raises(ValueError, match="'reference_policy_logprobs'.*reference_policy_kl_penalty"):
        with_kl(data, seqs, toks, next_token_logprobs=logprobs)


def test_split_api_rescaling_with_metric_normalizations(nemo_rl):
    """NeMo-RL's split-API trainer calls every micro-batch with global_valid_* = 1 and rescales
    each metric by its advertised normaliser (unadvertised: the loss_type one). Regression: the
    adapter advertised nothing, so num_valid_samples (7 here) came back divided by the 7
    valid sequences."""
    batch = hb.global_batch(4)
    seqs, toks = _global_counts(batch)
    data = _host_data(batch, slice(0, hb.ROWS))
    logprobs, _ = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    loss_fn = nemo_rl.NeMoRLPolicyLoss("grpo")  # seq-mean-token-mean: SEQUENCE_LEVEL
    synced, synced_metrics = loss_fn(data, seqs, toks, next_token_logprobs=logprobs)
    _, raw = loss_fn(data, torch.tensor(1.0), torch.tensor(1.0), next_token_logprobs=logprobs)
    scale = {"tokens": 1 / float(toks), "sequences": 1 / float(seqs), "none": 1.0}
    normalizations = loss_fn.metric_normalizations
    rescaled = {key: value * scale[(normalizations.get(key) or
                                    nemo_rl._host_interfaces()[2].SEQUENCES).value]
                for key, value in raw.items()}
    assert rescaled["loss"] == pytest.approx(float(synced), rel=RTOL)
    assert rescaled["num_valid_samples"] == synced_metrics["num_valid_samples"] == hb.ROWS - 1
    key = "policy/clipfrac_tokens"
    assert rescaled[f"{key}/sum"] / rescaled[f"{key}/count"] == pytest.approx(
        synced_metrics[f"{key}/sum"] / synced_metrics[f"{key}/count"], rel=RTOL)


def test_batch_and_input_errors_name_the_fix(nemo_rl):
    batch = hb.global_batch(5)
    seqs, toks = _global_counts(batch)
    data = _host_data(batch, slice(0, hb.ROWS))
    sspo = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables())
    with pytest.raises(ValueError, match="input_type is .*LOGIT.*pass logits="):
        sspo(data, seqs, toks, next_token_logprobs=torch.zeros(hb.ROWS, hb.LENGTH - 1))
    del data["prev_logprobs"], data["advantages"]
    with pytest.raises(ValueError, match=r"lacks 'advantages' \(produced by grpo_train's "
                                         r"advantage estimator.*'prev_logprobs' \(produced by "
                                         r"policy.get_logprobs"):
        sspo(data, seqs, toks, logits=batch["logits"])
    stored = nemo_rl.NeMoRLPolicyLoss("sspo", tables=hb.tables(), old_entropy_source="batch")
    data = _host_data(batch, slice(0, hb.ROWS), entropy_key=False)
    with pytest.raises(ValueError, match="'prev_entropy' \\(produced by nothing in NeMo-RL"):
        stored(data, seqs, toks, next_token_logprobs=torch.zeros(hb.ROWS, hb.LENGTH - 1))
    with pytest.raises(ValueError, match="old_entropy_source"):
        nemo_rl.NeMoRLPolicyLoss("sspo", old_entropy_source="data")


class _MasterConfig:
    """NeMo-RL's MasterConfig as the launcher sees it: attribute access only (a pydantic model;
    ``master_config["nemo_sspo"]`` raises TypeError), dict-valued policy, model-valued
    grpo/loss_fn."""

    def __init__(self, section, **policy):
        self.nemo_sspo = section
        self.policy = {"train_global_batch_size": 32, "generation": {
            "max_new_tokens": 512, "top_k": None, "top_p": 1.0},
            "sequence_packing": {"enabled": True, "fuse_loss": False}, **policy}
        self.grpo = types.SimpleNamespace(num_prompts_per_step=4, num_generations_per_prompt=8,
                                          skip_reference_policy_logprobs_calculation=False)
        self.loss_fn = types.SimpleNamespace(reference_policy_kl_penalty=0.01,
                                             force_on_policy_ratio=False)

    def __getitem__(self, key):
        raise TypeError("'MasterConfig' object is not subscriptable")


def test_prepare_master_config_turns_reference_kl_off_unless_asked(nemo_rl):
    config = _MasterConfig({"loss_name": "sspo"})
    section = nemo_rl.prepare_master_config(config)
    assert section == {"loss_name": "sspo", "max_response_length": 512}
    assert config.loss_fn.reference_policy_kl_penalty == 0.0
    assert config.grpo.skip_reference_policy_logprobs_calculation is True
    asked = _MasterConfig({"loss_name": "grpo", "config": {"kl_coef": 0.02}})
    nemo_rl.prepare_master_config(asked)
    assert asked.loss_fn.reference_policy_kl_penalty == 0.02
    assert asked.grpo.skip_reference_policy_logprobs_calculation is False


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c.loss_fn, "force_on_policy_ratio", True), "force_on_policy_ratio=false"),
    (lambda c: c.policy.update(train_global_batch_size=16), "train_global_batch_size=32"),
    (lambda c: c.policy["sequence_packing"].update(fuse_loss=True), "fuse_loss"),
    (lambda c: c.policy["generation"].update(top_p=0.9), "top_p=1.0"),
    (lambda c: setattr(c, "nemo_sspo", None), "master_config.nemo_sspo must be a mapping"),
])
def test_prepare_master_config_refuses_wrong_batches(nemo_rl, change, match):
    config = _MasterConfig({"loss_name": "sspo"})
    change(config)
    with pytest.raises(ValueError, match=match):
        nemo_rl.prepare_master_config(config)


def test_example_recipe_and_launcher(nemo_rl):
    """The shipped YAML passes prepare_master_config and builds SSPO; the launcher swaps the loss
    between setup() and the trainer."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.to_container(OmegaConf.load(_EXAMPLE / "sspo_grpo.yaml"))
    config = _MasterConfig(recipe["nemo_sspo"], **recipe["policy"])
    config.grpo.num_prompts_per_step = recipe["grpo"]["num_prompts_per_step"]
    config.grpo.num_generations_per_prompt = recipe["grpo"]["num_generations_per_prompt"]
    section = nemo_rl.prepare_master_config(config)
    loss_fn = nemo_rl.NeMoRLPolicyLoss.from_config(section, tokenizer=hb.ToyTokenizer())
    assert loss_fn.loss_config == get_policy_loss("sspo").config_cls(alpha=0.0, beta=0.8,
                                                                     gamma=1.75)
    assert loss_fn.input_type.value == "logit" and loss_fn.old_entropy_source == "current"
    assert loss_fn.tables.newline.nonzero().flatten().tolist() == sorted(hb.NEWLINE_IDS)
    assert recipe["loss_fn"]["reference_policy_kl_penalty"] == 0
    tree = ast.parse((_EXAMPLE / "run_grpo_sspo.py").read_text())
    main = next(node for node in tree.body if getattr(node, "name", None) == "main")
    calls = [ast.unparse(node.func) for node in ast.walk(main) if isinstance(node, ast.Call)]
    order = [calls.index(name) for name in ("prepare_master_config", "setup",
                                            "NeMoRLPolicyLoss.from_config", "grpo_train")]
    assert order == sorted(order)  # ast.walk is breadth-first: same nesting level here
    with pytest.raises(ValueError, match="needs loss_name"):
        nemo_rl.NeMoRLPolicyLoss.from_config({"loss": "sspo"})


def test_missing_host_raises_import_error_naming_nemo_rl(monkeypatch):
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss",
                 "nemo_rl.algorithms.loss.interfaces"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss

    with pytest.raises(ImportError, match="NeMo-RL.*github.com/NVIDIA-NeMo/RL"):
        NeMoRLPolicyLoss("sspo")


def test_old_host_without_metric_normalizer_is_refused(monkeypatch):
    _install_stand_in(lambda name, module: monkeypatch.setitem(sys.modules, name, module))
    monkeypatch.delattr(sys.modules["nemo_rl.algorithms.loss.interfaces"], "MetricNormalizer")
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss

    with pytest.raises(ImportError, match=r"lacks \['MetricNormalizer'\].*7ea279a"):
        NeMoRLPolicyLoss("grpo")

