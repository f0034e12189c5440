"""The entry-point route of docs/extending.md with a real installation: a tiny plugin distribution,
installed by pip into a scratch ``--target`` folder (no index, no build isolation: nothing is
downloaded), registers a reward that a run selects by name alone, and the run's ``config.yaml``
records the entry point with its distribution and version."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration._loop_runs import TINY

ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = '''
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "nemo-sspo-tiny-plugin"
version = "0.3.1"

[project.entry-points."nemo_sspo.plugins"]
tiny = "tiny_plugin"

[tool.setuptools]
py-modules = ["tiny_plugin"]
'''

MODULE = '''
"""Registers the reward ``tiny_half``: 0.5 for every response."""

from nemo_sspo.rewards import register_reward


class HalfReward:
    def __call__(self, responses, answers):
        return [0.5] * len(responses)

    def close(self):
        pass


register_reward("tiny_half", lambda section: HalfReward())
'''

RECORD = "tiny = tiny_plugin (nemo-sspo-tiny-plugin 0.3.1)"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The plugin distribution installed into a scratch folder; returns that folder."""
    source, target = tmp_path_factory.mktemp("tiny_plugin_src"), tmp_path_factory.mktemp("site")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "tiny_plugin.py").write_text(MODULE)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _python(site: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_an_installed_plugin_is_selectable_and_recorded_in_config_yaml(site, tmp_path):
    out = tmp_path / "run"
    proc = _python(site, ["-m", "nemo_sspo.cli", "train", "reward.name=tiny_half", *TINY, "trainer.max_steps=1",
                          f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["entry_point_plugins"] == [RECORD] and config["plugins"] == []
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["reward/mean"] == 0.5  # every response scored by the installed reward


@pytest.mark.slow
def test_a_config_naming_other_installed_plugins_is_refused(site, tmp_path):
    check = ("from nemo_sspo.cli import load_config\n"
             "print(load_config(overrides=['reward.name=tiny_half']).entry_point_plugins)\n"
             "load_config(overrides=[\"entry_point_plugins=['tiny = tiny_plugin (nemo-sspo-tiny-plugin 0.2.0)']\"])\n")
    proc = _python(site, ["-c", check], tmp_path)
    assert proc.stdout.strip() == repr([RECORD])
    assert proc.returncode == 1
    assert "entry_point_plugins=['tiny = tiny_plugin (nemo-sspo-tiny-plugin 0.2.0)'] is recorded" in proc.stderr
    assert "remove the key" in proc.stderr
