"""install.sh resolves on a machine that has only the public package index (issue 32).

PyPI's torch 2.13.0 for Linux x86_64 is the CUDA build, which pins triton==3.7.1 and the CUDA
libraries itself; install.sh takes the CPU build (2.13.0+cpu) from a local wheel or the PyTorch CPU
index. The first test is offline: no lane pin may name a package a torch build pins itself (the
old triton==3.9.0 pin made ``pip install -c constraints/py311.txt torch==2.13.0`` impossible on
PyPI). The second asks pip itself (``--dry-run --report``, nothing installed) to resolve install.sh's
resolving steps against the public index with every local source of this machine switched off.
"""

import json
import os
import re
import socket
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.repo.test_packaging import lane_pins

ROOT = Path(__file__).resolve().parents[3]
INSTALL = (ROOT / "install.sh").read_text()
# What a torch build pins itself: the CUDA build's triton and CUDA libraries (PyPI torch 2.13.0:
# triton==3.7.1, cuda-toolkit==13.0.3, nvidia-cudnn-cu13==9.20.0.48, ...).
TORCH_OWNED = re.compile(r"^(triton|nvidia-.*|cuda-.*)$", re.IGNORECASE)


def _install_value(variable: str) -> str:
    """The value install.sh gives ``variable`` (``NAME="value"`` or ``NAME=${ENV:-value}``)."""
    match = re.search(rf'^{variable}=(?:"([^"]+)"|\$\{{\w+:-([^}}]+)\}})$', INSTALL, re.MULTILINE)
    assert match, f"install.sh does not set {variable}"
    return match.group(1) or match.group(2)


def test_lane_pins_nothing_a_torch_build_pins_itself_and_fit_the_cpu_wheel():
    pins = lane_pins("py311.txt")
    assert [p for p in pins if TORCH_OWNED.match(p)] == []
    # The CPU wheel install.sh takes (the installed one: same file as the CPU index's) accepts
    # every pin of the lane for the packages it requires.
    assert metadata.version("torch") == "2.13.0+cpu"
    for line in metadata.requires("torch"):
        req = Requirement(line)
        if req.marker is None and req.name.lower() in pins:
            assert req.specifier.contains(pins[req.name.lower()]), f"{req} against {pins[req.name.lower()]}"
    assert _install_value("TORCH") == "torch==2.13.0+cpu"
    assert Version(pins["torch"]) == Version("2.13.0")  # the constraint admits the +cpu build


def _reachable(host: str) -> bool:
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def _stub_cpu_torch(folder: Path) -> Path:
    """A metadata-only wheel of the installed CPU torch: the PyTorch CPU index's offer, offline."""
    dist = metadata.distribution("torch")
    name = f"torch-{dist.version}"
    path = folder / f"{name}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.dist-info/METADATA", dist.read_text("METADATA"))
        wheel.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: false\n"
                       "Tag: cp311-cp311-manylinux_2_28_x86_64\n")
        wheel.writestr(f"{name}.dist-info/RECORD", "")
    return folder


def test_install_resolves_against_the_public_index_dry_run(tmp_path):
    """pip --dry-run --report of install.sh's torch and package steps, public index only.

    The CPU index (install.sh's ``TORCH_INDEX``) is used when it is reachable; where it is not
    (this development machine reaches PyPI only), a metadata-only wheel of the installed CPU torch
    stands in for it, which is also what a machine with a local wheel cache offers.
    """
    if not _reachable("pypi.org"):
        pytest.skip("pypi.org is not reachable from this machine: no public index to resolve against")
    torch_index = _install_value("TORCH_INDEX")
    host = re.match(r"https://([^/]+)/", torch_index).group(1)
    source = (["--extra-index-url", torch_index] if _reachable(host)
              else ["--find-links", str(_stub_cpu_torch(tmp_path))])
    report = tmp_path / "report.json"
    # Only the public index: no pip config file, no PIP_* (find-links, extra indexes, constraints).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
         "--no-build-isolation", "--index-url", "https://pypi.org/simple", *source, "--report", str(report),
         "-c", "constraints/py311.txt", _install_value("TORCH"), "-e", ".[test]"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    assert chosen["torch"] == "2.13.0+cpu"
    assert [name for name in chosen if TORCH_OWNED.match(name)] == []  # no CUDA libraries, no triton
    assert "nemo-sspo" in chosen and "megatron-core" in chosen
    for name, version in lane_pins("py311.txt").items():
        if name in chosen:
            assert Version(chosen[name]) == Version(version) or name == "torch", (name, chosen[name], version)
