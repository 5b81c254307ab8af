// The fused causal masked softmax of attention, forward and backward. The QKᵀ and PV products
// around it are strided-batched cuBLAS GEMMs (gemm.cc); these kernels see only the score matrices
// [B·heads, S, S], as rows = B·heads·S rows of length S, row r being query position i = r % S.
// Grouped-query attention changes nothing here: the scores are per query head (heads counts query
// heads), and ops.cc points the GEMMs of each query head at its group's K and V.
//
// Shape: one warp per row (rows are long and many: S up to thousands, B·heads·S rows), 8 rows per
// 256-thread block, grid-stride over rows. Lanes stride along the row with float4 loads when S is
// a multiple of 4 (rows are then 16-byte aligned), so each warp moves 512 contiguous bytes per
// step. Forward makes one pass computing the running max and the rescaled sum together (online
// softmax), combines the 32 lanes' (max, sum) pairs with shuffles, and a second pass writes the
// probabilities, the zeros above the diagonal and, for bf16 GEMMs, a bf16 copy. Backward makes
// one pass for Σ dP·P and one writing dS. The second pass re-reads the row from L1/L2.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;
using dev::ld4;
using dev::st4;

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / dev::kWarp;

/// Adds x to a running (max m, sum l of exp(· − m)) pair.
__device__ __forceinline__ void online_add(float& m, float& l, float x) {
  if (x > m) {
    l = l * expf(m - x) + 1.0f;
    m = x;
  } else {
    l += expf(x - m);
  }
}

__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* out, I i, float4 v) {
  __align__(8)
      __nv_bfloat162 r[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
  reinterpret_cast<uint2*>(out)[i] = *reinterpret_cast<const uint2*>(r);
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    causal_softmax_forward_kernel(float* p, __nv_bfloat16* pb, I rows, I s) {
  const int lane = threadIdx.x % dev::kWarp;
  const I warps = I(gridDim.x) * kRowsPerBlock;
  for (I row = I(blockIdx.x) * kRowsPerBlock + threadIdx.x / dev::kWarp; row < rows; row += warps) {
    float* pr = p + row * s;
    const I n = row % s + 1;  // query position i attends keys 0..i
    float m = -INFINITY, l = 0.0f;
    if constexpr (kVec) {
      for (I c = lane; 4 * c < n; c += dev::kWarp) {
        const float4 v = ld4(pr, c);
        const I j = 4 * c;
        online_add(m, l, v.x);
        if (j + 1 < n) online_add(m, l, v.y);
        if (j + 2 < n) online_add(m, l, v.z);
        if (j + 3 < n) online_add(m, l, v.w);
      }
    } else {
      for (I j = lane; j < n; j += dev::kWarp) online_add(m, l, pr[j]);
    }
    const float mx = dev::warp_max(m);
    // A lane that saw nothing has l = 0 and m = -inf: exp(-inf) = 0 keeps it out of the sum.
    const float sum = dev::warp_sum(m == -INFINITY ? 0.0f : l * expf(m - mx));
    const float inv = 1.0f / sum;
    auto prob = [&](float x, I j) { return j < n ? expf(x - mx) * inv : 0.0f; };
    if constexpr (kVec) {
      for (I c = lane; c < s / 4; c += dev::kWarp) {
        const I j = 4 * c;
        float4 v = j < n ? ld4(pr, c) : make_float4(0, 0, 0, 0);
        v = make_float4(prob(v.x, j), prob(v.y, j + 1), prob(v.z, j + 2), prob(v.w, j + 3));
        st4(pr, c, v);
        if (pb) store_bf16x4(pb + row * s, c, v);
      }
    } else {
      for (I j = lane; j < s; j += dev::kWarp) {
        const float v = prob(j < n ? pr[j] : 0.0f, j);
        pr[j] = v;
        if (pb) pb[row * s + j] = __float2bfloat16_rn(v);
      }
    }
  }
}

// dS = P ⊙ (dP − Σ_j dP·P) for j <= i, zero above (where P is zero anyway).
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    causal_softmax_backward_kernel(const float* p, float* dp, __nv_bfloat16* dsb, I rows, I s) {
  const int lane = threadIdx.x % dev::kWarp;
  const I warps = I(gridDim.x) * kRowsPerBlock;
  for (I row = I(blockIdx.x) * kRowsPerBlock + threadIdx.x / dev::kWarp; row < rows; row += warps) {
    const float* pr = p + row * s;
    float* dr = dp + row * s;
    const I n = row % s + 1;
    float dot = 0.0f;
    if constexpr (kVec) {
      for (I c = lane; 4 * c < n; c += dev::kWarp) {  // P is zero for j > i: no mask needed
        const float4 a = ld4(pr, c), b = ld4(dr, c);
        dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
      }
    } else {
      for (I j = lane; j < n; j += dev::kWarp) dot += pr[j] * dr[j];
    }
    dot = dev::warp_sum(dot);
    auto ds = [&](float pv, float dv, I j) { return j < n ? pv * (dv - dot) : 0.0f; };
    if constexpr (kVec) {
      for (I c = lane; c < s / 4; c += dev::kWarp) {
        const I j = 4 * c;
        float4 v = make_float4(0, 0, 0, 0);
        if (j < n) {
          const float4 a = ld4(pr, c), b = ld4(dr, c);
          v = make_float4(ds(a.x, b.x, j), ds(a.y, b.y, j + 1), ds(a.z, b.z, j + 2),
                          ds(a.w, b.w, j + 3));
        }
        st4(dr, c, v);
        if (dsb) store_bf16x4(dsb + row * s, c, v);
      }
    } else {
      for (I j = lane; j < s; j += dev::kWarp) {
        const float v = j < n ? ds(pr[j], dr[j], j) : 0.0f;
        dr[j] = v;
        if (dsb) dsb[row * s + j] = __float2bfloat16_rn(v);
      }
    }
  }
}

}  // namespace

void causal_softmax_forward(float* p, std::uint16_t* p_bf16, I rows, I s, void* stream) {
  if (rows == 0) return;
  auto* pb = reinterpret_cast<__nv_bfloat16*>(p_bf16);
  const unsigned grid = dev::blocks_for(rows * dev::kWarp, kThreads);
  if (s % 4 == 0 && dev::aligned16(p) && (!pb || dev::aligned16(pb)))
    causal_softmax_forward_kernel<true>
        <<<grid, kThreads, 0, dev::as_stream(stream)>>>(p, pb, rows, s);
  else
    causal_softmax_forward_kernel<false>
        <<<grid, kThreads, 0, dev::as_stream(stream)>>>(p, pb, rows, s);
}

void causal_softmax_backward(const float* p, float* dp, std::uint16_t* ds_bf16, I rows, I s,
                             void* stream) {
  if (rows == 0) return;
  auto* db = reinterpret_cast<__nv_bfloat16*>(ds_bf16);
  const unsigned grid = dev::blocks_for(rows * dev::kWarp, kThreads);
  if (s % 4 == 0 && dev::aligned16(p, dp) && (!db || dev::aligned16(db)))
    causal_softmax_backward_kernel<true>
        <<<grid, kThreads, 0, dev::as_stream(stream)>>>(p, dp, db, rows, s);
  else
    causal_softmax_backward_kernel<false>
        <<<grid, kThreads, 0, dev::as_stream(stream)>>>(p, dp, db, rows, s);
}

}  // namespace tpx::cuda::kernels
