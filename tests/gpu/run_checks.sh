#!/usr/bin/env bash
# GPU checks for nemo_sspo on ONE CUDA GPU (H100/H200 class), sized for the lent GPU machine: Python 3.12
# with torch 2.11 (CUDA 13), triton 3.6 and transformers 5.17, no megatron-core, vLLM or TransformerEngine,
# no package registry, at most 64 MiB of files with the working tree. Everything else comes from a wheel
# bundle built beforehand on a machine with a registry (`bash tools/gpu_bundle.sh .gpu_bundle`, about
# 30 MiB); this script installs it with --no-index --no-deps into a venv that sees the machine's own
# packages (--system-site-packages), so the machine's torch is used and never replaced.
#
#   bash tests/gpu/run_checks.sh --bundle .gpu_bundle            # every group, from the bundle
#   bash tests/gpu/run_checks.sh --bundle .gpu_bundle kernels    # only some groups: kernels train vllm te async refit
#   bash tests/gpu/run_checks.sh --bundle .gpu_bundle --dry-run  # CPU: the bundle installs, the scripts import
#   bash tests/gpu/run_checks.sh                                 # a full environment (.venv), no bundle
#
# Groups (each prints "PASS <name>: <numbers>", "FAIL <name>: <why>" or "SKIP <name>: <why>"); about 5
# minutes in all on the lent machine (install 30 s, kernels at most 90 s, train at most 240 + 180 s):
#   kernels: tests/gpu/gpu_checks.py fused: the Triton kernels of the log-prob/entropy reduction
#      (nemo_sspo.parallel.triton_chunk) against its torch path (NEMO_SSPO_TRITON=0) at N=4096,
#      V_local=75,968 (Qwen2.5-7B's vocabulary at TP 2), H=3584, bf16: accuracy against float64; median
#      times on materialised logits against the floor of moving the logits once at the copy bandwidth
#      measured in the same run; the fused output layer (chunk 1024) against its matmuls alone.
#   train: tests/gpu/gpu_checks.py train: Megatron local-spec bf16 policy at SmolLM2-135M's shape with random
#      weights (the bundle's smollm2_shape/: config and tokenizer, no weights), HF-engine rollouts, 3 GRPO steps
#      of 64 responses: step time by phase, generation and training tokens/s, peak memory, MFU. Then
#      tests/gpu/gpu_checks.py memory: the memory plan's training phase against torch.cuda.max_memory_allocated
#      (limit 10%) for the same shape in bf16 with the distributed optimizer, one micro-batch of 4 x 2,048
#      tokens, two updates each with parallel.recompute=none and full.
#   vllm (needs vLLM and SmolLM2's weights, i.e. a full environment; otherwise SKIP): tests/gpu/gpu_checks.py
#      vllm (bf16 engine: log-prob gap, streamed refit, sleep/wake) and a 2-step train run with vLLM rollouts.
#   te (needs TransformerEngine; otherwise SKIP): FP8 train step, THD packed log-probs, packed train step.
#   async: tests/gpu/gpu_checks.py async: rollout.schedule.placement=separate on one GPU, at SmolLM2-135M's shape with
#      random weights: 1 training rank (BF16 policy, NCCL default group) + 2 rollout ranks (HF engines on the
#      same GPU: LOCAL_RANK modulo the GPUs visible), 2 steps with max_staleness=0 against the colocated run of
#      the same seed (rewards equal, loss and grad norm within 1e-3), and the broadcast's s/GB. Rollouts and
#      the bucketed weight broadcast go over gloo with host tensors (two rollout ranks share the one GPU, which
#      NCCL refuses, so the refit group stays gloo there).
#   refit: tests/gpu/refit_checks.py device: a bf16 Megatron export at SmolLM2-135M's shape, bucketed on the GPU,
#      encoded for the NCCL refit group's device and for gloo's, loaded into a bf16 HF engine on the GPU with the
#      rollout.refit.verify check: bytes_to_host 0 on the device path, seconds per GB of both paths; then the
#      engine/trainer log-prob gap with model.output_layer_precision auto and fp32. With 2+ GPUs,
#      tests/gpu/refit_checks.py nccl under torchrun: 1 GiB broadcast over the NCCL refit group, received on the
#      GPU bit for bit (SKIP with one GPU).
# Exit status: 0 when nothing failed, 1 otherwise, 2 without a GPU (real run) or for a bad argument.
#
# Run so far: the dry run on CPU (tests/unit/test_gpu_bundle.py). The kernels, train, vllm, te and async groups
# have NOT RUN on a GPU yet (none was lent to the sessions that wrote them): expect the first GPU run to
# need small fixes; read its FAIL lines.
set -u
cd "$(dirname "$0")/../.."
BUNDLE="" DRY=0 GROUPS_WANTED=""
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) BUNDLE=${2:?--bundle needs a folder}; shift 2;;
    --dry-run) DRY=1; shift;;
    kernels|train|vllm|te|async|refit) GROUPS_WANTED="$GROUPS_WANTED $1"; shift;;
    *) echo "unknown argument '$1': use --bundle DIR, --dry-run and groups kernels, train, vllm, te, async, refit" >&2; exit 2;;
  esac
