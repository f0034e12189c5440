"""tools/gpu_bundle.sh builds the GPU machine's bundle under the 64 MiB that travel, and
tests/gpu/run_checks.sh's CPU dry run installs it offline on Python 3.12 (pyenv's 3.12.1, which has
nothing but pip), checks every wheel's requirements and the scripts' imports; a bundle missing a
wheel is refused naming what needs it."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"


def _bash(*args, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": PY312, **(env or {})}
    return subprocess.run(["bash", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    assert Path(PY312).is_file(), f"the dry run needs pyenv's Python 3.12.1 at {PY312} (on these machines)"
    folder = tmp_path_factory.mktemp("gpu") / "bundle"
    proc = _bash("tools/gpu_bundle.sh", str(folder), env={"PYTHON": str(ROOT / ".venv" / "bin" / "python")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, proc.stdout


@pytest.mark.slow
def test_bundle_fits_and_the_dry_run_passes(bundle):
    folder, out = bundle
    kib = re.search(r"(\d+) KiB of the 65536 KiB that travel", out)
    assert kib and int(kib.group(1)) < 65536, out
    # The script's own count, checked here: everything the bundle holds plus the repository.
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < 48 << 20, size  # about 30 MiB: room to spare for the working tree
    assert sorted(p.name for p in (folder / "smollm2_shape").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    proc = _bash("tests/gpu/run_checks.sh", "--bundle", str(folder), "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS bundle requirements: 15 wheels installed offline, every requirement met" in proc.stdout
    assert "import megatron.core: needs torch, which the GPU machine has" in proc.stdout
    assert "PASS bundle imports: Python 3.12.1" in proc.stdout
    assert ("PASS dry run: imports fine without 16 packages the GPU machine lacks; train and memory check configs valid; async "
            "check configs valid (colocated, separate with 2 rollout ranks)") in proc.stdout
    assert proc.stdout.rstrip().endswith("DRY RUN PASSED (nothing ran on a GPU)")


@pytest.mark.slow
def test_a_bundle_missing_a_wheel_is_refused(bundle, tmp_path):
    folder, _ = bundle
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    (omegaconf,) = (partial / "wheels").glob("omegaconf-*.whl")
    omegaconf.unlink()
    proc = _bash("tests/gpu/run_checks.sh", "--bundle", str(partial), "--dry-run")
    assert proc.returncode == 1
    assert "FAIL bundle requirements: hydra-core needs omegaconf<2.4,>=2.2 (installed: None)" in proc.stdout
    assert "DRY RUN" not in proc.stdout  # nothing else ran
