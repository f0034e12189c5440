"""A reward and a rollout engine defined in a user's own file run in ``nemo-sspo train`` by config
alone (``plugins=[file] reward.name=... rollout.engine.backend=...``), without touching the trainer."""

import json
import sys

import pytest

from nemo_sspo.cli import main
from nemo_sspo.rewards import reward_names, unregister_reward
from nemo_sspo.rollout import rollout_engine_names, unregister_rollout_engine
from tests.integration._loop_runs import TINY

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

PLUGIN = '''
from nemo_sspo.rewards import register_reward
from nemo_sspo.rollout import build_rollout_engine, register_rollout_engine

CALLS = {"generate": 0, "load_weight_buckets": 0, "sleep": 0}


class HalfReward:
    """0 for even rows, 0.5 for odd rows: the mean of any even batch is 0.25."""

    def __call__(self, responses, answers):
        return [0.5 * (i % 2) for i in range(len(responses))]

    def close(self):
        pass


class CountingEngine:
    """The transformers engine, counting the calls the trainer makes."""

    def __init__(self, inner):
        self.inner, self.stop_token_ids = inner, inner.stop_token_ids

    def generate(self, prompts, *, seed):
        CALLS["generate"] += 1
        return self.inner.generate(prompts, seed=seed)

    def load_weight_buckets(self, buckets):
        CALLS["load_weight_buckets"] += 1
        self.inner.load_weight_buckets(buckets)

    def sleep(self):
        CALLS["sleep"] += 1

    def wake_up(self):
        pass

    def hf_state_dict(self):
        return self.inner.hf_state_dict()

    def shutdown(self):
        self.inner.shutdown()


register_reward("user_half", lambda section: HalfReward())
register_rollout_engine("user_counting", lambda context: CountingEngine(build_rollout_engine("hf", context)))
'''


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "user_seams_plugin.py"
    path.write_text(PLUGIN)
    yield path
    for names, unregister, name in ((reward_names, unregister_reward, "user_half"),
                                    (rollout_engine_names, unregister_rollout_engine, "user_counting")):
        if name in names():
            unregister(name)
    sys.modules.pop("nemo_sspo_plugin_user_seams_plugin", None)


def test_user_reward_and_engine_by_config_alone(plugin_file, tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"plugins=[{plugin_file}]", "reward.name=user_half", "rollout.engine.backend=user_counting",
                 *TINY, f"trainer.output_dir={out}"]) == 0
    calls = sys.modules["nemo_sspo_plugin_user_seams_plugin"].CALLS
    # 2 steps x 2 prompt groups, one generate call per group; one refit and one sleep per step.
    assert calls == {"generate": 4, "load_weight_buckets": 2, "sleep": 2}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # HalfReward over 4 rows [0, 0.5, 0, 0.5]: mean 0.25 in both steps.
    assert [s["reward/mean"] for s in steps] == [0.25, 0.25]


def test_injected_engine_is_the_one_the_trainer_uses(tmp_path, monkeypatch):
    # GRPOTrainer(engine=...): an engine object passed in is generated with and refitted, no
    # registry involved. It wraps a transformers engine on the same initial weights.
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.models import build_hf_model, load_hf_checkpoint
    from nemo_sspo.rollout import HFRolloutEngine, RolloutEngine
    from tests.integration._loop_runs import make_trainer

    checkpoint = load_hf_checkpoint("tiny-random-llama")
    hf_config, state_dict, tokenizer = checkpoint
    calls = []

    class Recording(HFRolloutEngine):
        def generate(self, prompts, *, seed):
            calls.append("generate")
            return super().generate(prompts, seed=seed)

        def load_weight_buckets(self, buckets):
            calls.append("refit")
            super().load_weight_buckets(buckets)

    engine = Recording(build_hf_model(hf_config, state_dict), tokenizer, max_new_tokens=8, temperature=0.7)
    assert isinstance(engine, RolloutEngine)
    trainer = make_trainer(monkeypatch, tmp_path, [], checkpoint=checkpoint, engine=engine)
    try:
        assert trainer.engine is engine
        trainer.fit()
    finally:
        destroy_parallel()
    # Per step: one generate per prompt group (2), then one refit.
    assert calls == ["generate", "generate", "refit"] * 2
