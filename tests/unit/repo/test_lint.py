"""ruff (pyflakes errors, bugbear, pydocstyle with the Google convention; pyproject.toml [tool.ruff])
finds nothing in the repository. Part of the suite, so README's one test command runs it too."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: run bash install.sh (it is a test dependency, pinned in constraints/)"
    run = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_ruff_catches_an_undefined_name(tmp_path):
    # The failure class this guards against: an exported function reading a name that does not
    # exist raises NameError only when called (nemo_sspo.evaluation.stop_token_ids did).
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    bad = tmp_path / "bad.py"
    bad.write_text('"""Module."""\n\n\ndef f():\n    """Doc."""\n    return _MISSING\n')
    run = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "F821" in run.stdout
