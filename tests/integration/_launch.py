"""What the torchrun-launching integration tests share: the repository root, a free port, the
workers' environment and the launcher's command prefix.

The workers run this checkout (``PYTHONPATH``), one thread each (the development machine has 2
cores), without reaching the Hugging Face Hub.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "TORCHRUN", "free_port", "launch_env", "torchrun_worker"]

REPO = Path(__file__).resolve().parents[2]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
"""torchrun of the test's interpreter (the ``torchrun`` script on PATH may belong to another one)."""


def free_port() -> int:
    """A TCP port free on the loopback now (the launcher binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment for a launch of this checkout, plus ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **extra}


def torchrun_worker(module: str, *args: str, nproc: int = 2, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module args`` on a free port, output captured; raises
    ``AssertionError`` with the tail of its stderr when it fails."""
    cmd = [*TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "-m", module, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
