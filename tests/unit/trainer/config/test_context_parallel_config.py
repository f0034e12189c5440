"""``parallel.context_parallel_size``: its range, the world-size rule dp = world / (TP x PP x CP),
the settings CP does not carry (each refusal names both keys), and the host check (CPU: refused,
naming the keys and where the loss side is tested)."""

from __future__ import annotations

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.trainer.config import validate
from nemo_sspo.trainer.device import check_host

TE = "model.transformer_impl=transformer_engine"


def _cfg(*overrides):
    return load_config(overrides=["parallel.context_parallel_size=2", TE, *overrides], command="eval")


def test_cp_counts_in_the_model_parallel_size():
    cfg = _cfg()
    validate(cfg, world_size=2)  # dp = 2 / (1 x 1 x 2) = 1
    cfg = _cfg("rollout.prompts_per_step=4", "parallel.tensor_model_parallel_size=2")
    validate(cfg, world_size=8)  # dp = 8 / (2 x 1 x 2) = 2 divides the 4 prompts
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tensor_model_parallel_size x "
                                         r"parallel.pipeline_model_parallel_size x parallel.context_parallel_size = 4"):
        validate(cfg, world_size=6)


@pytest.mark.parametrize("value", [0, -1])
def test_cp_below_one_is_refused(value):
    with pytest.raises(ValueError, match=f"parallel.context_parallel_size={value} must be an integer >= 1"):
        load_config(overrides=[f"parallel.context_parallel_size={value}"], command="eval")


@pytest.mark.parametrize("overrides, fragment", [
    (["model.transformer_impl=local"], "needs the TransformerEngine layer spec .* model.transformer_impl='local'"),
    (["parallel.pack_sequences=true", "parallel.max_tokens_per_micro_batch=600"],
     "with parallel.pack_sequences=true is not supported: packed .*thd_get_partitioned_indices"),
    (["model.router_aux_loss_coef=0.001"], "model.router_aux_loss_coef=0.001"),
    (["loss=sppo", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=8"], "loss 'sppo': its critic"),
])
def test_settings_cp_does_not_carry_are_refused(overrides, fragment):
    keys = ["parallel.context_parallel_size=2", *([] if "model.transformer_impl=local" in overrides else [TE]),
            *overrides]
    with pytest.raises(ValueError, match=f"parallel.context_parallel_size=2 .*{fragment}"):
        load_config(overrides=keys, command="eval")


def test_cpu_host_refuses_cp_naming_the_keys_and_the_cpu_tests(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = load_config(overrides=["parallel.context_parallel_size=2"], command="eval")  # transformer_impl auto
    with pytest.raises(ValueError, match=r"parallel.context_parallel_size=2 needs TransformerEngine's attention .*"
                                         r"model.transformer_impl='auto' resolves to the local spec on this host "
                                         r"\(no CUDA device\).*loss side of context parallelism is tested on CPU"):
        check_host(cfg)
