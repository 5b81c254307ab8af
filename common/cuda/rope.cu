// Rotary position embedding (RoFormer: Su et al. 2021, arXiv:2104.09864), the rotate-half
// form, in place on [S, B, heads·D]: the pair (x_i, x_{i+D/2}) of every head at sequence position
// p is rotated by the angle p·θ^(−2i/D), whose cos and sin come from rope_table() (common/rope.h:
// double, rounded to fp32 once), uploaded by ops.cc.
//
// Bit-identical to the cpu (common/cpu/ops.cc): each output is the same two fp32 products and one
// fp32 sum, x1·c − x2·s and x2·c + x1·s, each rounded to nearest. nvcc would contract a·b − c·d
// into an FMA (one rounding fewer, a different result), so the products and the sum are spelled
// with the round-to-nearest intrinsics, which are never contracted (elementwise_ops.h's
// rope_pair, which a host test runs too). Backward uses −s, an exact negation, as the cpu does.
// A bf16 x is widened as it is read and each output rounded once as it is stored.
//
// Shape: one thread per pair, grid-stride over S·B·heads·D/2 pairs; consecutive threads take
// consecutive i of a row, so the loads of x_i, x_{i+D/2} and of the table row are coalesced.
#include <cuda_runtime.h>

#include "common.cuh"
#include "elementwise_ops.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(T* x, const float* cos_t, const float* sin_t, I pairs, I rows_per_pos, I half,
                float sign) {
  const I stride = I(gridDim.x) * blockDim.x;
  for (I e = I(blockIdx.x) * blockDim.x + threadIdx.x; e < pairs; e += stride) {
    const I row = e / half, i = e % half;
    const I t = (row / rows_per_pos) * half + i;  // position p = row / (B·heads)
    T* h = x + row * 2 * half;
    float x1 = elem::load(h, i), x2 = elem::load(h, i + half);
    elem::rope_pair(x1, x2, cos_t[t], __fmul_rn(sign, sin_t[t]));
    elem::store(h, i, x1);
    elem::store(h, i + half, x2);
  }
}

}  // namespace

void rope(Dst x, const float* cos, const float* sin, I s, I rows_per_pos, I half, bool inverse,
          void* stream) {
  const I pairs = s * rows_per_pos * half;
  if (pairs == 0) return;
  dev::typed(x, [&](auto* p) {
    rope_kernel<<<dev::blocks_for(pairs, kThreads), kThreads, 0, dev::as_stream(stream)>>>(
        p, cos, sin, pairs, rows_per_pos, half, inverse ? -1.0f : 1.0f);
  });
}

}  // namespace tpx::cuda::kernels
