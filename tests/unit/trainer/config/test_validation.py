"""``validate`` reports every problem of a config in one error (section problems, then rules), and
skips a rule whose inputs an earlier problem leaves unknown."""

import pytest

from nemo_sspo.trainer.config import TrainConfig, validate


def test_three_independent_mistakes_in_three_sections_and_a_rule_are_reported_together():
    cfg = TrainConfig()
    cfg.optim.clip_grad = -1.0
    cfg.trainer.max_steps = 0
    cfg.eval.batch_size = 0
    cfg.parallel.max_tokens_per_micro_batch = 10  # below rollout.sampling.max_new_tokens = 64: a cross-section rule
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value) == (
        "4 config problems:\n"
        "  1. optim.clip_grad must be >= 0 (0 disables clipping)\n"
        "  2. trainer.max_steps must be >= 1\n"
        "  3. eval.batch_size must be >= 1\n"
        "  4. parallel.max_tokens_per_micro_batch=10 must exceed rollout.sampling.max_new_tokens=64: a micro-batch "
        "holds at least one whole prompt + response")


def test_a_single_problem_is_the_message_alone():
    cfg = TrainConfig()
    cfg.eval.batch_size = 0
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value) == "eval.batch_size must be >= 1"


def test_rules_that_need_the_data_parallel_size_are_skipped_when_the_world_does_not_split():
    cfg = TrainConfig()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.rollout.prompts_per_step = 3  # would not divide any data-parallel size > 1, nor split into units
    with pytest.raises(ValueError) as err:
        validate(cfg, world_size=3)
    assert str(err.value) == ("world size 3 is not divisible by parallel.tensor_model_parallel_size x "
                              "parallel.pipeline_model_parallel_size = 2; change one of them or --nproc-per-node")


def test_an_invalid_layout_size_skips_the_world_rule_instead_of_dividing_by_zero():
    cfg = TrainConfig()
    cfg.parallel.pipeline_model_parallel_size = 0
    with pytest.raises(ValueError) as err:
        validate(cfg, world_size=2)
    assert str(err.value) == ("parallel.tensor_model_parallel_size and parallel.pipeline_model_parallel_size "
                              "must be >= 1")
