"""The Dockerfile's own check, run as the image runs it: the last ``RUN``'s ``cd / && ... nemo-sspo
train --print-config ...`` step, with the image's ``ENV`` settings, from ``/`` (so the packaged
configs are found without the repository). Before this test the line lacked ``WORLD_SIZE`` and
exited 2 (the 7B recipe's TP 2 does not divide world size 1): the image could not build.

The build's other steps (the NGC base image, the wheel, vLLM for CUDA) need Docker and a GPU image,
which this machine does not have; the wheel and the Python 3.12 install are tests/compat/run.sh's.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.integration._launch import REPO

DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1), m.group(2).strip()) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", joined, re.M)]


def _image_env() -> dict[str, str]:
    env = {}
    for instruction, args in _instructions():
        if instruction == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(args))
    return env


def _print_config_step() -> str:
    """The last RUN's steps from ``cd /`` up to and including the ``--print-config`` command."""
    run = [args for instruction, args in _instructions() if instruction == "RUN"][-1]
    steps = [step.strip() for step in run.split("&&")]
    start = steps.index("cd /")
    end = next(i for i, step in enumerate(steps) if "--print-config" in step)
    return " && ".join(steps[start:end + 1])


def test_the_images_print_config_check_passes_as_the_build_runs_it():
    step = _print_config_step()
    assert "nemo-sspo train --print-config --config-name sspo_qwen2.5_math_7b" in step
    env = {**os.environ, **_image_env(), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("WORLD_SIZE", None)  # docker build sets none: the step must set its own
    run = subprocess.run(["bash", "-c", f"set -e; {step}"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
