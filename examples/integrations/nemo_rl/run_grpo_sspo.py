r"""NeMo-RL's GRPO with a nemo_sspo loss (SSPO by default).

NeMo-RL's own launcher steps, with the loss object swapped between ``setup()`` and
``grpo_train()``.

Run it inside a NeMo-RL checkout's environment with nemo_sspo importable (``pip install
--no-deps -e /path/to/nemo_sspo``):

    uv run python /path/to/nemo_sspo/examples/integrations/nemo_rl/run_grpo_sspo.py \
        --config examples/configs/grpo_math_1B.yaml \
        --overrides /path/to/nemo_sspo/examples/integrations/nemo_rl/sspo_grpo.yaml [key=value ...]

Written against NeMo-RL 7ea279a (``examples/run_grpo.py`` there, synchronous trainer). Not run
here: a NeMo-RL run needs Ray, vLLM and GPUs (docs/integrations.md says what was checked).
"""

import argparse

from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup, shutdown_environments
from nemo_rl.algorithms.utils import get_tokenizer
from nemo_rl.data.utils import setup_response_data
from nemo_rl.distributed.virtual_cluster import init_ray
from nemo_rl.models.generation import configure_generation_config
from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
from nemo_rl.utils.logger import get_next_experiment_dir
from omegaconf import OmegaConf

from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss, prepare_master_config


def load_master_config() -> MasterConfig:
    """NeMo-RL recipe + our overrides file + command-line ``key=value`` overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="NeMo-RL GRPO recipe")
    parser.add_argument("--overrides", required=True, help="sspo_grpo.yaml")
    args, cli = parser.parse_known_args()
    register_omegaconf_resolvers()
    config = OmegaConf.merge(load_config(args.config), OmegaConf.load(args.overrides))
    if cli:
        config = parse_hydra_overrides(config, cli)
    master_config = MasterConfig(**OmegaConf.to_container(config, resolve=True))
    async_grpo = master_config.grpo.async_grpo
    if (async_grpo is not None and async_grpo.enabled) or (
            (master_config.data_plane or {}).get("enabled")):
        raise ValueError("this launcher runs NeMo-RL's synchronous grpo_train only: set "
                         "grpo.async_grpo.enabled=false and data_plane.enabled=false")
    return master_config


def main() -> None:
    """Load the config, prepare it for the nemo_sspo loss, set up, swap the loss, train."""
    master_config = load_master_config()
    section = prepare_master_config(master_config)  # before setup(): reference-KL switch
    master_config.logger["log_dir"] = get_next_experiment_dir(master_config.logger["log_dir"])
    init_ray()
    tokenizer = get_tokenizer(master_config.policy["tokenizer"])
    master_config.policy["generation"] = configure_generation_config(
        master_config.policy["generation"], tokenizer)
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, master_config.data, master_config.env)
    (policy, policy_generation, _, _, dataloader, val_dataloader, _, logger, checkpointer,
     grpo_state, master_config, _, _) = setup(master_config, tokenizer, dataset, val_dataset)
    megatron_cfg = master_config.policy.get("megatron_cfg") or {}
    loss_fn = NeMoRLPolicyLoss.from_config(
        section, tokenizer=tokenizer, use_fused_linear_logprobs=bool(
            megatron_cfg.get("enabled") and megatron_cfg.get("use_fused_linear_logprobs")))
    try:
        with checkpointer:
            grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn,
                       task_to_env, val_task_to_env, logger, checkpointer, grpo_state,
                       master_config)
    finally:
        shutdown_environments(task_to_env, val_task_to_env)
        policy_generation.shutdown()


if __name__ == "__main__":
    main()
