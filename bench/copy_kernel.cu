// The "SM copy" mover of bench_copy_overlap.cc: a grid-stride copy kernel, the simplest stand-in
// for a communication kernel. Its blocks occupy SMs for as long as the copy runs, so a GEMM that
// starts beside it gets the SMs that are left.
//
// defines: tpx::bench::launch_sm_copy (declared in bench_copy_overlap.cc)
#include <cuda_runtime.h>

#include <cstddef>

namespace tpx::bench {
namespace {

constexpr int kThreads = 512;

/// dst[i] = src[i] for n 16-byte words, each thread striding by the whole grid.
__global__ void copy_words(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    dst[i] = src[i];
}

}  // namespace

/// Copies `bytes` (a multiple of 16; both pointers 16-byte aligned) from src to dst with `blocks`
/// blocks of 512 threads on `stream` (a cudaStream_t). Returns the launch's cudaError_t as int.
int launch_sm_copy(const void* src, void* dst, std::size_t bytes, int blocks, void* stream) {
  copy_words<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), bytes / sizeof(uint4));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tpx::bench
