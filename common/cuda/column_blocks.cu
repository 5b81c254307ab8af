// Ulysses' packing on the device (stage 08, --cp-method ulysses): x [m, n·c] ↔ n blocks [m, c],
// through the index map the cpu copies use too (common/column_blocks.h), so that the tensors
// that move in the all-to-alls never leave the GPU. One thread per element, grid-stride; the
// elements are moved as bits (fp32, bf16, FP8 codes alike).
#include <cuda_runtime.h>
#include <cstdint>

#include "common.cuh"
#include "common/column_blocks.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

template <class T, bool kSplit>
__global__ void column_blocks_kernel(const T* __restrict__ src, T* __restrict__ dst, I m, I c,
                                     I n) {
  const I total = m * c * n;
  for (I e = I(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += I(gridDim.x) * blockDim.x) {
    const I x = hd::column_block_source(e, m, c, n);  // e indexes the blocks, x the tensor
    if constexpr (kSplit)
      dst[e] = src[x];
    else
      dst[x] = src[e];
  }
}

template <class T>
void launch(const void* src, void* dst, I m, I c, I n, bool split, cudaStream_t st) {
  constexpr int kThreads = 256;
  const unsigned blocks = dev::blocks_for(m * c * n, kThreads);
  const auto* s = static_cast<const T*>(src);
  auto* d = static_cast<T*>(dst);
  if (split)
    column_blocks_kernel<T, true><<<blocks, kThreads, 0, st>>>(s, d, m, c, n);
  else
    column_blocks_kernel<T, false><<<blocks, kThreads, 0, st>>>(s, d, m, c, n);
}

}  // namespace

void column_blocks(const void* src, void* dst, I m, I c, I n, int elem_bytes, bool split,
                   void* stream) {
  if (m == 0 || c == 0 || n == 0) return;
  const cudaStream_t st = dev::as_stream(stream);
  if (elem_bytes == 4)
    launch<std::uint32_t>(src, dst, m, c, n, split, st);
  else if (elem_bytes == 2)
    launch<std::uint16_t>(src, dst, m, c, n, split, st);
  else
    launch<std::uint8_t>(src, dst, m, c, n, split, st);
}

}  // namespace tpx::cuda::kernels
