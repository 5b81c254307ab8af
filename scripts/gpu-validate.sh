#!/usr/bin/env bash
# Validates every CUDA path of the project on a GPU machine and writes one report.
#
#   scripts/gpu-validate.sh OUTDIR [PART ...]
#
# OUTDIR gets report.md (the device, the date, a table of every step with its result, time and
# command, and the numbers the chapters quote) and logs/ (each step's full output; logs.tar.gz
# holds the same in one file). The last line
# printed, and of the report, is "N passed, N failed"; the exit status is 0 only if none failed.
# PARTs (default: all, in this order; each fits in a 10-minute command on an H100):
#   facts    the GPU, driver, compute mode; libraries the binaries cannot find
#   unit     the cuda unit tests, run directly with TPX_EXPECT_GPU=1 (a skip is a failure)
#   sanitize compute-sanitizer: memcheck on the cuda op tests, racecheck on RMSNorm and attention,
#            memcheck on stage 05 at -np 2 (memcheck with TPX_EXACT_ALLOC=1: no cached blocks)
#   stages   01 on cuda in fp32 and bf16; 02-06 at -np 1 (NCCL) and -np 2 (ranks sharing the GPU);
#            07 and 08 (--cp 2, each --cp-method, fp32 and bf16) on ranks sharing the GPU; 09 at
#            P = 1, at P = 2 with each schedule (and bf16), and the 4-D mesh P 2 × C 2 × T 2 at
#            np 8 in fp32 and bf16
#   big      stage 01 at H=4096 NH=32 F=11008 S=2048 B=1 in bf16: step time, TFLOP/s, MFU
#   bench    the GPU micro-benchmarks: bench_copy_overlap (chapter 5), bench_gemm bf16 vs fp8 (6),
#            bench_attention fused vs naive beside PyTorch's SDPA (tools/sdpa_bench.py, when
#            PyTorch is installed) at the same shapes, S 1k to 16k (1); stage 01 at the big
#            shape beside PyTorch's step for the same block (tools/torch_block_perf.py); then
#            one table of the ratios (tools/gpu_logs.py --compare), printed and in its log
#   profile  Nsight Compute (ncu, --clock-control none) on one launch of each fused-attention
#            kernel and of SDPA's at S 2048 and 8192, D 128, bf16: throughput, issue slots and
#            tensor pipe, occupancy, warp stalls with source counters, SM activity max vs avg
#
# The build: TPX_BUILD (default: build) must hold a build made for this GPU, e.g.
#   cmake --preset release -DCMAKE_CUDA_ARCHITECTURES=90 -DTPX_STATIC_BLAS=ON
#   cmake --build --preset release
# made here or on another machine and carried: scripts/gpu-pack.sh packs one with the libraries a
# bare GPU machine lacks (TPX_BUILD=.gpucarry after unpacking). A machine without Open MPI gets it
# from a carried bundle: run
# ../shared/gpu/bundle.sh beside the checkout first, carry .gpubundle/, and this script sources
# .gpubundle/env.sh when mpirun is missing. See common/cuda/README.md, "Validating on a GPU
# machine".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(facts unit sanitize stages big bench profile)
for p in "${parts[@]}"; do
  case $p in facts | unit | sanitize | stages | big | bench | profile) ;;
  *)
    echo "gpu-validate: unknown part '$p' (facts, unit, sanitize, stages, big, bench, profile)"
    exit 2
    ;;
  esac
done

# Seconds, not minutes, where there is nothing to validate.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu-validate: no GPU is visible (nvidia-smi -L lists none); nothing to validate here"
  exit 2
fi

build=${TPX_BUILD:-build}
bin=$build/bin
if [ ! -x "$bin/01_baseline" ]; then
  echo "gpu-validate: no build in $build (set TPX_BUILD, or build with: cmake --preset release" \
    "-DCMAKE_CUDA_ARCHITECTURES=90 -DTPX_STATIC_BLAS=ON && cmake --build --preset release)"
  exit 2
