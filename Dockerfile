# nemo_sspo on an NGC PyTorch container, which brings Python 3.12, CUDA, cuDNN, NCCL,
# TransformerEngine (for the BF16/FP8 layer spec) and Apex.
#
#   docker build -t nemo-sspo:0.1.0 .
#   nemo-sspo data prepare --out /data/sspo_math        # once, on a machine with network (docs/data.md)
#   docker run --gpus all --ipc=host -v /data/sspo_math:/data -e NEMO_SSPO_DATA_DIR=/data \
#     -v $HOME/.cache/huggingface:/root/.cache/huggingface nemo-sspo:0.1.0 \
#     torchrun --nproc-per-node 8 -m nemo_sspo.cli train --config-name sspo_qwen2.5_math_1.5b
# With Slurm + pyxis: CONTAINER_IMAGE=<this image> sbatch examples/slurm/sspo.sbatch ...
#
# The package is installed exactly as the Python 3.12 lane (tests/compat/run.sh) installs it:
# a wheel, through tools/install_beside_torch.py with constraints/py312.txt. That script freezes
# the image's own torch build, applies our exact pins (megatron-core 0.19.2, transformers 5.24.0,
# ...) only to packages the image does not have, keeps the image's packages that are inside
# nemo_sspo's declared ranges, and fails if torch changed. The image's own pip constraints
# (PIP_CONSTRAINT) stay in force; if one of them contradicts our ranges, pip stops with the name.
#
# Proven with: the Python 3.12 lane on CPU (Python 3.12.1, PyPI torch 2.13.0+cu130,
# megatron-core 0.19.2, transformers 5.24.0; see docs/recipes.md, "Containers and Python 3.12").
# This image itself was not built or run here (no Docker daemon, no GPU, no NGC registry access):
# base tag, TransformerEngine import and the GPU path are unverified.
#
# vLLM (rollout.engine.backend=vllm, which the Qwen2.5-Math recipes use): vllm 0.32.0 for CUDA 13, installed
# beside the image's torch by tools/install_vllm_cuda.sh from constraints/vllm-cuda.txt with
# --no-deps. It replaces nothing: torch, torchvision/torchaudio/torchcodec, triton, the CUDA
# libraries and transformers stay as they are (a plain `pip install vllm` would replace the image's
# torch with PyPI's 2.13.0 build). It needs the image's torch to be 2.13 with CUDA 13 and stops the
# build otherwise; WITH_VLLM=0 builds without vLLM (then use rollout.engine.backend=hf).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}
ARG WITH_VLLM=1

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /opt/nemo_sspo
COPY pyproject.toml README.md ./
COPY nemo_sspo ./nemo_sspo
COPY constraints ./constraints
COPY tools ./tools
COPY examples ./examples
COPY docs ./docs

RUN python -m pip wheel --no-deps -w /tmp/dist . \
 && python tools/install_beside_torch.py constraints/py312.txt /tmp/dist/nemo_sspo-*.whl \
 && rm -rf /tmp/dist \
 && if [ "$WITH_VLLM" = 1 ]; then bash tools/install_vllm_cuda.sh; fi \
 && cd / && WORLD_SIZE=8 nemo-sspo train --print-config --config-name sspo_qwen2.5_math_7b > /dev/null \
 && python -c "import megatron.core, transformer_engine, torch; print('nemo_sspo ready: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
