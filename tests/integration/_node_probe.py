"""A ``plugins=[...]`` module that records where each side of a separate-placement CLI run ran
(tests/integration/test_two_nodes.py).

Wraps the two entry points the CLI calls after the world is split: :func:`setup.run_rollout_rank` (a
rollout rank) and :meth:`loop.GRPOTrainer.fit` (a training rank). Each writes
``<NEMO_SSPO_TEST_PROBE_DIR>/rank_<RANK>.json`` with its role, the launch variables torchrun set
(``RANK``, ``GROUP_RANK`` = the agent's node rank, ``LOCAL_RANK``, ``MASTER_ADDR``,
``TORCHELASTIC_USE_AGENT_STORE``) and its parent's pid (the torchrun agent that started it), so the
test can tell which agent held which rank from what the ranks did, not from the rank-numbering rule.
"""

import json
import os
from pathlib import Path

from nemo_sspo.trainer import loop, setup

_KEYS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE")


def _record(role: str) -> None:
    found = {key: os.environ.get(key) for key in _KEYS}
    found.update(role=role, agent_pid=os.getppid())
    Path(os.environ["NEMO_SSPO_TEST_PROBE_DIR"], f"rank_{found['RANK']}.json").write_text(json.dumps(found))


_run_rollout_rank = setup.run_rollout_rank
_fit = loop.GRPOTrainer.fit


def _probed_rollout_rank(*args, **kwargs):
    _record("rollout")
    return _run_rollout_rank(*args, **kwargs)


def _probed_fit(self, *args, **kwargs):
    _record("train")
    return _fit(self, *args, **kwargs)


setup.run_rollout_rank = _probed_rollout_rank
loop.GRPOTrainer.fit = _probed_fit