fi
# shellcheck disable=SC1091
[ -f "$build/env.sh" ] && source "$build/env.sh" # a build packed by scripts/gpu-pack.sh
if ! command -v mpirun >/dev/null 2>&1 && [ -f .gpubundle/env.sh ]; then
  # shellcheck disable=SC1091
  source .gpubundle/env.sh
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none TPX_EXPECT_GPU=1
mpi=(mpirun --oversubscribe --bind-to none)

mkdir -p "$out/logs"
report=$out/report.md
rows=()
passed=0
failed=0
n=0

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output into logs/NN-NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  n=$((n + 1))
  local log
  log=$(printf '%s/logs/%02d-%s.log' "$out" "$n" "$name")
  local t0=$SECONDS
  echo "=== [$n] $name: $*"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0)) verdict=pass
  if [ $rc -ne 0 ]; then
    verdict="FAIL (exit $rc$([ $rc -eq 124 ] && echo ", over ${limit} s"))"
    failed=$((failed + 1))
    tail -5 "$log" | sed 's/^/    /'
  else
    passed=$((passed + 1))
  fi
  echo "    $verdict in ${dt} s"
  rows+=("| $n | $name | $verdict | $dt | \`$*\` | $(basename "$log") |")
}

# A step that needs its log to contain a line (e.g. PASS): runs COMMAND, then greps.
check_step() {
  local name=$1 limit=$2 want=$3
  shift 3
  step "$name" "$limit" "$@"
  local log
  log=$(printf '%s/logs/%02d-%s.log' "$out" "$n" "$name")
  if [[ ${rows[-1]} == *"| pass |"* ]] && ! grep -q -- "$want" "$log"; then
    rows[-1]=${rows[-1]/| pass |/| FAIL (no \"$want\" in the output) |}
    passed=$((passed - 1))
    failed=$((failed + 1))
  fi
}

# need PROGRAM: true when $bin/PROGRAM exists; otherwise a failed row says it is missing from the
# build (a packed build that left it out must not pass by skipping its steps).
need() {
  [ -x "$bin/$1" ] && return 0
  n=$((n + 1))
  failed=$((failed + 1))
  echo "=== [$n] $1: missing from the build ($bin/$1)"
  rows+=("| $n | $1 | FAIL (not in $bin) | 0 | — | — |")
  return 1
}

has() { [[ " ${parts[*]} " == *" $1 "* ]]; }
small=(--hidden 256 --heads 8 --ffn 1024 --seq 128 --batch 2 --layers 2 --steps 5)

if has facts; then
  step nvidia-smi 60 nvidia-smi
  step gpu-query 60 nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total,clocks.max.sm \
    --format=csv
  step ldd 60 bash -c "for f in $bin/*; do ldd \"\$f\" 2>/dev/null | grep 'not found' | sed \"s|^|\$f: |\"; done; \
    ! (for f in $bin/*; do ldd \"\$f\" 2>/dev/null; done | grep -q 'not found')"
fi

if has unit; then
  for t in test_cuda_ops test_cuda_stage01 test_cuda_streams test_cuda_lm; do
    step "$t" 480 "$bin/$t"
  done
  step test_fp8.cuda 120 "$bin/test_fp8" --gtest_filter='Fp8Cuda.*:Fp8Gemm.*'
  # The block-scaled GEMMs on their own, so that the probe's choice of scale-tensor order (one
  # stderr line per pair of scale modes) stands in a log of its own.
  step test_cuda_ops.scaled_gemm 180 "$bin/test_cuda_ops" \
    --gtest_filter='LowpCuda.NativeScaledGemmMatchesTheDequantizedProduct'
  step test_attention.cuda 240 "$bin/test_attention" --gtest_filter='*Cuda*' # fused attention
  step test_column_blocks.cuda 120 "$bin/test_column_blocks" --gtest_filter='*Cuda*' # Ulysses' packing
  step test_comm.cuda.np1 180 "${mpi[@]}" -np 1 "$bin/test_comm" --gtest_filter='CommCuda.*'
  step test_comm.cuda.np2 180 "${mpi[@]}" -np 2 "$bin/test_comm" --gtest_filter='CommCuda.*'
fi

if has sanitize; then
  # TPX_EXACT_ALLOC=1: exact-size, uncached blocks, so memcheck sees an overrun of a tensor.
  # Left out: Allocator.* (no cache to test) and the test that makes a CUDA call fail on purpose
  # (an invalid device ordinal), which memcheck rightly reports as an API error; it runs, unchecked
  # by memcheck, in the unit part. Every kernel stays under memcheck.
  step memcheck.cuda_ops 540 env TPX_EXACT_ALLOC=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$bin/test_cuda_ops" \
    --gtest_filter='-Allocator.*:Check.MacrosNameTheCallAndTheLibrarysError'
  step racecheck.norm_attention 540 compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$bin/test_cuda_ops" --gtest_filter='Ops.RmsNorm*:Ops.Attention*'
  step racecheck.fused_attention 540 compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$bin/test_attention" --gtest_filter='Sizes/FusedAttention.Cuda*'
  step memcheck.05.np2 540 "${mpi[@]}" -np 2 -x TPX_EXACT_ALLOC=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 \
    "$bin/05_copy_engine_async_tp" --device cuda --check --steps 2 --hidden 96 --heads 12 \
    --ffn 192 --seq 24
fi

if has stages; then
  for dtype in fp32 bf16; do
    # The default task is the language model (the generated token stream where the build's
    # corpus is not on this machine); the blocks alone once more under --task block.
    check_step "01.$dtype" 300 PASS "$bin/01_baseline" --device cuda --dtype "$dtype" --check
    check_step "01.block.$dtype" 300 PASS "$bin/01_baseline" --device cuda --dtype "$dtype" \
      --task block --check
  done
  for s in 02_megatron_tp 03_sequence_parallel 04_overlap_ring 05_copy_engine_async_tp 06_fp8; do
    need "$s" || continue
    for np in 1 2; do
      check_step "$s.np$np" 300 PASS "${mpi[@]}" -np "$np" "$bin/$s" --device cuda --check "${small[@]}"
    done
    # The mixed-precision recipe (stage 06's fp8 default already runs inside it).
    [ "$s" = 06_fp8 ] || check_step "$s.bf16.np2" 300 PASS "${mpi[@]}" -np 2 "$bin/$s" \
      --device cuda --dtype bf16 --check "${small[@]}"
  done
  if need 06_fp8; then
    # The row and block recipes (06_fp8/recipes.cc): the same ops as on the cpu, the casts on the
    # device (common/cuda/lowp.cu); on Hopper rowwise's and block128's GEMMs through cuBLASLt's
    # scale modes (common/cuda/gemm_scaled.cc), the ring's and the others' on the dequantized
    # operands in fp32.
    for recipe in rowwise block128 mxfp8 nvfp4; do
      for np in 1 2; do
        check_step "06.$recipe.np$np" 300 PASS "${mpi[@]}" -np "$np" "$bin/06_fp8" --device cuda \
          --fp8-recipe "$recipe" --check
      done
    done
  fi
  check_step 05.bf16.np2 300 PASS "${mpi[@]}" -np 2 "$bin/05_copy_engine_async_tp" --device cuda \
    --dtype bf16 --check
  check_step 05.np4 300 PASS "${mpi[@]}" -np 4 "$bin/05_copy_engine_async_tp" --device cuda --check
  check_step 05.bf16.np4 300 PASS "${mpi[@]}" -np 4 "$bin/05_copy_engine_async_tp" --device cuda \
    --dtype bf16 --check
  if need 07_fsdp_tp; then  # the mesh: host-staged DP, IPC TP (common/cuda/README.md)
    check_step 07.dp2.np2 300 PASS "${mpi[@]}" -np 2 "$bin/07_fsdp_tp" --device cuda --dp 2 --check
    check_step 07.dp2tp2.np4 300 PASS "${mpi[@]}" -np 4 "$bin/07_fsdp_tp" --device cuda --dp 2 --check
    check_step 07.dp2tp2.bf16.np4 300 PASS "${mpi[@]}" -np 4 "$bin/07_fsdp_tp" --device cuda \
      --dp 2 --dtype bf16 --check
    check_step 07.dp2tp2.nvfp4.np4 300 PASS "${mpi[@]}" -np 4 "$bin/07_fsdp_tp" --device cuda \
      --dp 2 --dtype fp8 --fp8-recipe nvfp4 --check
  fi
  if need 08_context_parallel; then # CP: host-staged CP ring / all-gather / all-to-all
    for method in ring allgather ulysses; do
      check_step "08.cp2.$method.np2" 300 PASS "${mpi[@]}" -np 2 "$bin/08_context_parallel" \
        --device cuda --cp 2 --cp-method "$method" --check
      # bf16: K/V moved in bf16, the pairs on fp32 copies, one rounding per output.
      check_step "08.cp2.$method.bf16.np2" 300 PASS "${mpi[@]}" -np 2 "$bin/08_context_parallel" \
        --device cuda --cp 2 --cp-method "$method" --dtype bf16 --check
    done
    check_step 08.cp2.gqa.np2 300 PASS "${mpi[@]}" -np 2 "$bin/08_context_parallel" --device cuda \
      --cp 2 --kv-heads 2 --check
  fi
  if need 09_pipeline_parallel; then # PP: activations and gradients on host lanes (host-staged)
    check_step 09.pp1.np1 300 PASS "${mpi[@]}" -np 1 "$bin/09_pipeline_parallel" --device cuda \
      --check "${small[@]}"
    pp=(--hidden 256 --heads 8 --ffn 1024 --seq 128 --batch 4 --layers 4 --steps 3)
    for schedule in gpipe 1f1b interleaved-1f1b zb-h1; do
      virtual=()
      [ "$schedule" = interleaved-1f1b ] && virtual=(--stages-per-rank 2)
      check_step "09.pp2.$schedule.np2" 300 PASS "${mpi[@]}" -np 2 "$bin/09_pipeline_parallel" \
        --device cuda --pp 2 --schedule "$schedule" "${virtual[@]}" --check "${pp[@]}"
    done
    check_step 09.pp2.bf16.np2 300 PASS "${mpi[@]}" -np 2 "$bin/09_pipeline_parallel" \
      --device cuda --pp 2 --dtype bf16 --check "${pp[@]}"
    # The trace of a cuda pipeline: on each rank, compute spans beside its pp comm lane's
    # transfers (lanes 0 and 6 of tpx's trace; the file is kept beside the logs).
    step 09.pp2.trace.np2 300 bash -c "${mpi[*]} -np 2 $bin/09_pipeline_parallel --device cuda \
      --pp 2 ${pp[*]} --trace $out/logs/09-pp2-trace.json >/dev/null && python3 -c 'import json, \
      sys; spans = {(e[\"pid\"], e[\"tid\"]) for e in json.load(open(sys.argv[1]))[\"traceEvents\"] \
      if e[\"ph\"] == \"X\"}; ok = all((r, lane) in spans for r in (0, 1) for lane in (0, 6)); \
      print(\"compute and pp comm spans on both ranks\" if ok else sorted(spans)); \
      sys.exit(0 if ok else 1)' $out/logs/09-pp2-trace.json"
    # The 4-D mesh (D = 1) on eight ranks sharing the GPU: P 2 × C 2 × T 2.
    for dtype in fp32 bf16; do
      check_step "09.pp2cp2tp2.$dtype.np8" 540 PASS "${mpi[@]}" -np 8 \
        "$bin/09_pipeline_parallel" --device cuda --pp 2 --cp 2 --dtype "$dtype" --check "${pp[@]}"
    done
  fi
  if need 10_expert_parallel; then
    # EP: the routing and the rows' moves by common/cuda/moe.cu, the experts' GEMMs grouped
    # (cublasGemmGroupedBatchedEx), the all-to-alls host-staged between ranks sharing the GPU.
    ep=(--hidden 256 --heads 8 --ffn 512 --seq 64 --batch 4 --layers 2 --experts 8 --topk 2
      --steps 3)
    check_step 10.np1 300 PASS "${mpi[@]}" -np 1 "$bin/10_expert_parallel" --device cuda \
      --capacity-factor 0.5 --check "${ep[@]}"
    check_step 10.dp2.drop.np2 300 PASS "${mpi[@]}" -np 2 "$bin/10_expert_parallel" \
      --device cuda --dp 2 --capacity-factor 0.5 --check "${ep[@]}"
    check_step 10.dp2tp2.sigmoid.np4 300 PASS "${mpi[@]}" -np 4 "$bin/10_expert_parallel" \
      --device cuda --dp 2 --router sigmoid --shared-experts 1 --balance bias --check "${ep[@]}"
    check_step 10.pp2dp2.np4 300 PASS "${mpi[@]}" -np 4 "$bin/10_expert_parallel" --device cuda \
      --pp 2 --capacity-factor 0.5 --check "${ep[@]}"
    check_step 10.dp2.late.np2 300 PASS "${mpi[@]}" -np 2 "$bin/10_expert_parallel" \
      --device cuda --dp 2 --fault-comm-delay-us 400 --check "${ep[@]}"
    step test_expert_parallel.cuda 540 "$bin/test_expert_parallel" \
      --gtest_filter='ExpertParallel.OnCuda*:ExpertParallel.ChunkedOverlapOnCuda*'
  fi
  # Comm lanes running late: every communicator op first waits a random 0 … 400 µs, so each
  # transfer ends after the compute around it has been issued; a missing wait fails --check
  # (tests/test_late_lanes.cc does the same on the cpu).
  late=(--fault-comm-delay-us 400 --check)
  need 07_fsdp_tp && check_step 07.dp2tp2.late.np4 300 PASS "${mpi[@]}" -np 4 "$bin/07_fsdp_tp" \
    --device cuda --dp 2 "${late[@]}"
  if need 08_context_parallel; then
    for method in ring allgather ulysses; do
      check_step "08.cp2.$method.late.np2" 300 PASS "${mpi[@]}" -np 2 \
        "$bin/08_context_parallel" --device cuda --cp 2 --cp-method "$method" "${late[@]}"
    done
  fi
  need 09_pipeline_parallel && check_step 09.pp2.1f1b.late.np2 300 PASS "${mpi[@]}" -np 2 \
    "$bin/09_pipeline_parallel" --device cuda --pp 2 --schedule 1f1b "${late[@]}" "${pp[@]}"
  check_step 05.nccl-zero-cta.np1 300 PASS "${mpi[@]}" -np 1 "$bin/05_copy_engine_async_tp" \
    --device cuda --all-gather nccl-zero-cta --check
  # Ranks sharing the GPU: the option must refuse in one line on every rank, with exit status 2.
  step 05.nccl-zero-cta.np2-refuses 120 bash -c "${mpi[*]} -np 2 $bin/05_copy_engine_async_tp \
    --device cuda --all-gather nccl-zero-cta --steps 1; test \$? -eq 2"
fi

if has big; then
  check_step 01.big.bf16 540 "TFLOP" "$bin/01_baseline" --device cuda --dtype bf16 --hidden 4096 \
    --heads 32 --ffn 11008 --seq 2048 --batch 1 --layers 1 --steps 5
fi

if has bench; then
  if need bench_copy_overlap; then
    step bench_copy_overlap 300 "$bin/bench_copy_overlap" --benchmark_filter=cuda
  fi
  if need bench_gemm; then  # bf16 against fp8 at the block's shapes (chapter 6)
    step bench_gemm 240 "$bin/bench_gemm" --benchmark_filter='cuda/(bf16|fp8)/'
  fi
  if need bench_attention; then # fused vs naive attention, fwd+bwd, bf16 (chapter 1)
    step bench_attention 300 "$bin/bench_attention" --benchmark_filter='attention/cuda/'
  fi
  if python3 -c 'import torch' >/dev/null 2>&1; then # PyTorch's SDPA at the same shapes
    step sdpa_bench 300 python3 tools/sdpa_bench.py
    step sdpa_bench.d64 120 python3 tools/sdpa_bench.py --seq 2048 --head-dim 64
    # PyTorch's training step for the same block, beside stage 01's in this same run (chapter 1)
    step torch_block_perf 300 python3 tools/torch_block_perf.py
  else
    echo "=== sdpa_bench, torch_block_perf: skipped (no PyTorch for python3 here)"
  fi
  if need 01_baseline; then
    check_step 01.big.bf16.bench 300 "TFLOP" "$bin/01_baseline" --device cuda --dtype bf16 \
      --hidden 4096 --heads 32 --ffn 11008 --seq 2048 --batch 1 --layers 1 --steps 5
  fi
  # One table of this run's ratios: tpx attention against SDPA, stage 01 against PyTorch.
  step compare 60 python3 tools/gpu_logs.py --compare "$out/logs"
  cat "$(printf '%s/logs/%02d-compare.log' "$out" "$n")"
fi

if has profile && need bench_attention; then
  # Where the fused attention's time goes, beside SDPA's (chapter 1's kernels): the forward, Δ,
  # dQ and dK/dV kernels of one fwd + bwd as the stage runs them (bf16 tensors, bf16 outputs),
  # each replayed by the profiler at the GPU's own clocks (--clock-control none): durations,
  # issue slots and the tensor pipe (SpeedOfLight, ComputeWorkloadAnalysis), warp stalls with
  # their source lines (WarpStateStats, SourceCounters), and SM activity max against average
  # (the tail of the last wave), at S 2048 and 8192.
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  ncu_what=(--clock-control none
    --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats
    --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis_Tables
    --section ComputeWorkloadAnalysis --section InstructionStats
    --metrics sm__cycles_active.max,sm__cycles_active.avg)
  for s in 2048 8192; do
    step "ncu.attention.S$s" 240 "$ncu" --kernel-name regex:flash_ --launch-count 4 \
      "${ncu_what[@]}" "$bin/bench_attention" \
      --benchmark_filter="^attention/cuda/bf16/fused/S:$s/" --benchmark_min_time=0.001
    if python3 -c 'import torch' 2>/dev/null; then  # SDPA's own kernels, the same shape
      step "ncu.sdpa.S$s" 240 "$ncu" --kernel-name 'regex:flash|fmha|sdpa|attention' \
        --launch-count 4 "${ncu_what[@]}" python3 tools/sdpa_bench.py --seq "$s" --iters 1
    fi
  done
fi

# The report.
gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader 2>/dev/null |
  head -1)
{
  echo "# GPU validation"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- device: ${gpu:-unknown} (name, driver, compute mode)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- build: $build; parts: ${parts[*]}"
  echo
  echo "| # | step | result | seconds | command | log |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "## Numbers"
  echo
  for f in "$out"/logs/*; do
    grep -H -E "bf16 GEMM peak|^mean step|MFU|^PASS|^FAIL|ERROR SUMMARY|slowdown=|TFLOP/s=" "$f" 2>/dev/null |
      sed "s|^$out/logs/||" | head -8
  done | sed 's/^/    /'
  echo
  echo "$passed passed, $failed failed"
} >"$report"
# The logs in one file too, for a machine that hands back only a few files.
tar -C "$out" -czf "$out/logs.tar.gz" logs
echo "report: $report (logs: $out/logs/, also $out/logs.tar.gz)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
