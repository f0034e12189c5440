#!/usr/bin/env bash
# A real Slurm check on this machine (not part of the pytest suite; run it by hand as root):
#   1. installs Debian's slurm-wlm and munge with apt (skipped when already installed),
#   2. starts munged, slurmctld and slurmd as a one-node cluster (config in a temp dir),
#   3. submits the CPU tiny run (model=tiny_random, 2 steps) through examples/slurm/sspo.sbatch
#      with 1 task (the script runs one torchrun agent per node) x 2 workers, twice: as pipeline
#      parallel PP=2 over gloo (PP=2 refuses world size 1), and with the separate rollout placement
#      (1 training rank + 1 rollout rank, rollout.schedule.num_ranks=1),
#   4. waits for each, checks it COMPLETED with exit code 0 and metrics.jsonl holds 2 finite steps,
#   5. stops the daemons it started.
#
#   bash tests/slurm/run_slurm_check.sh            # PYTHON=... to pick the interpreter (default .venv)
# Exit code 0 = pass. Every command and its output go to stdout; the job's log is printed at the end.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
python_bin=${PYTHON:-${repo}/.venv/bin/python}
[[ -x "${python_bin}" ]] || python_bin=$(command -v python3)
work=$(mktemp -d /tmp/nemo-sspo-slurm.XXXXXX)
host=$(hostname -s)
pids=()

log() { echo "[slurm-check] $*"; }
as_root() { if [[ $(id -u) == 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  log "needs root (or sudo) for: $*"; exit 3; fi; }

cleanup() {
  for pid in "${pids[@]}"; do as_root kill "${pid}" 2>/dev/null || true; done
  log "stopped daemons ${pids[*]:-none}; files kept in ${work}"
}
trap cleanup EXIT

# ---- 1. packages ---------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurm-wlm and munge"
  # No service starts during install: this script starts the daemons itself (no systemd here).
  printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
  as_root chmod +x /usr/sbin/policy-rc.d
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
  as_root rm -f /usr/sbin/policy-rc.d
fi
log "$(slurmctld -V), munge $(munged --version 2>&1 | head -1)"

# ---- 2. munge + one-node cluster -----------------------------------------------------------------
as_root mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[[ -s /etc/munge/munge.key ]] || as_root mungekey --create --keyfile /etc/munge/munge.key
as_root chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
as_root chmod 0700 /etc/munge && as_root chmod 0400 /etc/munge/munge.key
as_root runuser -u munge -- munged --pid-file "/run/munge/munged.pid"
pids+=("$(cat /run/munge/munged.pid)")
munge -n | unmunge >/dev/null && log "munge works"

cpus=$(nproc --all)  # all of them: plain nproc gives OMP_NUM_THREADS, and a 1-CPU node never starts 2 tasks
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
mkdir -p "${work}"/{state,spool,log}
cat > "${work}/slurm.conf" <<EOF
ClusterName=sspocheck
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=${work}/state
SlurmdSpoolDir=${work}/spool
SlurmctldPidFile=${work}/slurmctld.pid
SlurmdPidFile=${work}/slurmd.pid
SlurmctldLogFile=${work}/log/slurmctld.log
SlurmdLogFile=${work}/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=check Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="${work}/slurm.conf"
as_root env SLURM_CONF="${SLURM_CONF}" slurmctld
as_root env SLURM_CONF="${SLURM_CONF}" slurmd
sleep 3
pids+=("$(cat "${work}/slurmctld.pid")" "$(cat "${work}/slurmd.pid")")
for _ in $(seq 30); do sinfo -h -o '%t' | grep -qE '^(idle|mix)' && break; sleep 1; done
sinfo

# ---- 3.-4. tiny CPU runs through the production sbatch script, each waited for and checked ----------
# run_job NAME OVERRIDES...: submits 1 task x 2 workers, waits, checks COMPLETED 0:0 and 2 finite steps.
run_job() {
  local name=$1; shift
  local out="${work}/${name}" job state exit_code
  cd "${work}"
  job=$(NPROC_PER_TASK=2 NEMO_SSPO_PYTHON="${python_bin}" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \
    sbatch --parsable --ntasks 1 --gpus-per-node 0 --cpus-per-task 2 --time 30:00 \
    --output "${work}/job-%j.out" "${repo}/examples/slurm/sspo.sbatch" \
    model=tiny_random trainer.max_steps=2 rollout.prompts_per_step=2 rollout.samples_per_prompt=4 \
    rollout.sampling.max_new_tokens=24 parallel.micro_batch_size=2 reward.options.num_workers=1 optim.lr=1e-3 \
    "trainer.output_dir=${out}" "$@")
  log "${name}: submitted job ${job}"
  for i in $(seq 900); do
    state=$(scontrol show job "${job}" | grep -oP 'JobState=\K\S+')
    [[ "${state}" =~ ^(PENDING|CONFIGURING|RUNNING|COMPLETING)$ ]] || break
    if [[ "${state}" == PENDING && ${i} -gt 30 ]]; then  # an idle one-node cluster starts it at once
      log "FAIL ${name}: still pending after 60 s: $(scontrol show job "${job}" | grep -oP 'Reason=\S+')"
      scancel "${job}"; exit 1
    fi
    sleep 2
  done
  scontrol show job "${job}" | grep -E 'JobState|ExitCode|NumTasks|NodeList=' || true
  log "${name}: job log:"; grep -v -i warn "${work}/job-${job}.out" | tail -40
  exit_code=$(scontrol show job "${job}" | grep -oP ' ExitCode=\K\S+')
  [[ "${state}" == COMPLETED && "${exit_code}" == 0:0 ]] || { log "FAIL ${name}: state=${state} exit=${exit_code}"; exit 1; }
  "${python_bin}" - "${out}/metrics.jsonl" "${name}" <<'PY'
import json, math, sys
records = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in records] == [1, 2], records
for r in records:
    assert all(math.isfinite(v) for v in r.values()), r
    assert 0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0
    assert "timing/train_s" in r and "policy/entropy" in r
print(f"[slurm-check] {sys.argv[2]}: metrics ok: 2 steps, loss/policy {[round(r['loss/policy'], 5) for r in records]}")
PY
}

# PP=2 over gloo: it can only start when both Slurm tasks joined one rendezvous (PP=2 refuses world size 1)
run_job pp2 parallel=pp2
# the separate placement: the world's last rank (one task's worker) generates, the other trains
run_job separate rollout.schedule.placement=separate rollout.schedule.num_ranks=1
log "PASS"
