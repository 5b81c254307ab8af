#!/usr/bin/env bash
# tpx under a real scheduler: a one-host Slurm cluster on this machine (munged, slurmctld and
# slurmd, each started here with a configuration written for this host's cores), stage 03 submitted
# through scripts/cluster/tpx.sbatch at 2 tasks with --check, once launched by srun --mpi=pmix
# and once by mpirun inside the allocation; each job must end COMPLETED with PASS in its output.
# Then stage 02 through scripts/cluster/tpx-requeue.sbatch: requeued (scontrol requeue) after its
# first checkpoint, its next start must resume from it.
# Every daemon it started is stopped on exit, pass or fail; nothing is left running.
#
#   scripts/test-cluster.sh [BUILD_DIR]    (default build; as root: it installs Debian's slurm-wlm
#                                           and munge, and starts the daemons)
#
# ctest runs it under the label `cluster`, outside the default suite: ctest --test-dir build -L cluster
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$(realpath "${1:-build}")
say() { echo "test-cluster: $*"; }
die() {
  echo "test-cluster: error: $*" >&2
  exit 2
}

[[ $(id -u) == 0 ]] || die "run as root: it installs packages and starts slurmctld, slurmd and munged"
for stage in 02_megatron_tp 03_sequence_parallel; do
  [[ -x $build/bin/$stage ]] || die "$build/bin/$stage is not built (scripts/build.sh)"
done

# --- Debian's packages (a no-op when present) -----------------------------------------------------
if ! dpkg -s slurm-wlm munge >/dev/null 2>&1; then
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null; }
fi

# --- the daemons, every file of theirs in one temporary directory, stopped on exit -------------
work=$(mktemp -d /tmp/tpx-slurm-XXXXXX)
chmod 755 "$work"
pids=()
stop_all() {
  local rc=$?
  # Jobs first (their steps belong to slurmd), then the daemons, newest first.
  if [[ -n ${SLURM_CONF:-} ]] && ((${#pids[@]} > 1)); then
    scancel --quiet --full "--partition=tpx" 2>/dev/null || true
    for _ in $(seq 50); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
    # A finished job's slurmstepd ends after squeue forgets it: it removes its socket
    # (<node>_<job>.<step>) from the spool directory when it exits.
    for _ in $(seq 50); do compgen -G "$work/spool/*_*.*" >/dev/null || break; sleep 0.2; done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null || true
      say "process $pid did not stop on SIGTERM: killed"
    fi
  done
  if ((rc != 0)); then
    for log in "$work"/*.log; do [[ -f $log ]] && { echo "--- $log"; tail -n 20 "$log"; }; done
  fi
  rm -rf "$work"
  exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

host=$(hostname -s)
mkdir -p "$work/munge" "$work/state" "$work/spool"
chmod 755 "$work/munge"  # the socket is reached through it; the key stays 0400
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge/munge.key"
socket="$work/munge/munge.socket"
munged --foreground --force --key-file="$work/munge/munge.key" --socket="$socket" \
  --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" \
  --log-file="$work/munged.log" >>"$work/munged.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [[ -S $socket ]] && break; sleep 0.2; done
[[ -S $socket ]] || die "munged did not open $socket"

# This host as the only node: its CPUs, sockets, cores and threads as slurmd -C finds them
# (RealMemory left out: a node reporting less than configured would be drained).
node=$(slurmd -C | head -n 1 | sed -e 's/ RealMemory=[0-9]*//')
[[ $node == NodeName=* ]] || die "slurmd -C printed no node line"
# Ports away from the defaults (6817/6818), so that a cluster already on this host is left alone.
export SLURM_CONF="$work/slurm.conf"
cat >"$SLURM_CONF" <<EOF
ClusterName=tpx
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=tpx Nodes=$host Default=YES MaxTime=30 State=UP
EOF
slurmctld -D -c -f "$SLURM_CONF" >>"$work/slurmctld.log" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >>"$work/slurmd.log" 2>&1 &
pids+=($!)
for _ in $(seq 150); do
  state=$(sinfo -h -o %T 2>/dev/null || true)
  [[ $state == idle ]] && break
  sleep 0.2
done
[[ $state == idle ]] || die "the node did not become idle (sinfo: '${state:-nothing}')"
say "one-host cluster up: $node"

# --- stage 03 at 2 tasks through tpx.sbatch, under each launcher -----------------------------------
source scripts/env.sh  # mpirun as root, one BLAS thread per rank
for launcher in srun mpirun; do
  id=$(TPX_LAUNCHER=$launcher TPX_ROOT=$root TPX_BUILD=$(realpath --relative-to="$root" "$build") \
    sbatch --parsable --nodes=1 --ntasks-per-node=2 --output="$work/job-%j.out" \
    scripts/cluster/tpx.sbatch 03_sequence_parallel --hidden 64 --heads 4 --ffn 128 --seq 16 \
    --batch 2 --layers 2 --steps 2 --check)
  for _ in $(seq 600); do
    [[ -z $(squeue -h -j "$id" 2>/dev/null) ]] && break
    sleep 0.5
  done
  out="$work/job-$id.out"
  job=$(scontrol show job "$id" 2>/dev/null || true)
  echo "--- job $id ($launcher): $out"
  cat "$out" || true
  [[ $job == *"JobState=COMPLETED"* && $job == *"ExitCode=0:0"* ]] ||
    die "job $id ($launcher) did not complete: $(grep -o 'JobState=[A-Z_]* Reason=[^ ]*' <<<"$job")"
  grep -qx PASS "$out" || die "job $id ($launcher): no PASS in its output"
  grep -q "^1 node × 2 ranks per node$" "$out" || die "job $id ($launcher): the header does not say 1 node × 2 ranks"
  say "job $id ($launcher): COMPLETED, PASS"
done

# --- tpx-requeue.sbatch: a checkpoint, a requeue, a new start that resumes from it -----------------
# (--steps far beyond what runs before the job is requeued and, after that, cancelled)
ckpt="$work/ckpt"
id=$(TPX_ROOT=$root TPX_BUILD=$(realpath --relative-to="$root" "$build") TPX_CHECKPOINT=$ckpt \
  TPX_SAVE_EVERY=500 sbatch --parsable --nodes=1 --ntasks-per-node=2 --output="$work/job-%j.out" \
  scripts/cluster/tpx-requeue.sbatch 02_megatron_tp --hidden 32 --heads 4 --ffn 64 --seq 8 \
  --layers 2 --steps 100000000)
out="$work/job-$id.out"
for _ in $(seq 600); do
  compgen -G "$ckpt/step-*/index.json" >/dev/null && break
  sleep 0.2
done
compgen -G "$ckpt/step-*/index.json" >/dev/null || die "job $id (requeue): no checkpoint in $ckpt"
scontrol requeue "$id"
for _ in $(seq 1800); do # Slurm holds a requeued job a while before it starts again
  grep -q "^resumed from $ckpt/step-" "$out" 2>/dev/null && break
  sleep 0.2
done
scancel --quiet "$id" || true
echo "--- job $id (requeue): $out"
grep -v '^ *[0-9]' "$out" || true  # the starts' lines, not their step rows
grep -q "no checkpoint in $ckpt yet, starting from initialisation" "$out" ||
  die "job $id (requeue): its first start did not start from initialisation"
grep -q "^resumed from $ckpt/step-" "$out" ||
  die "job $id (requeue): no start after the requeue resumed from $ckpt"
say "job $id (requeue): started from initialisation, requeued, resumed from its checkpoint"
say "PASS"
