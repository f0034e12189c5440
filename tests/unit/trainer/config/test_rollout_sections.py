"""The ``rollout`` section's sub-sections (``sampling``, ``engine``, ``refit``, ``correction``,
``schedule``) each check their own invariants, naming the full key path; the section checks those
across them."""

import pytest

from nemo_sspo.trainer.config import (
    CorrectionConfig,
    EngineConfig,
    RefitConfig,
    RolloutConfig,
    SamplingConfig,
    ScheduleConfig,
)
from nemo_sspo.rollout import VLLMOptions

VLLM = EngineConfig(backend="vllm", options=VLLMOptions())


@pytest.mark.parametrize("rollout, message", [
    (RolloutConfig(sampling=SamplingConfig(max_new_tokens=0)), "rollout.sampling.max_new_tokens must be >= 1"),
    (RolloutConfig(sampling=SamplingConfig(temperature=0.0)), "rollout.sampling.temperature must be a finite number > 0"),
    (RolloutConfig(sampling=SamplingConfig(top_p=0.0), correction=CorrectionConfig(name="token_tis")),
     "rollout.sampling.top_p must be in (0, 1]"),
    (RolloutConfig(sampling=SamplingConfig(max_sampling_rounds=0)), "rollout.sampling.max_sampling_rounds must be >= 1"),
    (RolloutConfig(engine=EngineConfig(backend="nope")), "rollout.engine.backend='nope' is not a registered rollout engine"),
    (RolloutConfig(engine=EngineConfig(backend="vllm", options=VLLMOptions(tensor_parallel_size=0))),
     "rollout.engine.options.tensor_parallel_size must be >= 1"),
    (RolloutConfig(refit=RefitConfig(bucket_mb=0)), "rollout.refit.bucket_mb=0 must be > 0"),
    (RolloutConfig(correction=CorrectionConfig(cap=0.5)), "rollout.correction.cap=0.5 must be >= 1"),
    (RolloutConfig(correction=CorrectionConfig(low=2.0, high=1.0)),
     "rollout.correction.low=2.0 and rollout.correction.high=1.0 must satisfy 0 <= low < high"),
    (RolloutConfig(schedule=ScheduleConfig(max_staleness=-1), correction=CorrectionConfig(name="token_tis")),
     "rollout.schedule.max_staleness=-1 must be >= 0"),
    (RolloutConfig(schedule=ScheduleConfig(mode="free")), "rollout.schedule.mode=free needs rollout.schedule.placement=separate"),
    (RolloutConfig(schedule=ScheduleConfig(stale_policy="drop")), "rollout.schedule.stale_policy='drop' needs rollout.schedule.mode=free"),
    (RolloutConfig(schedule=ScheduleConfig(placement="separate", num_ranks=1, peer_timeout_s=0.0)),
     "rollout.schedule.peer_timeout_s=0.0 must be > 0"),
    # across sub-sections
    (RolloutConfig(samples_per_prompt=1, sampling=SamplingConfig(dynamic_sampling=True)),
     "rollout.sampling.dynamic_sampling=true needs rollout.samples_per_prompt >= 2"),
    (RolloutConfig(refit=RefitConfig(verify=True), engine=VLLM),
     "rollout.refit.verify=true cannot read vLLM's weights back"),
    (RolloutConfig(sampling=SamplingConfig(top_p=0.9)), "rollout.sampling.top_p=0.9 samples from a renormalised nucleus"),
    (RolloutConfig(schedule=ScheduleConfig(max_staleness=1)),
     "rollout.schedule.max_staleness=1 trains on samples from older weights than pi_old, but "
     "rollout.correction.name=none leaves that gap uncorrected"),
    (RolloutConfig(schedule=ScheduleConfig(placement="separate", num_ranks=1, mode="free", partial=True),
                   engine=VLLM),
     "rollout.schedule.partial=true needs an engine that can stop a generation at a refit"),
    (RolloutConfig(prompts_per_step=4, schedule=ScheduleConfig(placement="separate", num_ranks=3)),
     "rollout.schedule.num_ranks=3 does not divide rollout.prompts_per_step=4"),
])
def test_each_invariant_names_its_key_path(rollout, message):
    problems = rollout.problems("rollout")
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_the_defaults_have_no_problem():
    assert RolloutConfig().problems("rollout") == []
