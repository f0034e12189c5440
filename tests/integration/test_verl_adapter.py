"""verl adapter against the installed verl (install.sh pins verl 0.9.1).

(a) Peer conformance: our ``grpo`` / ``gspo`` equal verl's own registered ``vanilla`` / ``gspo``
    policy losses on the same inputs, for each of verl's aggregation modes we share, in value and
    gradient.
(b) Our ``sspo`` called through verl's call path (``get_policy_loss_fn("nemo_sspo_sspo")(...)``
    with verl's keyword arguments and ActorConfig) equals our native SSPO, also under verl's
    global-batch normalisation.
(c) The trainer/worker hooks of ``install()`` against verl's real ``ppo_loss`` and
    ``RayPPOTrainer._compute_old_log_prob`` (install.sh adds their import-time dependencies).

Tolerance: inputs are float64 and both sides compute the same expressions, except that verl's
"seq-mean-token-mean" divides each row by (L_i + 1e-8) where we divide by L_i: a relative
difference of 1e-8 / L_i < 1e-8, hence rtol 1e-7.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.losses import LossInputs, get_policy_loss, make_policy_loss, policy_loss_names
from nemo_sspo.algorithms.segmentation import build_segment_tables, segment_ids
from nemo_sspo.integrations import verl as sspo_verl

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

RTOL, ATOL = 1e-7, 1e-12
# verl's name -> ours (the Dr. GRPO constant denominator; verl's L_max is the padded width T).
MODES = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "constant-denominator",
}


@pytest.fixture(autouse=True)
def _restore_verl_globals(monkeypatch):
    """``register()`` adds to verl's module-level loss registry and ``install()`` replaces verl
    functions; each test runs on a copy of the registry and monkeypatch puts the originals back, so
    no test sees another's registrations or hooks."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.workers.utils import losses as verl_losses

    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", dict(core_algos.POLICY_LOSS_REGISTRY))
    monkeypatch.setattr(verl_losses, "ppo_loss", verl_losses.ppo_loss)
    monkeypatch.setattr(RayPPOTrainer, "_compute_old_log_prob", RayPPOTrainer._compute_old_log_prob)
    workers = sys.modules.get("verl.workers.engine_workers")
    if workers is not None:
        monkeypatch.setattr(workers, "ppo_loss", workers.ppo_loss)


class _Vocabulary:
    """A tokenizer of ``len(boundary)`` ids; id i decodes with a newline where ``boundary[i]``."""

    def __init__(self, boundary: torch.Tensor):
        self.boundary = boundary

    def __len__(self):
        return len(self.boundary)

    def decode(self, ids):
        return "x\n" if self.boundary[ids[0]] else "x"


def _newline_segments(ids, mask, boundary):
    return segment_ids("newline", ids, mask, build_segment_tables(_Vocabulary(boundary)))


