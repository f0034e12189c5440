"""The docs name only what exists: every backticked ``nemo_sspo.*`` name resolves, every repository
path exists, every config key (``trainer.max_steps``, ``loss.params.gamma``, ``loss=grpo``) is one
the config takes, every registered loss has its row in docs/algorithms.md, and the worked examples
of docs/extending.md run as written."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path
from typing import get_type_hints

import pytest
import torch

from nemo_sspo.algorithms.advantage_estimators import advantage_estimator_names, unregister_advantage_estimator
from nemo_sspo.algorithms.losses import LossInputs, compute_policy_loss, get_policy_loss, policy_loss_names
from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.data import SOURCE_OPTIONS
from nemo_sspo.rewards import reward_names, unregister_reward
from nemo_sspo.rollout import rollout_engine_names, unregister_rollout_engine
from nemo_sspo.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```.*?```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_GROUPS = ("loss", "data", "model", "parallel", "recipe")


def _spans(path: Path) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return _SPAN.findall(_FENCE.sub("", path.read_text()))


def _resolve_python(name: str) -> bool:
    """``nemo_sspo.a.b.c``: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _fields(cls) -> dict:
    return get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


def _config_key_exists(key: str) -> bool:
    """A dotted key of :class:`TrainConfig`; ``loss.params.*`` / ``data.options.*`` may be a field of
    any registered loss config / source options class."""
    parts = key.split(".")
    if parts[:2] == ["loss", "params"] and len(parts) == 3:
        return any(parts[2] in _fields(get_policy_loss(n).config_cls) for n in policy_loss_names())
    if parts[:2] == ["data", "options"] and len(parts) == 3:
        return any(parts[2] in _fields(cls) for cls in SOURCE_OPTIONS.values())
    node = TrainConfig
    for part in parts:
        hints = _fields(node)
        if part not in hints:
            return False
        node = hints[part]
    return True


def _group_choice_exists(group: str, choice: str) -> bool:
    if group == "loss" and choice in policy_loss_names():
        return True
    return (DEFAULT_CONFIG_DIR / group / f"{choice}.yaml").is_file()


def _problem(span: str) -> str | None:
    """Why ``span`` names nothing that exists, or None (also for spans that name no code of ours)."""
    text = span.strip()
    if text.startswith("nemo_sspo."):
        return None if _resolve_python(text.split("(")[0]) else "no such Python name"
    if re.fullmatch(r"(nemo_sspo|tests|docs|examples|benchmarks|tools|constraints)/[\w./-]*", text):
        path = text.split("#")[0].rstrip("/")
        return None if (ROOT / path).exists() else "no such file"
    if re.fullmatch(r"conf/[\w./-]+\.yaml", text):
        return None if (DEFAULT_CONFIG_DIR / text[len("conf/"):]).exists() else "no such config file"
    if " " in text:
        return None
    key, _, value = text.partition("=")
    if key in _GROUPS and value and re.fullmatch(r"[\w.-]+", value):
        return None if _group_choice_exists(key, value) else f"no choice {value!r} in group {key!r}"
    first = key.split(".")[0]
    if "." in key and first in _fields(TrainConfig) and re.fullmatch(r"[\w.]+", key):
        return None if _config_key_exists(key) else "no such config key"
    return None


