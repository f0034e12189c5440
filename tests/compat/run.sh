#!/usr/bin/env bash
# Python 3.12 lane, run on request (not part of .ci/run): bash tests/compat/run.sh
#
# What an NGC container user gets: Python 3.12, a torch that is already installed, megatron-core
# 0.19.2, and nemo_sspo installed from its wheel beside that torch. Every run starts from nothing:
#   1. a fresh venv (pyenv's 3.12.1, or $PY312) with torch 2.13.0 from PyPI (a CUDA build, about
#      3.5 GB with its CUDA libraries; it runs on CPU), standing for the container's torch;
#   2. the nemo_sspo wheel, built from this checkout;
#   3. pip --dry-run of the wheel with constraints/py312.txt but WITHOUT freezing torch: the
#      declared ranges alone must leave the installed torch in place;
#   4. the real install through tools/install_beside_torch.py (exactly as the Dockerfile does),
#      then torch.__version__ compared with step 1;
#   5. from a directory outside the checkout: `nemo-sspo train --print-config` and a 2-step run of
#      the tiny random Llama (configs and entry point come from the installed wheel);
#   6. pytest, against the installed package (a copy of tests/ outside the checkout, so the
#      checkout's nemo_sspo/ is not importable): the distributed invariance and mapping tests,
#      the HF mapping unit tests, and an in-process 2-step loop whose updates change the weights.
# Measured on a 2-core machine: see docs/recipes.md ("Containers and Python 3.12").
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
[ -x "$PY312" ] || PY312=python3.12
VENV=${LANE_VENV:-$REPO/.venv-py312}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nemo_sspo_py312.XXXXXX")
PY=$VENV/bin/python
# One thread per process (the machine is shared; the distributed tests spawn up to 4 ranks).
# NO_VCS_VERSION: megatron-core otherwise runs `git rev-parse` next to its files at import.
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NO_VCS_VERSION=1
lane_start=$SECONDS
echo "== work directory $WORK, venv $VENV"

echo "== 1/6 fresh Python 3.12 venv with torch 2.13.0"
rm -rf "$VENV"
"$PY312" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
torch_before=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)

echo "== 2/6 wheel"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO"
wheel=$(ls "$WORK"/dist/nemo_sspo-*.whl)

echo "== 3/6 dry run without a torch constraint"
"$PY" -m pip install -q --dry-run --report "$WORK/dry-run.json" -c "$REPO/constraints/py312.txt" "$wheel[test]"
"$PY" - "$WORK/dry-run.json" <<'EOF'
import json, re, sys
names = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
         for item in json.load(open(sys.argv[1]))["install"]}
assert {"nemo-sspo", "megatron-core"} <= names, sorted(names)
assert "torch" not in names, "pip would replace the installed torch"
print(f"   pip would install {len(names)} packages; torch is not among them")
EOF

echo "== 4/6 install beside torch"
PIP_QUIET=1 "$PY" "$REPO/tools/install_beside_torch.py" "$REPO/constraints/py312.txt" "$wheel[test]"
torch_after=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
if [ "$torch_before" != "$torch_after" ]; then
    echo "torch changed: $torch_before -> $torch_after" >&2
    exit 1
fi
install_s=$((SECONDS - lane_start))
versions=$("$PY" -c 'import sys, importlib.metadata as m
print(f"python {sys.version.split()[0]}", *(f"{p} {m.version(p)}" for p in ("torch", "megatron-core", "transformers", "nemo_sspo")), sep=", ")')
echo "   $versions; torch kept: $torch_after; install took ${install_s}s"

echo "== 5/6 CLI from $WORK (outside the checkout)"
cd "$WORK"
"$VENV/bin/nemo-sspo" train --print-config model=tiny_random > print-config.yaml
grep -q "source: tiny-random-llama" print-config.yaml
"$VENV/bin/nemo-sspo" train model=tiny_random trainer.max_steps=2 rollout.prompts_per_step=2 \
    rollout.samples_per_prompt=4 rollout.sampling.max_new_tokens=24 parallel.micro_batch_size=2 \
    reward.options.num_workers=1 trainer.output_dir="$WORK/run" > cli-run.log 2>&1 || { tail -40 cli-run.log; exit 1; }
"$PY" - "$WORK/run" <<'EOF'
import json, math, pathlib, sys
run = pathlib.Path(sys.argv[1])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
assert [r["step"] for r in records] == [1, 2], records
assert all(math.isfinite(v) for r in records for v in r.values())
# fp32 rollout and trainer log-probs from the same weights differ by rounding only
assert all(r["rollout/trainer_logprob_gap_abs"] < 1e-3 for r in records)
assert (run / "hf_checkpoint" / "config.json").is_file()
print(f"   2 steps, reward/mean {[r['reward/mean'] for r in records]}, HF checkpoint written")
EOF

echo "== 6/6 tests against the installed package"
mkdir -p "$WORK/suite"
cp -r "$REPO/tests" "$REPO/pyproject.toml" "$WORK/suite/"
cd "$WORK/suite"
"$PY" -c 'import nemo_sspo; assert "site-packages" in nemo_sspo.__file__, nemo_sspo.__file__'
tests_start=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider tests/distributed tests/unit/megatron/test_hf_mapping.py \
    tests/unit/megatron/test_qwen2_mapping.py \
    "tests/integration/test_refit.py::test_updates_change_weights_and_refit_follows"
echo "== py312 lane passed: $versions; install ${install_s}s, tests $((SECONDS - tests_start))s, total $((SECONDS - lane_start))s"
rm -rf "$WORK"
