// The mixture-of-experts kernels of stage 10 (common/moe_ep.h's device path): the routing, the
// permutation of token rows into the order they are dispatched in, the combine's weighted sum,
// the gate weights' gradients and the router's.
//
// Routing: one thread a token runs moe_token::route, the function the cpu backend and the double
// reference call, so every backend routes alike (moe_token.h says why the bits agree). It reads
// its E logits and writes its E scores from global memory (L1 keeps them); E is 8 to 256 for the
// models stage 10 has presets of and a layer has a few thousand tokens, so this is not where a
// step's time goes.
//
// The row moves are element-wise over [rows, H]: gather_rows multiplies (one rounding, as the
// cpu), combine_rows sums a token's k rows in j order with one rounding per product and per sum
// (__fmul_rn/__fadd_rn: never an FMA), so its bits are the cpu's. rows_dot reduces H products
// per (token, choice) with one warp: another order than the cpu's loop (rounding).
//
// Resources (ptxas, sm_90), 256 threads a block, no shared memory, no spills, no stack: routing 58
// registers (64 allocated a thread: 4 blocks per SM), the router's gradient 48, combine_rows 38,
// rows_dot 29, gather_rows 28.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "common/moe_token.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;

constexpr int kThreads = 256;

unsigned grid_for(I n) {
  const I blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

__global__ void moe_route_kernel(const float* logits, const float* bias, I n, I E, I k,
                                 bool sigmoid, float* score, std::int32_t* expert, float* weight) {
  for (I t = blockIdx.x * I(blockDim.x) + threadIdx.x; t < n; t += I(gridDim.x) * blockDim.x)
    moe_token::route(logits + t * E, bias, E, k, sigmoid, score + t * E, expert + t * k,
                     weight + t * k);
}

__global__ void gather_rows_kernel(const float* x, const std::int32_t* index, const float* scale,
                                   I R, I H, float* out) {
  const I n = R * H;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I r = i / H, h = i % H;
    const float v = x[I(index[r]) * H + h];
    out[i] = scale ? __fmul_rn(scale[r], v) : v;
  }
}

__global__ void combine_rows_kernel(const float* rows, const std::int32_t* slot,
                                    const float* weight, I n, I k, I H, float* out,
                                    bool accumulate) {
  const I total = n * H;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < total; i += I(gridDim.x) * blockDim.x) {
    const I t = i / H, h = i % H;
    float y = accumulate ? out[i] : 0.0f;
    for (I j = 0; j < k; ++j) {
      const std::int32_t r = slot[t * k + j];
      if (r < 0) continue;
      const float v = rows[I(r) * H + h];
      y = __fadd_rn(y, weight ? __fmul_rn(weight[t * k + j], v) : v);
    }
    out[i] = y;
  }
}

/// One warp a (token, choice): lane l sums h = l, l + 32, …, then the warp's shuffle tree.
__global__ void rows_dot_kernel(const float* a, const float* rows, const std::int32_t* slot, I n,
                                I k, I H, float* out) {
  const int lane = threadIdx.x % 32;
  const I warps = I(gridDim.x) * (blockDim.x / 32);
  for (I w = (blockIdx.x * I(blockDim.x) + threadIdx.x) / 32; w < n * k; w += warps) {
    const std::int32_t r = slot[w];
    float d = 0.0f;
    if (r >= 0) {
      const float* x = a + (w / k) * H;
      const float* y = rows + I(r) * H;
      for (I h = lane; h < H; h += 32) d = __fadd_rn(d, __fmul_rn(x[h], y[h]));
    }
    for (int off = 16; off > 0; off /= 2) d = __fadd_rn(d, __shfl_down_sync(0xffffffffu, d, off));
    if (lane == 0) out[w] = d;
  }
}

__global__ void moe_router_dz_kernel(const float* score, const std::int32_t* expert,
                                     const float* weight, const float* dweight, const float* dP,
                                     I n, I E, I k, bool sigmoid, I tokens_all, float* dz) {
  for (I t = blockIdx.x * I(blockDim.x) + threadIdx.x; t < n; t += I(gridDim.x) * blockDim.x)
    moe_token::router_dz(score + t * E, expert + t * k, weight + t * k, dweight + t * k, dP, E, k,
                         sigmoid, tokens_all, dz + t * E);
}

}  // namespace

void moe_route(const float* logits, const float* bias, I n, I E, I k, bool sigmoid, float* score,
               std::int32_t* expert, float* weight, void* stream) {
  moe_route_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      logits, bias, n, E, k, sigmoid, score, expert, weight);
}

void gather_rows(const float* x, const std::int32_t* index, const float* scale, I R, I H,
                 float* out, void* stream) {
  gather_rows_kernel<<<grid_for(R * H), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, index, scale, R, H, out);
}

void combine_rows(const float* rows, const std::int32_t* slot, const float* weight, I n, I k, I H,
                  float* out, bool accumulate, void* stream) {
  combine_rows_kernel<<<grid_for(n * H), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, slot, weight, n, k, H, out, accumulate);
}

void rows_dot(const float* a, const float* rows, const std::int32_t* slot, I n, I k, I H,
              float* out, void* stream) {
  rows_dot_kernel<<<grid_for(n * k * 32), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a, rows, slot, n, k, H, out);
}

void moe_router_dz(const float* score, const std::int32_t* expert, const float* weight,
                   const float* dweight, const float* dP, I n, I E, I k, bool sigmoid, I tokens_all,
                   float* dz, void* stream) {
  moe_router_dz_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      score, expert, weight, dweight, dP, n, E, k, sigmoid, tokens_all, dz);
}

}  // namespace tpx::cuda::kernels
