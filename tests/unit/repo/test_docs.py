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
from nemo_sspo.trainer.config import OPTION_SECTIONS, TrainConfig
from nemo_sspo.trainer.config.old_keys import RENAMED_KEYS

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```.*?```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_GROUPS = ("loss", "data", "model", "parallel", "recipe", "reward", "rollout/engine")


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
    """A dotted key of :class:`TrainConfig`; ``loss.params.*`` / ``data.options.*`` /
    ``reward.options.*`` / ``rollout.engine.options.*`` may be a field of any registered loss config /
    source options class / reward or engine options class."""
    parts = key.split(".")
    for section in OPTION_SECTIONS:
        if key.startswith(f"{section.path}.options.") and len(parts) == len(section.path.split(".")) + 2:
            return any(parts[-1] in _fields(cls) for cls in section.registry.declared_options().values())
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
    for section in OPTION_SECTIONS:
        if group == section.group:
            return choice in section.registry
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
        if key in RENAMED_KEYS:  # a key of an earlier release, named where the docs say what replaced it
            return None
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
    ("reward.options.num_workers_typo", "no such config key"),
    ("rollout.engine.options.max_model_len_typo", "no such config key"),
    ("rollout/engine=vllm_typo", "no choice"),
])
def test_the_checker_finds_a_stale_name(span, fragment):
    assert fragment in (_problem(span) or "")
    assert _problem(span.replace("ratio_clip_loss", "make_policy_loss").replace("_typo", "")
                    .replace("max_stepz", "max_steps").replace("conf/loss/grpo", "conf/loss/sspo_7b")) is None


def test_a_key_of_an_earlier_release_passes_only_where_it_is_listed_as_renamed():
    assert _problem("rollout.tis_cap=C") is None
    assert "no such config key" in (_problem("rollout.tis_capz=C") or "")


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
    # The guide's hand value: A = [2, -0.25] clipped to [0.5, -0.25]; log pi = [[-1, -3], [-2, pad]];
    # per-token losses [[0.5, 1.5], [-0.5, pad]], token mean (0.5 + 1.5 - 0.5) / 3 = 0.5.
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([2.0, -0.25])
    inputs = LossInputs(logprobs, logprobs, advantages, mask)
    loss, metrics = compute_policy_loss("reinforce", inputs, advantage_clip=0.5)
    assert loss.item() == pytest.approx(0.5)
    assert metrics["policy/advantage_clipped_frac"] == pytest.approx(2 / 3)  # row 0's 2 of the 3 tokens
    assert metrics["policy/clipfrac_tokens"] == 0.0  # LossTerms' defaults: no clip flags to fill
    # The inherited fields, as the guide works them out: k1 with log pi_ref = log pi - 1 is 1 per
    # token, 0.5 + 0.1 = 0.6; an entropy of 0.5 per token, 0.5 - 0.2 * 0.5 = 0.4; response means
    # (0.5 + 1.5) / 2 = 1.0 and -0.5, averaged: 0.25.
    with_ref = LossInputs(logprobs, logprobs, advantages, mask, ref_logprobs=logprobs - 1.0)
    loss, metrics = compute_policy_loss("reinforce", with_ref, advantage_clip=0.5, kl_coef=0.1, kl_estimator="k1")
    assert loss.item() == pytest.approx(0.6) and metrics["policy/kl_ref"] == pytest.approx(1.0)
    with_entropy = LossInputs(logprobs, logprobs, advantages, mask, entropy=torch.full((2, 2), 0.5))
    assert compute_policy_loss("reinforce", with_entropy, advantage_clip=0.5, entropy_coef=0.2)[0].item() == \
        pytest.approx(0.4)
    assert compute_policy_loss("reinforce", inputs, advantage_clip=0.5,
                               aggregation="seq-mean-token-mean")[0].item() == pytest.approx(0.25)


def _module(path: Path):
    return sys.modules[f"nemo_sspo_plugin_{path.stem}"]


def test_guide_reward_prompts_and_engine_have_their_documented_behaviour(guide_files):
    from nemo_sspo.rollout import RolloutEngine

    load_config(overrides=[f"plugins=[{','.join(str(p) for p in guide_files.values())}]", "loss=reinforce",
                           "reward=exact_number", "rollout.engine.backend=timed_hf", "data=countdown_schema",
                           "data.options.start=7", "reward.options.tolerance=0.5"])
    reward = _module(guide_files["my_reward.py"])
    scorer = reward.ExactNumberReward(reward.ExactNumberOptions(0.5))
    # |4.4 - 4| = 0.4 <= 0.5; the last number 3 is off by 1; no number at all.
    assert scorer(["so 4.4", "5 then 3", "none"], ["4", "4", "4"]) == [1.0, 0.0, 0.0]
    prompts = _module(guide_files["my_prompts.py"])
    for problem in prompts.CountdownSource(seed=0, start=7).sample(50):
        a, b = map(int, re.findall(r"\d+", problem.question))
        assert 1 <= b <= a <= 7 and problem.answer == str(a - b)
    engine = _module(guide_files["my_engine.py"]).TimedEngine(_RecordingEngine())
    assert isinstance(engine, RolloutEngine)
    # Refit hands over a one-shot iterator (the guide): the engine passes it on, consumed once, to the end.
    buckets = iter([{"a": torch.zeros(1)}, {"b": torch.ones(2)}])
    engine.load_weight_buckets(buckets)
    assert engine.inner.loaded == [["a"], ["b"]] and next(buckets, None) is None


