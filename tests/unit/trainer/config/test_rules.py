"""The rules list is the one place of the cross-section checks: each rule reads keys of the schema
(and declares every key it reads), and each is cross-section (two sections, or one against the
launched world)."""

import dataclasses
import typing

from nemo_sspo.trainer.config import RULES, TrainConfig
from nemo_sspo.trainer.config.validation import facts_of

WORLD_FACTS = {"launched", "training_ranks", "model_parallel", "dp"}


def _schema_keys(node=TrainConfig, prefix=""):
    keys = set()
    for name, hint in typing.get_type_hints(node).items():
        keys.add(f"{prefix}{name}")
        if dataclasses.is_dataclass(hint):
            keys |= _schema_keys(hint, f"{prefix}{name}.")
    return keys


class _Recorder:
    """Wraps a config node; records the dotted path of every field read through it."""

    def __init__(self, node, path, seen):
        self._node, self._path, self._seen = node, path, seen

    def __getattr__(self, name):
        value = getattr(self._node, name)
        path = f"{self._path}{name}"
        self._seen.add(path)
        return _Recorder(value, f"{path}.", self._seen) if dataclasses.is_dataclass(value) else value


def test_the_schema_walk_sees_nested_sections():
    keys = _schema_keys()
    assert {"rollout.engine.backend", "critic.optim.lr", "trainer.wandb.mode",
            "advantage.normalize_std"} <= keys


def test_every_rule_reads_keys_of_the_schema():
    keys = _schema_keys()
    for rule in RULES:
        assert rule.keys and set(rule.keys) <= keys, rule.keys


def test_every_rule_is_cross_section():
    for rule in RULES:
        sections = {key.split(".")[0] for key in rule.keys}
        assert len(sections) >= 2 or set(rule.facts) & WORLD_FACTS, rule.keys


def test_every_key_a_rule_reads_is_declared():
    cfg = TrainConfig()
    cfg.rollout.sampling.dynamic_sampling = False
    facts = facts_of(cfg, 1)
    for rule in RULES:
        seen = set()
        recorder = _Recorder(cfg, "", seen)
        rule.when(recorder, facts)
        rule.holds(recorder, facts)
        rule.message(recorder, facts)
        read = {path for path in seen if not any(other.startswith(f"{path}.") for other in seen)}  # leaves
        assert read <= set(rule.keys), (rule.keys, read - set(rule.keys))
