#!/usr/bin/env bash
# scripts/cluster/tpx-requeue.sbatch without Slurm (run by bash, its ranks by mpirun): the first
# start finds no checkpoint and starts from initialisation; a requeued start resumes from the
# newest valid step-<N> and ignores a step-<N>.tmp that a cut-off save left; the time limit's
# USR1 requeues the job (a stand-in scontrol records it); a missing TPX_CHECKPOINT is refused.
#
#   tests/requeue_sbatch_test.sh <source root> <build dir> <mpiexec> [mpiexec flags...]
set -uo pipefail
root=$1
build=$2
mpiexec=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The script's mpirun, at 2 ranks whatever the host's core count; scontrol recording its calls.
mkdir "$tmp/bin"
printf '#!/bin/sh\nexec %q %s -np 2 "$@"\n' "$mpiexec" "$*" >"$tmp/bin/mpirun"
printf '#!/bin/sh\necho "$*" >>%q\n' "$tmp/scontrol.calls" >"$tmp/bin/scontrol"
chmod +x "$tmp/bin/mpirun" "$tmp/bin/scontrol"
export PATH="$tmp/bin:$PATH" TPX_LAUNCHER=mpirun TPX_ROOT=$root
TPX_BUILD=$(realpath --relative-to="$root" "$build")
export TPX_BUILD TPX_CHECKPOINT=$tmp/ckpt TPX_SAVE_EVERY=2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
export OMPI_MCA_rmaps_base_oversubscribe=1
shape=(--hidden 32 --heads 4 --ffn 64 --seq 8 --layers 2 --optimizer adamw --lr 1e-3)
job() { bash "$root/scripts/cluster/tpx-requeue.sbatch" 02_megatron_tp "${shape[@]}" "$@"; }

status=0
fail() {
  echo "FAIL: $*"
  status=1
}
# expect <what> <log> <regex>
expect() { grep -Eq -- "$3" "$2" || fail "$1: no line matching '$3' in:" "$(cat "$2")"; }

# The first start: nothing to resume; checkpoints at steps 2 and 4.
job --steps 4 >"$tmp/first.log" 2>&1 || fail "first start exited $?: $(cat "$tmp/first.log")"
expect "first start" "$tmp/first.log" 'no checkpoint in .* starting from initialisation'
grep -q 'resumed from' "$tmp/first.log" && fail "the first start resumed"
for n in 2 4; do [[ -f $tmp/ckpt/step-$n/index.json ]] || fail "no checkpoint step-$n"; done

# Preempted while saving step 6: only step-6.tmp. The next start resumes from step 4.
mkdir -p "$tmp/ckpt/step-6.tmp"
job --steps 6 >"$tmp/second.log" 2>&1 || fail "requeued start exited $?: $(cat "$tmp/second.log")"
expect "requeued start" "$tmp/second.log" 'resuming from'
expect "requeued start" "$tmp/second.log" "resumed from $tmp/ckpt/step-4 \\(step 4\\)"
expect "requeued start" "$tmp/second.log" '^ +5 '
grep -Eq '^ +3 ' "$tmp/second.log" && fail "the requeued start ran step 3 again"
[[ -f $tmp/ckpt/step-6/index.json ]] || fail "no checkpoint step-6 after the requeued start"

# USR1 (sbatch --signal=B:USR1@120, the time limit near): the job requeues itself.
SLURM_JOB_ID=77 bash "$root/scripts/cluster/tpx-requeue.sbatch" 02_megatron_tp "${shape[@]}" \
  --steps 100000 >"$tmp/signal.log" 2>&1 & # $! is the script's shell itself
pid=$!
for _ in $(seq 100); do
  grep -q 'resumed from' "$tmp/signal.log" && break
  sleep 0.2
done
kill -USR1 "$pid"
sleep 1
kill -0 "$pid" 2>/dev/null || fail "the job ended at USR1 (it must go on until Slurm ends it)"
pkill -TERM -P "$pid" 2>/dev/null # the stage's mpirun; the script's wait then returns
wait "$pid" 2>/dev/null
[[ $(cat "$tmp/scontrol.calls" 2>/dev/null) == "requeue 77" ]] ||
  fail "USR1 did not run 'scontrol requeue 77': $(cat "$tmp/scontrol.calls" 2>/dev/null)" \
    "$(cat "$tmp/signal.log")"
expect "USR1" "$tmp/signal.log" 'the time limit is near: requeueing job 77'

# No checkpoint directory named: one line, exit 2.
TPX_CHECKPOINT='' job --steps 2 >"$tmp/bad.log" 2>&1
code=$?
[[ $code == 2 ]] || fail "TPX_CHECKPOINT unset: exit $code, not 2"
expect "TPX_CHECKPOINT unset" "$tmp/bad.log" 'error: TPX_CHECKPOINT must name'

[[ $status == 0 ]] && echo "PASS"
exit "$status"
