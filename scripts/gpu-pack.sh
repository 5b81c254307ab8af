#!/usr/bin/env bash
# Packs what scripts/gpu-validate.sh needs on a bare GPU machine into one compressed file: the
# stage executables, the GPU tests and benchmarks (stripped), and the shared libraries they load
# that such a machine lacks (OpenBLAS and its Fortran runtime, fmt, Google Benchmark). CUDA,
# cuBLAS and NCCL are there already; Open MPI comes from ../shared/gpu/bundle.sh's .gpubundle/.
#
#   scripts/gpu-pack.sh [BUILD] [OUT]     (defaults: build, .gpucarry.tar.xz)
#   scripts/gpu-pack.sh --list            the programs it packs, one per line
#
# The list must hold every program scripts/gpu-validate.sh runs, and nothing else: ctest's
# gpu_pack test runs gpu-validate.sh over stand-ins of exactly these and compares.
#
# BUILD must be made for the GPU (the default CUDA architectures, 80;90, cover the H100 and
# H200). Carry OUT and .gpubundle/ (together about 40 MB; a call carries at most 64 MiB), then:
#
#   tar xf .gpucarry.tar.xz && source .gpubundle/env.sh &&
#     TPX_BUILD=.gpucarry scripts/gpu-validate.sh $OUT/gpu unit
set -euo pipefail
cd "$(dirname "$0")/.."
programs=(01_baseline 02_megatron_tp 03_sequence_parallel 04_overlap_ring 05_copy_engine_async_tp
  06_fp8 07_fsdp_tp 08_context_parallel 09_pipeline_parallel 10_expert_parallel test_expert_parallel
  test_cuda_ops test_cuda_stage01 test_cuda_streams test_cuda_lm test_fp8 test_comm test_attention test_column_blocks
  bench_gemm bench_copy_overlap bench_attention)
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${programs[@]}"
  exit 0
fi
build=${1:-build}
out=${2:-.gpucarry.tar.xz}
# What a bare GPU machine has: the C and C++ runtimes, CUDA's libraries; and what the bundle has.
have='/libc\.so|/libm\.so|/libdl\.so|/libpthread\.so|/librt\.so|/ld-linux|/libstdc\+\+\.so|/libgcc_s\.so|/usr/local/cuda|/libcud|/libcublas|/libnccl|/libmpi|/libopen-|/libhwloc|/libevent|/libudev|/libz\.so'

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/.gpucarry/bin" "$stage/.gpucarry/lib"
for p in "${programs[@]}"; do
  [ -x "$build/bin/$p" ] || { echo "gpu-pack: $build/bin/$p is missing (build it first)" >&2; exit 1; }
  strip -o "$stage/.gpucarry/bin/$p" "$build/bin/$p"
done
for p in "${programs[@]}"; do ldd "$build/bin/$p"; done | awk '/=> \//{print $3}' | sort -u |
  grep -Ev "$have" | while read -r lib; do cp -L "$lib" "$stage/.gpucarry/lib/"; done
cat >"$stage/.gpucarry/env.sh" <<'ENV'
# source this on the GPU machine (scripts/gpu-validate.sh does when TPX_BUILD is this folder)
_c=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH=$_c/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ENV
tar -C "$stage" -cJf "$out" .gpucarry
echo "gpu-pack: $out, $(du -h "$out" | cut -f1) ($(ls "$stage/.gpucarry/bin" | wc -l) programs," \
  "libraries: $(ls "$stage/.gpucarry/lib" | tr '\n' ' '))"