def _batch(seed: int, *, noise: float, rows: int = 6, width: int = 12, vocab: int = 50):
    """verl-layout inputs: [B, T] float64, right-padded responses, token-level advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([width, 1, 5, 9, 3, width - 2][:rows])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3.0
    new = (old + noise * torch.randn(rows, width, generator=gen, dtype=torch.float64))
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    adv_tokens = adv[:, None] * mask  # verl broadcasts the outcome advantage to the tokens
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    boundary = torch.rand(vocab, generator=gen) < 0.2
    segments = _newline_segments(ids, mask, boundary)
    entropy = torch.rand(rows, width, generator=gen, dtype=torch.float64) * 0.5
    return old, new, adv, adv_tokens, mask, segments, entropy


def _actor_config(**fields) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)


def _native(name, config, new, old, adv, mask, segments, entropy, mode):
    """Our loss + aggregation, returning (loss value, d loss / d new)."""
    new = new.clone().requires_grad_(True)
    per_token = make_policy_loss(name, config)(LossInputs(
        logprobs=new, old_logprobs=old, advantages=adv, response_mask=mask, segment_ids=segments,
        old_entropy=entropy)).per_token_loss
    num, den = aggregate(per_token, mask, mode, max_response_length=mask.shape[1])
    loss = num / den
    loss.backward()
    return loss.detach(), new.grad


def _verl(fn, new, old, adv_tokens, mask, mode, config):
    new = new.clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=old, log_prob=new, advantages=adv_tokens, response_mask=mask,
                       loss_agg_mode=mode, config=config, rollout_is_weights=None)
    loss.backward()
    return loss.detach(), new.grad, metrics


@pytest.mark.parametrize("verl_mode", list(MODES))
def test_grpo_equals_verl_vanilla(verl_mode):
    old, new, adv, adv_tokens, mask, segments, entropy = _batch(0, noise=0.8)
    config = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    ref, ref_grad, _ = _verl(core_algos.get_policy_loss_fn("vanilla"), new, old, adv_tokens, mask,
                             verl_mode, config)
    ours_cls = get_policy_loss("grpo").config_cls
    ours, grad = _native("grpo", ours_cls(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0), new, old,
                         adv, mask, segments, entropy, MODES[verl_mode])
    # The inputs exercise every branch: both clips and the dual clip.
    ratio = (new - old).exp()
    assert (ratio[mask] > 1.28).any() and (ratio[mask] < 0.8).any()
    assert ((ratio > 3.0) & (adv[:, None] < 0) & mask).any()
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("verl_mode", list(MODES))
def test_gspo_equals_verl_gspo(verl_mode):
    old, new, adv, adv_tokens, mask, segments, entropy = _batch(1, noise=2e-3)
    config = _actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    ref, ref_grad, _ = _verl(core_algos.get_policy_loss_fn("gspo"), new, old, adv_tokens, mask,
                             verl_mode, config)
    ours_cls = get_policy_loss("gspo").config_cls
    ours, grad = _native("gspo", ours_cls(eps_low=3e-4, eps_high=4e-4), new, old, adv, mask,
                         segments, entropy, MODES[verl_mode])
    seq_ratio = (((new - old) * mask).sum(1) / mask.sum(1)).exp()
    clipped = (seq_ratio > 1 + 4e-4) | (seq_ratio < 1 - 3e-4)
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)


def test_register_adds_every_loss_under_its_prefixed_name():
    names = sspo_verl.register()
    assert names == sorted("nemo_sspo_" + n for n in policy_loss_names())
    for name in names:
        assert core_algos.get_policy_loss_fn(name)._nemo_sspo_loss == name[len("nemo_sspo_"):]
    assert core_algos.get_policy_loss_fn("vanilla").__module__ == core_algos.__name__


@pytest.mark.parametrize("verl_mode", ["seq-mean-token-mean", "token-mean"])
def test_sspo_through_verl_call_path_equals_native(verl_mode):
    sspo_verl.register(loss_args={"sspo": {"alpha": 0.1, "gamma": 2.2}})
    old, new, adv, adv_tokens, mask, segments, entropy = _batch(2, noise=1.0)
    config = _actor_config()
    fn = core_algos.get_policy_loss_fn("nemo_sspo_sspo")
    with sspo_verl.loss_inputs(segment_ids=segments, old_entropy=entropy):
        loss, grad, metrics = _verl(fn, new, old, adv_tokens, mask, verl_mode, config)
    sspo_cls = get_policy_loss("sspo").config_cls
    ref, ref_grad = _native("sspo", sspo_cls(alpha=0.1, gamma=2.2), new, old, adv, mask,
                            segments, entropy, verl_mode)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert 0.0 < metrics["policy/clipfrac_tokens"] < 1.0  # the inputs clip some segments
    assert isinstance(metrics["actor/ppo_kl"], float)

    # verl's global-batch normalisation: this micro-batch's share of a dp=2 global batch of 20
    # responses (seq-mean) or 100 tokens (token-mean), as verl's agg_loss defines it.
    config.global_batch_info.update(dp_size=2, global_batch_size=20, batch_num_tokens=100)
    with sspo_verl.loss_inputs(segment_ids=segments, old_entropy=entropy):
        scaled, _, _ = _verl(fn, new, old, adv_tokens, mask, verl_mode, config)
    local_count = mask.sum() if verl_mode == "token-mean" else (mask.sum(1) > 0).sum()
    global_count = 100 if verl_mode == "token-mean" else 20
    torch.testing.assert_close(scaled, ref * local_count / global_count * 2, rtol=RTOL, atol=ATOL)


def test_verl_loss_errors_are_explicit():
    sspo_verl.register()
    old, new, _, adv_tokens, mask, segments, entropy = _batch(3, noise=0.1)
    fn = core_algos.get_policy_loss_fn("nemo_sspo_sspo")
    with pytest.raises(RuntimeError, match="VERL_USE_EXTERNAL_MODULES"):
        fn(old_log_prob=old, log_prob=new, advantages=adv_tokens, response_mask=mask,
           loss_agg_mode="token-mean", config=_actor_config())
    with sspo_verl.loss_inputs(segment_ids=segments[:, :-1], old_entropy=entropy):
        with pytest.raises(ValueError, match="segment_ids has shape"):
            fn(old_log_prob=old, log_prob=new, advantages=adv_tokens, response_mask=mask,
               loss_agg_mode="token-mean", config=_actor_config())
    gae_like = adv_tokens + 0.1 * torch.arange(mask.shape[1])
    with sspo_verl.loss_inputs(segment_ids=segments, old_entropy=entropy):
        with pytest.raises(ValueError, match="one advantage per response"):
            fn(old_log_prob=old, log_prob=new, advantages=gae_like, response_mask=mask,
               loss_agg_mode="token-mean", config=_actor_config())
    with pytest.raises(ValueError, match="unknown loss"):
        sspo_verl.register(loss_args={"not_a_loss": {}})
    with pytest.raises(ValueError, match="has no field"):
        sspo_verl.register(loss_args={"sspo": {"gama": 2.2}})


def test_install_hooks_feed_verl_ppo_loss_and_trainer():
    """verl's real ppo_loss (micro-batch TensorDict) and _compute_old_log_prob, hooked."""
    from omegaconf import OmegaConf
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses as verl_losses
    from verl.workers.utils.padding import left_right_2_no_padding

    sspo_verl.install()
    assert hasattr(verl_losses.ppo_loss, "_nemo_sspo_wrapped")
    old, new, adv, adv_tokens, mask, segments, entropy = _batch(4, noise=0.5)
    old, new, adv_tokens, entropy = (t.float() for t in (old, new, adv_tokens, entropy))
    rows, width = mask.shape
    prompt = 3
    prompts = torch.randint(0, 50, (rows, prompt))
    responses = torch.randint(0, 50, (rows, width))
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], dim=1)

    # 1. Trainer hook: a stand-in worker group answers compute_log_prob as verl's actor does
    #    (no-padding nested log_probs / entropy over prompt + response tokens).
    class _WorkerGroup:
        def compute_log_prob(self, td):
            offsets = td["input_ids"].offsets()
            ent = torch.zeros(int(offsets[-1]))
            for i in range(rows):  # values at response positions, shifted by one like verl's
                start = int(offsets[i]) + prompt - 1
                ent[start:start + int(mask[i].sum())] = entropy[i, :int(mask[i].sum())]
            nested = torch.nested.nested_tensor_from_jagged(ent, offsets=offsets)
            return tu.get_tensordict({"log_probs": nested, "entropy": nested.clone()},
                                     non_tensor_dict={"metrics": {"mfu": 0.0}})

    class _Tokenizer:  # ids 7 and 11 decode with a newline
        def __len__(self):
            return 50

        def decode(self, ids):
            return "x\n" if ids[0] in (7, 11) else "x"

    trainer = object.__new__(RayPPOTrainer)
    trainer.tokenizer = _Tokenizer()
    trainer.actor_rollout_wg = _WorkerGroup()
    trainer.config = OmegaConf.create(
        {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "nemo_sspo_sspo"},
                                         "calculate_sum_pi_squared": False}}})
    input_ids = torch.cat([prompts, responses], dim=1)
    batch = DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "prompts": prompts,
        "responses": responses, "response_mask": mask.long()})
    old_batch, _ = trainer._compute_old_log_prob(batch)
    boundary = torch.zeros(50, dtype=torch.bool)
    boundary[[7, 11]] = True
    expected_segments = _newline_segments(responses, mask, boundary)
    assert torch.equal(old_batch.batch[sspo_verl.SEGMENT_IDS_KEY][mask], expected_segments[mask])
    torch.testing.assert_close(old_batch.batch[sspo_verl.OLD_ENTROPY_KEY][mask], entropy[mask])

    # 2. Worker hook: verl's ppo_loss on a padded micro-batch with our two columns.
    td = tu.get_tensordict({
        "input_ids": input_ids, "attention_mask": attention, "prompts": prompts,
        "responses": responses, "response_mask": mask.long(),
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "old_log_probs": old,
        "advantages": adv_tokens, sspo_verl.SEGMENT_IDS_KEY: expected_segments,
        sspo_verl.OLD_ENTROPY_KEY: entropy,
    })
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    flat_new = torch.cat([torch.cat([torch.zeros(prompt - 1), new[i, :int(mask[i].sum())],
                                     torch.zeros(1)]) for i in range(rows)])
    flat_new.requires_grad_(True)
    config = _actor_config(loss_agg_mode="seq-mean-token-mean",
                           policy_loss=PolicyLossConfig(loss_mode="nemo_sspo_sspo"))
    loss, metrics = verl_losses.ppo_loss(config, {"log_probs": flat_new}, td)
    ref, _ = _native("sspo", get_policy_loss("sspo").config_cls(), new.double(), old.double(), adv.double(),
                     mask, expected_segments, entropy.double(), "seq-mean-token-mean")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)  # float32 here
    assert "actor/pg_loss" in metrics


