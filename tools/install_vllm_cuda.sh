#!/usr/bin/env bash
# Installs vLLM 0.32.0 (CUDA 13) beside this environment's own torch, e.g. in an NGC PyTorch
# container, for rollout.engine.backend=vllm on GPUs:
#
#     bash tools/install_vllm_cuda.sh            # PYTHON=/path/to/python to choose the interpreter
#
# 1. Refuses a torch other than 2.13 with CUDA 13 (vLLM 0.32.0's compiled kernels are built against
#    torch 2.13.0+cu130; another torch cannot load them).
# 2. pip install --no-deps -r constraints/vllm-cuda.txt: exact versions, nothing resolved, so torch,
#    torchvision/torchaudio/torchcodec, triton, the nvidia-* CUDA libraries and transformers stay the
#    environment's (the file's header says why each is left out).
# 3. Fails if torch's version changed, and prints what `pip check` reports about the vLLM packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
torch_version() { "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'; }
before=$(torch_version)
read -r version cuda <<<"$before"
case "$version/$cuda" in
    2.13.*/13.*) ;;
    *) echo "install_vllm_cuda.sh: vLLM 0.32.0 needs torch 2.13 with CUDA 13; this environment has torch" \
            "$version with CUDA $cuda. Use a base image with that torch, or keep rollout.engine.backend=hf." >&2
       exit 1 ;;
esac
"$PY" -m pip install -q --no-deps -r constraints/vllm-cuda.txt
after=$(torch_version)
if [ "$after" != "$before" ]; then
    echo "install_vllm_cuda.sh: torch changed from $before to $after" >&2
    exit 1
fi
# pip check lists every unmet declared requirement; show those of the packages installed here.
names=$(grep -v '^[#-]' constraints/vllm-cuda.txt | cut -d= -f1 | tr '\n' '|')
"$PY" -m pip check 2>/dev/null | grep -iE "^(${names%|}) " || true
echo "vllm $("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))') installed beside torch $before"