class _RecordingEngine:
    """An inner engine that records the bucket names it was given, consuming the iterator as the
    trainer's engines do."""

    stop_token_ids = [0]

    def __init__(self):
        self.loaded = []

    def load_weight_buckets(self, buckets):
        for bucket in buckets:
            self.loaded.append(sorted(bucket))


def _commands(text: str) -> list[str]:
    """Shell commands of the fenced ``bash`` blocks (and indented blocks), continuation lines joined,
    comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    blocks += ["\n".join(line[4:] for line in block.splitlines())
               for block in re.findall(r"(?m)((?:^    \S.*\n)+)", _FENCE.sub("", text))]
    commands = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            command = " ".join(command.split(" #", 1)[0].split())
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def _overrides(command: str) -> list[str] | None:
    """The Hydra overrides of a ``nemo-sspo train|eval|plan`` command (options and their values
    dropped, up to a ``&&`` or ``|``), or None for another command."""
    words = command.replace("'", " ").replace('"', " ").split()
    for i, word in enumerate(words[:-1]):
        if word.endswith(("nemo-sspo", "nemo_sspo.cli")) and words[i + 1] in ("train", "eval", "plan"):
            out, takes_value = [], False
            for item in words[i + 2:]:
                if item in ("&&", "|"):
                    break
                if takes_value or item.startswith("--"):
                    takes_value = item in ("--config-name", "--config-dir")
                    continue
                out.append(item)
            return out
    return None


def test_every_documented_command_names_existing_keys_files_and_configs():
    problems = []
    for path in DOCS:
        for command in _commands(path.read_text()):
            if path.name == "extending.md" and "plugins=" in command:
                continue  # names what its plugins register: test_the_guide_commands_compose loads them
            for script in re.findall(r"(?:^|\s)((?:benchmarks|examples|tools|tests)/[\w./-]+\.(?:py|sh|sbatch))",
                                     command):
                if not (ROOT / script).is_file():
                    problems.append(f"{path.name}: `{command}`: no file {script}")
            for name in re.findall(r"--config-name[= ](\S+)", command):
                if not (DEFAULT_CONFIG_DIR / f"{name}.yaml").is_file():
                    problems.append(f"{path.name}: `{command}`: no config {name}")
            for item in _overrides(command) or []:
                item = item.lstrip("+~")
                if "=" in item and item.split("=")[0] != "plugins" and (why := _problem(item)):
                    problems.append(f"{path.name}: `{command}`: {item}: {why}")
    assert not problems, "\n".join(problems)


def test_the_command_checker_finds_a_stale_override_and_a_missing_script():
    assert _overrides("torchrun --nproc-per-node 2 -m nemo_sspo.cli train --config-name x parallel=pp2 "
                      "trainer.max_steps=2") == ["parallel=pp2", "trainer.max_steps=2"]
    assert _overrides("python benchmarks/train_step.py") is None
    assert _problem("trainer.max_stepz=2") == "no such config key"
    assert _commands("```bash\nnemo-sspo train \\\n    loss=grpo   # two lines\n```\n") == ["nemo-sspo train loss=grpo"]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """A Markdown file's anchors: ``<a id="...">`` tags, and GitHub's heading anchors (lower case,
    punctuation dropped, spaces as '-')."""
    text = _FENCE.sub("", path.read_text())
    headings = re.findall(r"(?m)^#+ (.+)$", text)
    explicit = set(re.findall(r'<a id="([^"]+)"></a>', text))
    return explicit | {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_between_the_docs_resolves():
    problems = []
    for path in DOCS:
        for target in _LINK.findall(_FENCE.sub("", path.read_text())):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.name}: ({target}): no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{path.name}: ({target}): no heading #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_the_readme_fits_on_a_screen_links_every_page_and_keeps_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _LINK.findall(readme)}
    unlinked = [page.name for page in sorted((ROOT / "docs").glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"link {unlinked} from README.md"
    command = ".venv/bin/python -m pytest -q tests"
    assert f"bash install.sh && {command}" in readme
    assert (ROOT / ".ci" / "run").read_text().splitlines()[-1] == f"bash install.sh && {command}"


def test_the_guide_commands_compose(guide_files):
    # Each `nemo-sspo train` command of docs/extending.md, with $PWD the folder holding the guide's files.
    folder = next(iter(guide_files.values())).parent
    commands = [c for c in _commands((ROOT / "docs" / "extending.md").read_text()) if _overrides(c) is not None]
    assert len(commands) == 7
    for command in commands:
        overrides = [item.replace("$PWD", str(folder)) for item in _overrides(command.replace("{tolerance: 0.5}",
                                                                                             "{tolerance:0.5}"))]
        cfg = load_config(overrides=overrides)
        assert cfg.plugins and all(Path(p).parent == folder for p in cfg.plugins), command
