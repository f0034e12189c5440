"""Two torchrun agents, one per "node", joined by one c10d rendezvous on the loopback, run the
2-step separate-placement command of docs/async.md as written there (the test adds only an output
folder, a stub reward and a probe plugin): both agents exit 0, ``metrics.jsonl`` holds steps 1 and 2,
and the rollout rank ran under the second agent, the training rank under the first.

No ``--node-rank``: as on real nodes, the rendezvous numbers the agents itself, sorting them by
address (torchrun's ``--local-addr``, else the host's FQDN), then by pid. The agents here take the
loopback addresses 127.0.0.1 and 127.0.0.2, and the second node's agent is started first (the lower
pid), so only the address order can put its worker last: the test checks the numbering a multi-node
launch relies on (the world's last R ranks, the rollout ranks, sit on the last node), not a pid
coincidence. The first agent (``is_host=1``) serves the rendezvous; the second connects to it.
"""

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration._launch import REPO, TORCHRUN, free_port, launch_env
from tests.integration._loop_runs import PARITY_REWARD

DOC = REPO / "docs" / "async.md"
PLUGINS = [Path(__file__).with_name("_fault_plugin.py"), Path(__file__).with_name("_node_probe.py")]
"""``_fault_plugin`` registers the stub reward (it injects nothing without ``NEMO_SSPO_TEST_FAULT``)."""
DOC_ENDPOINT = "127.0.0.1:29500"


def documented_node_commands() -> list[list[str]]:
    """The ``torchrun --nnodes=2 ... --local-addr=...`` commands of docs/async.md, one per node,
    continuation lines joined, as argument lists."""
    joined = DOC.read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in re.findall(r"(?m)^ *(torchrun --nnodes=2 .*--local-addr=.*)$", joined)]


def _agent(command: list[str], port: int, out: Path, probe: Path, log: Path) -> subprocess.Popen:
    args = [arg.replace(DOC_ENDPOINT, f"127.0.0.1:{port}") for arg in command[1:]]
    args += [f"trainer.output_dir={out}", "trainer.overwrite_output_dir=true", f"reward.name={PARITY_REWARD}",
             f"plugins=[{','.join(map(str, PLUGINS))}]"]
    with log.open("w") as sink:  # the agent keeps its own descriptor
        return subprocess.Popen([*TORCHRUN, *args], cwd=REPO, env=launch_env(NEMO_SSPO_TEST_PROBE_DIR=str(probe)),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def test_the_documented_commands_are_two_agents_of_one_rendezvous():
    node0, node1 = documented_node_commands()
    for command, host, addr in ((node0, "1", "127.0.0.1"), (node1, "0", "127.0.0.2")):
        assert f"--rdzv-endpoint={DOC_ENDPOINT}" in command and "--rdzv-backend=c10d" in command
        assert f"--rdzv-conf=is_host={host}" in command and f"--local-addr={addr}" in command
        assert not any(arg.startswith("--node-rank") for arg in command)
        assert {"rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "trainer.max_steps=2"} <= set(command)
    # the same run on both nodes: only the launcher's per-node options differ
    assert [a for a in node0 if "is_host" not in a and "local-addr" not in a] == \
           [a for a in node1 if "is_host" not in a and "local-addr" not in a]


@pytest.mark.slow
def test_two_agents_put_the_rollout_rank_on_the_second_node(tmp_path):
    node0, node1 = documented_node_commands()
    port, out, probe = free_port(), tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    second = _agent(node1, port, out, probe, tmp_path / "node1.log")  # started first: the lower pid
    first = _agent(node0, port, out, probe, tmp_path / "node0.log")
    agents = {"node0": first, "node1": second}
    try:
        codes = {name: agent.wait(timeout=240) for name, agent in agents.items()}
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)  # the harness's safety net: the agent and its workers
                agent.wait()
    logs = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in agents}
    assert codes == {"node0": 0, "node1": 0}, logs

    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    ranks = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in probe.glob("rank_*.json")}
    assert sorted(ranks) == [0, 1]
    train, rollout = ranks[0], ranks[1]
    assert (train["role"], train["agent_pid"], train["GROUP_RANK"]) == ("train", first.pid, "0")
    assert (rollout["role"], rollout["agent_pid"], rollout["GROUP_RANK"]) == ("rollout", second.pid, "1")
    for found in ranks.values():
        # both sides reach the store node 0's agent serves (split_launched_world connects, never hosts)
        assert (found["WORLD_SIZE"], found["LOCAL_RANK"], found["MASTER_ADDR"]) == ("2", "0", "127.0.0.1")
        assert found["TORCHELASTIC_USE_AGENT_STORE"] == "True"
