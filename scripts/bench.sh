#!/usr/bin/env bash
# The benchmarks: set up, build what they need, run tools/bench.py (every stage over N = 1, 2, 4,
# stage 07 on the meshes D × TP = 1 × 2, 2 × 1, 2 × 2, and two or more configs; stage 08 in its
# own subsection: C × TP = 2 × 1, 1 × 2, 2 × 2 at S = 128 and 512 beside stage 03, and its
# attention time against S for C = 1, 2, 4; stage 09 in its own subsection: each schedule at
# P = 2 and 4 over M = 1, 2, 4, 8, its measured bubble against the formula's; the
# micro-benchmarks, the projection), and write docs/benchmarks.md (its device's section and the
# projection; the other device's section stays), the CSVs docs/benchmarks/<device>.csv,
# <device>_cp.csv, <device>_cp_attention.csv, <device>_pp.csv and the plots
# docs/figures/bench_<device>_*.svg.
#
#   scripts/bench.sh [--quick] [--device cpu|cuda] [--repeats R] [--out DIR]
#                    [--stages 04,05] [--ranks 2,4] [--model NAME | --config FILE]
#                    [--only cp|pp]
#   scripts/bench.sh --from-logs DIR [--from-logs DIR2 …] [--out DIR]
#
#   --quick        1 repeat, N = 1, 2, 3 steps, collectives up to 64K, the default config only
#   --device       cpu (default) or cuda (on a GPU machine)
#   --repeats R    runs per point (default 3): the tables give the median and the min–max spread
#   --out DIR      write benchmarks.md, benchmarks/ and figures/ under DIR instead of docs/
#   --stages LIST  only these stages, by number or name (04,05 or 04_overlap_ring)
#   --ranks LIST   only these rank counts N (2,4)
#   --model NAME   one config, the preset NAME, given to every stage and to tpx_project
#   --config FILE  one config, the file FILE, likewise
#   (with --stages, --ranks, --model or --config the page goes to out/bench/<device>/page/
#   unless --out is given; its text says what ran)
#   --only cp      only stage 08's subsection (bench_gemm's peak first), the rest of the page
#                  as it is: what to run after a change to stage 08
#   --only pp      only stage 09's subsection, likewise: what to run after a change to stage 09
#   --from-logs DIR  publish a GPU run made elsewhere: the CUDA section, docs/benchmarks/
#                  cuda_run.csv and docs/figures/bench_cuda_attention.svg written from the logs
#                  of DIR (a folder of docs/gpu-runs/, as scripts/gpu-validate.sh left it) by
#                  tools/gpu_logs.py; nothing is built or run, and a log that lacks a line the
#                  section needs stops it, naming the file. Given again, newest run first, the
#                  section keeps every run, each labelled with its GPU (an earlier run's CSV and
#                  figure carry its folder's name). ctest's docs.from_logs fails when the
#                  committed section differs from what the logs give.
#
# The build: TPX_BENCH_BUILD (default: build-bench-cpu for --device cpu, configured cpu-only
# without tests and docs so that it builds in a few minutes; build/ for --device cuda). An existing
# build is used as it is configured, e.g. TPX_BENCH_BUILD=build scripts/bench.sh. Raw --json files
# and logs go to out/bench/<device>/.
set -euo pipefail
cd "$(dirname "$0")/.."

args=("$@")
device=cpu
stages=
only=
from_logs=
while [ $# -gt 0 ]; do
  case $1 in
    --device)
      device=${2:-}
      shift 2 || shift
      ;;
    --device=*)
      device=${1#*=}
      shift
      ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    --stages)
      stages=${2:-}
      shift 2 || shift
      ;;
    --stages=*)
      stages=${1#*=}
      shift
      ;;
    --only)
      only=${2:-}
      shift 2 || shift
      ;;
    --only=*)
      only=${1#*=}
      shift
      ;;
    --from-logs)
      from_logs=${2:-}
      shift 2 || shift
      ;;
    --from-logs=*)
      from_logs=${1#*=}
      shift
      ;;
    *) shift ;;
  esac
