"""Package metadata declares ranges (so it installs beside a container's torch); the lanes' exact
versions live in constraints/, and tools/install_beside_torch.py freezes the environment's torch."""

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in _project()["dependencies"]}


def lane_pins(name: str) -> dict[str, str]:
    """A constraints file's pins (normalised name -> version), read as install.sh's helper reads them."""
    return _helper().read_pins(str(ROOT / "constraints" / name))


def _helper():
    spec = importlib.util.spec_from_file_location("install_beside_torch",
                                                  ROOT / "tools" / "install_beside_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_312_is_allowed_and_310_is_not():
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_project()["requires-python"])
    assert "3.11.9" in spec and "3.12.1" in spec and "3.13.0" in spec
    assert "3.10.14" not in spec


def test_no_dependency_is_pinned_exactly():
    for req in _requirements().values():
        assert all(s.operator not in ("==", "===") for s in req.specifier), str(req)


def test_torch_range_admits_the_dev_wheel_and_container_builds():
    torch = _requirements()["torch"].specifier
    assert torch.contains("2.13.0") and torch.contains("2.13.0+cpu")
    # An NGC build's version is a pre-release with a local label; pip accepts an installed
    # pre-release that satisfies the range, which is what prereleases=True checks.
    assert torch.contains("2.10.0a0+b4e4ee81d3.nv25.12", prereleases=True)
    assert not torch.contains("2.5.1")


def test_megatron_core_range_is_016_through_019():
    mcore = _requirements()["megatron-core"].specifier
    assert all(mcore.contains(v) for v in ("0.16.1", "0.17.0", "0.19.2", "0.19.9"))
    assert not any(mcore.contains(v) for v in ("0.16.0", "0.15.3", "0.20.0"))


@pytest.mark.parametrize("lane", ["py311.txt", "py312.txt"])
def test_every_lane_pin_is_inside_the_declared_range(lane):
    requirements = _requirements()
    pins = lane_pins(lane)
    assert pins["megatron-core"] == {"py311.txt": "0.16.1", "py312.txt": "0.19.2"}[lane]
    for name, req in requirements.items():
        if name in pins:
            assert req.specifier.contains(pins[name]), f"{lane}: {name}=={pins[name]} outside {req}"


def test_only_the_311_lane_pins_torch_and_it_is_the_installed_one():
    import torch

    assert lane_pins("py311.txt")["torch"] == "2.13.0"
    assert "torch" not in lane_pins("py312.txt")  # the 3.12 lane / container keeps the torch it has
    assert torch.__version__.split("+")[0] == "2.13.0"


def test_merged_constraints_freeze_torch_and_skip_installed_packages(tmp_path):
    helper = _helper()
    path = tmp_path / "lane.txt"
    path.write_text("# comment\nmegatron-core==0.19.2\nReasoning_Gym==0.1.25  # trailing\nnumpy==2.4.6\n\n")
    pins = helper.read_pins(str(path))
    assert pins == {"megatron-core": "0.19.2", "reasoning-gym": "0.1.25", "numpy": "2.4.6"}
    installed = {"torch": "2.10.0a0+b4e4ee81d3.nv25.12", "numpy": "1.26.4"}
    # torch frozen at the container's build; numpy is the container's, so its pin is dropped.
    assert helper.merged_constraints(pins, installed) == [
        "torch==2.10.0a0+b4e4ee81d3.nv25.12", "megatron-core==0.19.2", "reasoning-gym==0.1.25"]
    with pytest.raises(RuntimeError, match="torch is not installed"):
        helper.merged_constraints(pins, {"numpy": "1.26.4"})