def _example_config():
    """examples/integrations/verl/sspo_grpo.yaml composed on verl's own Hydra config."""
    from hydra import compose, initialize_config_dir

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "integrations",
                           "verl")
    with initialize_config_dir(config_dir=os.path.abspath(example), version_base=None):
        return compose(config_name="sspo_grpo", overrides=["actor_rollout_ref.model.path=/m"])


def test_example_config_composes_with_verl_trainer_config(monkeypatch):
    """examples/integrations/verl/sspo_grpo.yaml on verl's own Hydra config and ActorConfig."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _example_config()
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == "nemo_sspo.integrations.verl_plugin"
    monkeypatch.setenv(sspo_verl.LOSS_ARGS_ENV, env[sspo_verl.LOSS_ARGS_ENV])
    sspo_verl.register(sspo_verl.loss_args_from_env())
    assert core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)._nemo_sspo_loss == "sspo"
    assert sspo_verl._loss_for("sspo").config.gamma == 1.75
    assert actor.loss_agg_mode == "seq-mean-token-mean" and cfg.algorithm.adv_estimator == "grpo"
    monkeypatch.setenv(sspo_verl.LOSS_ARGS_ENV, "{sspo: 1}")
    with pytest.raises(ValueError, match="not valid JSON"):
        sspo_verl.loss_args_from_env()


def test_example_makes_the_native_recipes_optimizer_steps_per_rollout():
    """The verl example against conf/sspo_qwen2.5_math_1.5b.yaml, both composed. verl's trainer
    (RayPPOTrainer's actor update) splits a rollout of data.train_batch_size x rollout.n responses
    into mini-batches of ppo_mini_batch_size x rollout.n, ppo_epochs times: train_batch_size /
    ppo_mini_batch_size x ppo_epochs optimizer steps. Ours: trainer.minibatches_per_step steps over
    prompts_per_step x samples_per_prompt responses."""
    from nemo_sspo.cli import load_config

    cfg = _example_config()
    native = load_config("sspo_qwen2.5_math_1.5b", command="eval")
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    assert cfg.data.train_batch_size % actor.ppo_mini_batch_size == 0
    verl_steps = cfg.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs
    assert verl_steps == native.trainer.minibatches_per_step == 4
    assert (cfg.data.train_batch_size * n, actor.ppo_mini_batch_size * n) == (
        native.rollout.prompts_per_step * native.rollout.samples_per_prompt,
        native.rollout.prompts_per_step * native.rollout.samples_per_prompt // native.trainer.minibatches_per_step,
    ) == (1024, 256)
    assert (actor.optim.lr, actor.optim.weight_decay, actor.grad_clip) == (
        native.optim.lr, native.optim.weight_decay, native.optim.clip_grad)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.data.max_response_length) == (
        native.trainer.max_steps, native.eval.every_n_steps, native.rollout.sampling.max_new_tokens)
    reward = cfg.reward.custom_reward_function
    assert (reward.path, reward.name) == ("pkg://nemo_sspo.rewards.verl_score", "compute_score")
    assert (reward.reward_kwargs.num_workers, reward.reward_kwargs.timeout_s) == (
        native.reward.options.num_workers, native.reward.options.timeout_s)
    # the files `nemo-sspo data prepare --format parquet` writes (tests/unit/data/test_data_prepare_parquet.py)
    assert (os.path.basename(cfg.data.train_files), os.path.basename(cfg.data.val_files)) == (
        "math_train_l3to5.parquet", "math500.parquet")