done
case $device in
  cpu | cuda) ;;
  *)
    echo "bench: --device must be cpu or cuda, not '$device'" >&2
    exit 2
    ;;
esac

[ -z "$from_logs" ] && scripts/setup.sh

# A python3 that can draw (matplotlib comes from Debian's python3-matplotlib, whose python is
# /usr/bin/python3: another python3 earlier on PATH may lack it).
py=
for candidate in python3 /usr/bin/python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import matplotlib' 2>/dev/null; then
    py=$candidate
    break
  fi
done
if [ -z "$py" ]; then
  echo "bench: no python3 with matplotlib (install Debian's python3-matplotlib: scripts/setup.sh)" >&2
  exit 1
fi

if [ -n "$from_logs" ]; then # no build, no runs: the logs' numbers, parsed
  exec "$py" tools/bench.py --command "scripts/bench.sh${args[*]:+ ${args[*]}}" "${args[@]}"
fi

build=${TPX_BENCH_BUILD:-}
if [ -z "$build" ]; then
  if [ "$device" = cpu ]; then build="build-bench-cpu"; else build="build"; fi
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  flags=(-DCMAKE_BUILD_TYPE=Release -DTPX_BUILD_TESTS=OFF -DTPX_BUILD_DOCS=OFF)
  [ "$device" = cpu ] && flags+=(-DTPX_CUDA=OFF)
  cmake -S . -B "$build" -G Ninja "${flags[@]}" >/dev/null
fi
# Build only the programs the benchmarks run (with --stages, only those stages), those this source
# tree has; tools/bench.py checks the list itself and names a stage that does not exist.
all_stages=(01_baseline 02_megatron_tp 03_sequence_parallel 04_overlap_ring 05_copy_engine_async_tp
  06_fp8 07_fsdp_tp 08_context_parallel 09_pipeline_parallel)
# --only cp | pp: the programs of that subsection alone (tools/bench.py checks --only itself).
case $only in
  cp) stages=03,08 ;;
  pp) stages=09 ;;
esac
chosen=()
for s in "${all_stages[@]}"; do
  if [ -z "$stages" ]; then
    chosen+=("$s")
    continue
  fi
  IFS=, read -ra picks <<<"$stages"
  for p in "${picks[@]}"; do
    if [ "$p" = "$s" ] || { [[ $p =~ ^[0-9]+$ ]] && [ "$((10#$p))" = "$((10#${s:0:2}))" ]; }; then
      chosen+=("$s")
    fi
  done
done
if [ -n "$stages" ] && [ ${#chosen[@]} -eq 0 ]; then
  echo "bench: --stages $stages names no stage (stages: 01 … 09, or their names)" >&2
  exit 2
fi
wanted=("${chosen[@]}" bench_gemm bench_collectives tpx_project)
[ "$only" = pp ] && wanted=("${chosen[@]}")
known=$(cmake --build "$build" --target help 2>/dev/null)
targets=()
for t in "${wanted[@]}"; do
  grep -qE "^($t: |\.\.\. $t\$)" <<<"$known" && targets+=("$t")
done
if [ ${#targets[@]} -eq 0 ]; then
  echo "bench: $build has none of the stage targets (is it a tpx build?)" >&2
  exit 1
fi
echo "bench: building ${targets[*]} in $build"
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

# shellcheck disable=SC1091
source scripts/env.sh
command="scripts/bench.sh${args[*]:+ ${args[*]}}"
[ -n "${TPX_BENCH_BUILD:-}" ] && command="TPX_BENCH_BUILD=$TPX_BENCH_BUILD $command"
exec "$py" tools/bench.py --build "$build" --work out/bench --mpirun "${TPX_MPIRUN[*]}" \
  --command "$command" "${args[@]}"
