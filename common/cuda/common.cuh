// Device-side helpers shared by the backend's kernels: 16-byte vector access, warp and block
// reductions, launch sizing, an operand's storage type from its runtime dtype. Included by .cu
// files only.
//
// defines: tpx::cuda::dev::aligned16, ld4, st4, warp_sum, warp_max, block_sum,
//          sum_partials_kernel, row_threads, launch grid helpers, typed, Elem
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "device.h"
#include "kernels.h"

namespace tpx::cuda::dev {

using I = std::int64_t;

inline constexpr int kWarp = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

/// True when every pointer is 16-byte aligned: float4 / 8 x bf16 loads are legal.
template <class... P>
inline bool aligned16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

__device__ __forceinline__ float4 ld4(const float* p, I i) {
  return reinterpret_cast<const float4*>(p)[i];
}
__device__ __forceinline__ void st4(float* p, I i, float4 v) {
  reinterpret_cast<float4*>(p)[i] = v;
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Sum over the block, returned to every thread. `shared` holds one T per warp (<= 32 warps).
/// Contains __syncthreads(): every thread of the block must call it.
template <class T>
__device__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = lane < warps ? shared[lane] : T(0);
  return warp_sum(total);
}

/// The second pass of a two-pass sum: one block of kThreads threads adds the `count` partials the
/// first pass left (one per block) into *result, in double.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* partials, int count, double* result) {
  __shared__ double shared[kThreads / kWarp];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

inline cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

/// Threads for a block that sweeps `units` items of one row: a multiple of the warp size, at
/// most `max_threads`, no more than there is work for.
inline int row_threads(I units, int max_threads) {
  const I t = (units + kWarp - 1) / kWarp * kWarp;
  return static_cast<int>(t < kWarp ? kWarp : t > max_threads ? max_threads : t);
}

/// Grid-stride launch size (device.h's grid_for) as a CUDA grid dimension.
inline unsigned blocks_for(I work, int threads) {
  return static_cast<unsigned>(grid_for(work, threads));
}

/// Calls f with the operand as a typed pointer: const float* (fp32) or const std::uint16_t*
/// (bf16 bit patterns); one instance of f per storage type.
template <class F>
void typed(kernels::Src x, F&& f) {
  if (x.bf16)
    f(static_cast<const std::uint16_t*>(x.p));
  else
    f(static_cast<const float*>(x.p));
}
template <class F>
void typed(kernels::Dst x, F&& f) {
  if (x.bf16)
    f(static_cast<std::uint16_t*>(x.p));
  else
    f(static_cast<float*>(x.p));
}
/// The storage type a typed pointer points to, const dropped.
template <class P>
using Elem = std::remove_const_t<std::remove_pointer_t<P>>;

}  // namespace tpx::cuda::dev