def test_every_backticked_name_in_the_docs_exists():
    problems = [f"{path.relative_to(ROOT)}: `{span}`: {why}"
                for path in DOCS for span in _spans(path) if (why := _problem(span))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("span, fragment", [
    ("nemo_sspo.algorithms.losses.ratio_clip_loss", "no such Python name"),
    ("nemo_sspo/conf/loss/grpo.yaml", "no such file"),
    ("trainer.max_stepz", "no such config key"),
    ("loss.params.gamma_typo", "no such config key"),
    ("loss=grpo_typo", "no choice"),
])
def test_the_checker_finds_a_stale_name(span, fragment):
    assert fragment in (_problem(span) or "")
    assert _problem(span.replace("ratio_clip_loss", "make_policy_loss").replace("_typo", "")
                    .replace("max_stepz", "max_steps").replace("conf/loss/grpo", "conf/loss/sspo_7b")) is None


def test_every_registered_loss_has_a_row_in_the_family_table():
    table = (ROOT / "docs" / "algorithms.md").read_text()
    missing = [name for name in policy_loss_names() if f"| `{name}` |" not in table]
    assert not missing, f"add a row for {missing} to the family table of docs/algorithms.md"


# ---------------------------------------------------------------------------- docs/extending.md

def _extending_files() -> dict[str, str]:
    """The guide's complete files: fenced ``python`` blocks whose first line is ``# <name>.py``."""
    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return {match.group(1): block for block in blocks if (match := re.match(r"# (\w+\.py)\n", block))}


@pytest.fixture
def guide_files(tmp_path):
    """The guide's files written to a scratch folder; what they register is removed afterwards."""
    files = _extending_files()
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    before = (set(policy_loss_names()), set(reward_names()), set(rollout_engine_names()), set(SOURCE_OPTIONS),
              set(advantage_estimator_names()))
    yield {name: tmp_path / name for name in files}
    from nemo_sspo.algorithms.losses import unregister_policy_loss
    from nemo_sspo.data import PROMPT_SOURCES

    for name in set(policy_loss_names()) - before[0]:
        unregister_policy_loss(name)
    for name in set(reward_names()) - before[1]:
        unregister_reward(name)
    for name in set(rollout_engine_names()) - before[2]:
        unregister_rollout_engine(name)
    for name in set(SOURCE_OPTIONS) - before[3]:
        del SOURCE_OPTIONS[name], PROMPT_SOURCES[name]
    for name in set(advantage_estimator_names()) - before[4]:
        unregister_advantage_estimator(name)
    for name in files:
        sys.modules.pop(f"nemo_sspo_plugin_{Path(name).stem}", None)


def test_the_guide_has_a_file_for_each_seam():
    assert set(_extending_files()) == {"my_loss.py", "my_reward.py", "my_prompts.py", "my_engine.py",
                                       "my_advantage.py"}


def test_guide_advantage_estimator_is_selectable_and_has_its_documented_value(guide_files):
    from nemo_sspo.algorithms.advantage_estimators import AdvantageInputs, estimate_advantages, get_advantage_estimator

    cfg = load_config(overrides=[f"plugins=[{guide_files['my_advantage.py']}]", "advantage.name=positive_rate"])
    assert cfg.advantage.name == "positive_rate"
    # The guide's hand value: N = 8, N+ = 3 -> alpha = 8/3 times [3/4, -1/4 x 3, 1/2, 1/2, -1/2, -1/2].
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = estimate_advantages(get_advantage_estimator("positive_rate"), AdvantageInputs(rewards, rewards, 4))
    torch.testing.assert_close(adv, torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3, 4 / 3, 4 / 3, -4 / 3, -4 / 3]))


def test_guide_loss_is_selectable_and_has_its_documented_value(guide_files):
    cfg = load_config(overrides=[f"plugins=[{guide_files['my_loss.py']}]", "loss=reinforce",
                                 "loss.params.advantage_clip=0.5"])
    assert cfg.loss.name == "reinforce" and cfg.loss.params.advantage_clip == 0.5
    # The guide's hand value: A = [2, -1] clipped to [0.5, -0.5]; log pi = [[-1, -3], [-2, pad]];
    # token mean over 3 tokens: -(0.5 * -1 + 0.5 * -3 + -0.5 * -2) / 3 = -(-0.5 - 1.5 + 1) / 3 = 1/3.
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, metrics = compute_policy_loss("reinforce", LossInputs(logprobs, logprobs, torch.tensor([2.0, -1.0]),
                                                                mask), advantage_clip=0.5)
    assert loss.item() == pytest.approx(1 / 3)
    assert metrics["policy/clipfrac_tokens"] == 0.0  # LossTerms' defaults: no clip flags to fill


def _module(path: Path):
    return sys.modules[f"nemo_sspo_plugin_{path.stem}"]


def test_guide_reward_prompts_and_engine_have_their_documented_behaviour(guide_files):
    from nemo_sspo.rollout import RolloutEngine

    load_config(overrides=[f"plugins=[{','.join(str(p) for p in guide_files.values())}]", "loss=reinforce",
                           "reward.name=exact_number", "rollout.backend=timed_hf", "data=countdown_schema",
                           "data.options.start=7", "reward.options={tolerance: 0.5}"])
    reward = _module(guide_files["my_reward.py"])
    scorer = reward.ExactNumberReward(reward.ExactNumberOptions(0.5))
    # |4.4 - 4| = 0.4 <= 0.5; the last number 3 is off by 1; no number at all.
    assert scorer(["so 4.4", "5 then 3", "none"], ["4", "4", "4"]) == [1.0, 0.0, 0.0]
    prompts = _module(guide_files["my_prompts.py"])
    for problem in prompts.CountdownSource(seed=0, start=7).sample(50):
        a, b = map(int, re.findall(r"\d+", problem.question))
        assert 1 <= b <= a <= 7 and problem.answer == str(a - b)
    engine = _module(guide_files["my_engine.py"]).TimedEngine
    assert all(hasattr(engine, name) for name in ("generate", "load_weight_buckets", "sleep", "wake_up",
                                                  "hf_state_dict"))
    assert RolloutEngine is not None
