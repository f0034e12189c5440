"""A rollout rank that hangs inside generation (it does not die) ends a torchrun launch: the training
rank fails within ``rollout.schedule.peer_timeout_s`` with an error naming rollout rank 1, step 1's metrics
stay in ``metrics.jsonl``, torchrun stops the hung rank, and nothing outlives the launch. The
subprocess timeout is only the harness's safety net."""

import json
import os
import subprocess
import time

from tests.integration._hung_rollout_worker import PEER_TIMEOUT_S
from tests.integration._launch import REPO, TORCHRUN, free_port, launch_env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hung_rollout_rank_ends_the_run_within_the_peer_timeout(tmp_path):
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "tests.integration._hung_rollout_worker", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure["step"] == 2
    assert "rollout rank 1 sent no rollout for" in failure["error"]
    assert "(it died or hung past rollout.schedule.peer_timeout_s=8); no rollout rank sent rollout for step 2" in failure["error"]
    # the receive of step 2 gives up after the timeout, not before and not much later (2 s of slack
    # for a loaded machine)
    assert PEER_TIMEOUT_S <= failure["seconds"] < PEER_TIMEOUT_S + 2
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1]
    pid = int((tmp_path / "rollout.pid").read_text())
    deadline = time.monotonic() + 5  # torchrun has stopped its workers when it returns; allow for reaping
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung rollout rank outlived the launch"