done
GROUPS_WANTED=${GROUPS_WANTED:-kernels train vllm te async refit}
want() { [[ " $GROUPS_WANTED " == *" $1 "* ]]; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NO_VCS_VERSION=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nemo_sspo_gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
status=0

# What the GPU machine has besides its Python (its torch, transformers and what they require): the dry run
# accepts these as provided by that machine when the CPU host lacks them; a real run needs them installed.
MACHINE_PROVIDES="torch triton transformers numpy safetensors tokenizers sympy mpmath packaging pyyaml tqdm
  huggingface-hub regex filelock fsspec jinja2 markupsafe networkx typing-extensions"

if [ -n "$BUNDLE" ]; then
  [ -d "$BUNDLE/wheels" ] || { echo "no $BUNDLE/wheels: build the bundle with bash tools/gpu_bundle.sh $BUNDLE" >&2; exit 2; }
  BASE=${PYTHON:-python3}
  [ "$DRY" = 1 ] && BASE=${PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3.12}
  [ -x "$BASE" ] || BASE=$(command -v "$BASE") || { echo "no Python 3.12 interpreter: set PYTHON" >&2; exit 2; }
  if "$BASE" -m venv --system-site-packages "$WORK/venv" >/dev/null 2>&1; then
    # --system-site-packages sees the base installation's packages only; when BASE is itself a venv (or
    # keeps packages in the user site), those folders are added too, so the torch BASE imports is the
    # torch the checks import.
    "$BASE" -c 'import site; print("\n".join([*site.getsitepackages(), site.getusersitepackages()]))' \
        > "$(echo "$WORK"/venv/lib/python3*/site-packages)/base.pth"
    PY=$WORK/venv/bin/python INSTALL=("$WORK/venv/bin/python" -m pip install)
  else  # no ensurepip (e.g. a system Python without its venv package): a --target folder on PYTHONPATH
    echo "     python -m venv is unavailable for $BASE: installing into $WORK/site with pip --target instead"
    PY=$BASE INSTALL=("$BASE" -m pip install --target "$WORK/site")
    export PYTHONPATH=$WORK/site:$PYTHONPATH
  fi
  start=$SECONDS
  "${INSTALL[@]}" -q --no-compile --no-index --no-deps --find-links "$BUNDLE/wheels" "$BUNDLE"/wheels/*.whl || {
    echo "FAIL bundle install: pip could not install $BUNDLE/wheels offline"; exit 1; }
  # Every requirement of a bundle wheel is installed (or, in the dry run, provided by the GPU machine);
  # nothing else runs from an incomplete bundle. A machine package outside a wheel's declared range is
  # reported (WARN) but not fatal: the machine's versions are what they are, and the checks will tell.
  "$PY" - "$BUNDLE/wheels" "$DRY" $MACHINE_PROVIDES <<'EOF' || exit 1
import importlib.metadata as md, pathlib, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels, dry, provided = pathlib.Path(sys.argv[1]), sys.argv[2] == "1", {norm(n) for n in sys.argv[3:]}
installed = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
missing, outside = [], []
for wheel in sorted(wheels.glob("*.whl")):
    dist = md.distribution(wheel.name.split("-")[0])
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = installed.get(norm(req.name))
        if have is None and dry and norm(req.name) in provided:
            continue
        if have is None:
            missing.append(f"{dist.metadata['Name']} needs {req} (installed: None)")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            outside.append(f"{dist.metadata['Name']} declares {req}, the machine has {have}")
if outside:
    print("WARN bundle requirements: " + "; ".join(outside))
print(("FAIL bundle requirements: " + "; ".join(missing)) if missing else
      f"PASS bundle requirements: {len(list(wheels.glob('*.whl')))} wheels installed offline, every requirement met"
      + (" (or provided by the GPU machine)" if dry else ""))
sys.exit(1 if missing else 0)
EOF
  echo "---- bundle install: $((SECONDS - start)) s, $("$PY" -c 'import sys; print("Python", sys.version.split()[0])')"
else
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
fi

if [ "$DRY" = 1 ]; then
  # The bundle's modules import on Python 3.12 (those needing the GPU machine's packages say which), the
  # scripts compile there, and the checks' own imports and configs work in the development environment.
  "$PY" - $MACHINE_PROVIDES <<'EOF' || status=1
import importlib, py_compile, re, sys
provided = {re.sub(r"[-_.]+", "_", n).lower() for n in sys.argv[1:]} | {"yaml"}
for module in ("hydra", "omegaconf", "antlr4", "math_verify", "latex2sympy2_extended", "matplotlib", "megatron.core"):
    try:
        importlib.import_module(module)
        print(f"     import {module}: ok")
    except ModuleNotFoundError as err:
        if err.name.split(".")[0] not in provided:
            raise
        print(f"     import {module}: needs {err.name}, which the GPU machine has")
py_compile.compile("tests/gpu/gpu_checks.py", doraise=True)
py_compile.compile("tests/gpu/refit_checks.py", doraise=True)
print(f"PASS bundle imports: Python {sys.version.split()[0]}")
EOF
  bash -n "$0" || status=1
  if [ -n "$BUNDLE" ]; then
    DEV=${DEV_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
    PYTHONPATH=$PWD "$DEV" tests/gpu/gpu_checks.py dry-run "$BUNDLE/smollm2_shape" || status=1
    PYTHONPATH=$PWD "$DEV" tests/gpu/refit_checks.py dry-run "$BUNDLE/smollm2_shape" || status=1
  fi
  [ $status -eq 0 ] && echo "DRY RUN PASSED (nothing ran on a GPU)" || echo "DRY RUN FAILED (see FAIL lines)"
  exit $status
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA GPU visible (torch.cuda.is_available() is False): these checks need one; nothing was run" >&2; exit 2
fi
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

run() {  # run NAME SECONDS CMD...: FAIL line when the command fails or times out
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "---- $name: rc=$rc, $((SECONDS - start)) s"
  if [ $rc -ne 0 ]; then echo "FAIL $name: exit status $rc (124 = timed out after $limit s)"; status=1; fi
}

if want kernels; then
  run fused 90 "$PY" tests/gpu/gpu_checks.py fused
fi

if want train; then
  MODEL_DIR=${BUNDLE:+$BUNDLE/smollm2_shape}
  if [ -z "$MODEL_DIR" ]; then
    MODEL_DIR=$("$PY" -c "from nemo_sspo.models.hf_checkpoint import engine_model_dir; print(engine_model_dir('smollm2-135m-instruct'))")
  fi
  run "train step" 240 "$PY" tests/gpu/gpu_checks.py train "$MODEL_DIR"
  run "memory plan" 180 "$PY" tests/gpu/gpu_checks.py memory "$MODEL_DIR"
fi

HAVE_VLLM=0; "$PY" -c "import vllm" 2>/dev/null && HAVE_VLLM=1
HAVE_TE=0; "$PY" -c "import transformer_engine" 2>/dev/null && HAVE_TE=1
IMPL=local; [ $HAVE_TE = 1 ] && IMPL=transformer_engine
TRAIN=(model=smollm2_135m model.precision=bf16 trainer.max_steps=2 rollout.prompts_per_step=4
       rollout.samples_per_prompt=4 rollout.sampling.max_new_tokens=128 parallel.micro_batch_size=4
       trainer.save_hf_checkpoint=false reward.options.num_workers=2 rollout.refit.bucket_mb=64)
VLLM=(rollout/engine=vllm rollout.engine.options.enable_sleep_mode=true rollout.engine.options.gpu_memory_utilization=0.3
      rollout.engine.options.enforce_eager=true rollout.engine.options.max_model_len=1024)

if want vllm; then
  if [ $HAVE_VLLM = 0 ]; then
    echo "SKIP vllm: vllm does not import here (the lent machine has none and its wheels exceed the 64 MiB that travel)"
  else
    run vllm 180 "$PY" tests/gpu/gpu_checks.py vllm
    run "bf16 train step ($IMPL, vLLM)" 180 "$PY" -m nemo_sspo.cli train "${TRAIN[@]}" "${VLLM[@]}" \
        model.transformer_impl=$IMPL "trainer.output_dir=$WORK/bf16"
    run "bf16 metrics" 30 "$PY" tests/gpu/gpu_checks.py metrics "$WORK/bf16" 0.05
  fi
fi

if want te; then
  if [ $HAVE_TE = 0 ]; then
    echo "SKIP te: transformer_engine does not import here; the FP8 step and the THD packed checks need it"
  else
    run "fp8 train step" 150 "$PY" -m nemo_sspo.cli train "${TRAIN[@]}" rollout.engine.backend=hf \
        model.transformer_impl=transformer_engine model.fp8=hybrid model.fp8_recipe=delayed "trainer.output_dir=$WORK/fp8"
    run "fp8 metrics" 30 "$PY" tests/gpu/gpu_checks.py metrics "$WORK/fp8" 0.25
    run "packed thd log-probs" 90 "$PY" tests/gpu/gpu_checks.py packed
    run "packed train step" 120 "$PY" -m nemo_sspo.cli train "${TRAIN[@]}" rollout.engine.backend=hf \
        model.transformer_impl=transformer_engine parallel.pack_sequences=true parallel.max_tokens_per_micro_batch=1024 \
        "trainer.output_dir=$WORK/packed"
    run "packed metrics" 30 "$PY" tests/gpu/gpu_checks.py metrics "$WORK/packed" 0.05
  fi
fi

if want async; then
  ASYNC_MODEL=${BUNDLE:+$BUNDLE/smollm2_shape}
  if [ -z "$ASYNC_MODEL" ]; then
    ASYNC_MODEL=$("$PY" -c "from nemo_sspo.models.hf_checkpoint import engine_model_dir; print(engine_model_dir('smollm2-135m-instruct'))")
  fi
  run "async colocated reference" 180 "$PY" tests/gpu/gpu_checks.py async "$ASYNC_MODEL" "$WORK/async"
  run "async separate, 1 training + 2 rollout ranks" 240 "$PY" -m torch.distributed.run --nproc-per-node=3 \
      tests/gpu/gpu_checks.py async "$ASYNC_MODEL" "$WORK/async"
  run "async compare" 30 "$PY" tests/gpu/gpu_checks.py async-compare "$WORK/async"
fi

if want refit; then
  REFIT_MODEL=${BUNDLE:+$BUNDLE/smollm2_shape}
  if [ -z "$REFIT_MODEL" ]; then
    REFIT_MODEL=$("$PY" -c "from nemo_sspo.models.hf_checkpoint import engine_model_dir; print(engine_model_dir('smollm2-135m-instruct'))")
  fi
  run "device-resident refit" 180 "$PY" tests/gpu/refit_checks.py device "$REFIT_MODEL"
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run "nccl refit broadcast" 120 "$PY" -m torch.distributed.run --nproc-per-node=2 tests/gpu/refit_checks.py nccl
  else
    echo "SKIP nccl refit broadcast: one GPU visible; the NCCL weight broadcast between two processes needs 2"
  fi
fi

[ $status -eq 0 ] && echo "ALL GPU CHECKS PASSED" || echo "SOME GPU CHECKS FAILED (see FAIL lines)"
exit $status
