// FP8 casts and the amax reduction on the device. The per-element work is common/fp8_bits.h's
// quantize / dequantize, the very functions the cpu backend loops over, so both backends write
// the same bytes. The scale (and amax) is one float in device memory, read by every thread: no
// cast waits for the host.
//
// Shape: grid-stride loops as in elementwise.cu. When n is a multiple of 4, the fp32 side is
// 16-byte aligned and the codes 4-byte aligned (always so for whole tensors), a thread handles
// four elements per iteration: one float4 and one 4-byte group of codes.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "common/fp8_bits.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;
using dev::ld4;
using dev::st4;

constexpr int kThreads = 256;

bool vectorizable(I n, const float* values, const std::uint8_t* codes) {
  return n % 4 == 0 && dev::aligned16(values) && reinterpret_cast<std::uintptr_t>(codes) % 4 == 0;
}

__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const float* x, const float* scale, std::uint8_t* q, I n, fp8::Format f,
                    bool vec) {
  const float s = *scale;
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 4; i += stride) {
      const float4 v = ld4(x, i);
      reinterpret_cast<uchar4*>(q)[i] =
          make_uchar4(fp8::quantize(v.x, s, f), fp8::quantize(v.y, s, f), fp8::quantize(v.z, s, f),
                      fp8::quantize(v.w, s, f));
    }
  } else {
    for (; i < n; i += stride) q[i] = fp8::quantize(x[i], s, f);
  }
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const std::uint8_t* q, const float* scale, float* x, I n, fp8::Format f,
                      bool vec) {
  const float s = *scale;
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 4; i += stride) {
      const uchar4 c = reinterpret_cast<const uchar4*>(q)[i];
      st4(x, i,
          make_float4(fp8::dequantize(c.x, s, f), fp8::dequantize(c.y, s, f),
                      fp8::dequantize(c.z, s, f), fp8::dequantize(c.w, s, f)));
    }
  } else {
    for (; i < n; i += stride) x[i] = fp8::dequantize(q[i], s, f);
  }
}

// amax on bit patterns: non-negative floats order like their bits read as unsigned integers, so
// the max of |x| is an integer max (atomicMax exists for unsigned, not for float). Every NaN is
// mapped to fp32's canonical quiet NaN, whose bits lie above +inf's: one NaN wins the max, and
// the result is the same NaN whichever it was. The order of the atomics does not matter: max is
// exact, so the result is deterministic.
__device__ __forceinline__ unsigned abs_bits(float v) {
  const unsigned a = fp8::float_bits(v) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? fp8::kNaNBits : a;
}

__device__ __forceinline__ unsigned umax(unsigned a, unsigned b) {
  return a > b ? a : b;
}

__global__ void __launch_bounds__(kThreads)
    amax_kernel(const float* x, I n, bool vec, unsigned* out) {
  __shared__ unsigned block_max;
  if (threadIdx.x == 0) block_max = 0;
  __syncthreads();
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned m = 0;
  if (vec) {
    for (; i < n / 4; i += stride) {
      const float4 v = ld4(x, i);
      m = umax(umax(m, umax(abs_bits(v.x), abs_bits(v.y))), umax(abs_bits(v.z), abs_bits(v.w)));
    }
  } else {
    for (; i < n; i += stride) m = umax(m, abs_bits(x[i]));
  }
  for (int o = dev::kWarp / 2; o > 0; o /= 2) m = umax(m, __shfl_xor_sync(dev::kFullMask, m, o));
  if (threadIdx.x % dev::kWarp == 0) atomicMax(&block_max, m);
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(out, block_max);
}

__global__ void fp8_scale_kernel(const float* amax, float fmax, float* scale) {
  *scale = fp8::scale_from_amax(*amax, fmax);
}

}  // namespace

void quantize_fp8(const float* x, const float* scale, std::uint8_t* q, I n, fp8::Format format,
                  void* stream) {
  if (n == 0) return;
  const bool vec = vectorizable(n, x, q);
  quantize_kernel<<<dev::blocks_for(vec ? n / 4 : n, kThreads), kThreads, 0,
                    dev::as_stream(stream)>>>(x, scale, q, n, format, vec);
}

void dequantize_fp8(const std::uint8_t* q, const float* scale, float* x, I n, fp8::Format format,
                    void* stream) {
  if (n == 0) return;
  const bool vec = vectorizable(n, x, q);
  dequantize_kernel<<<dev::blocks_for(vec ? n / 4 : n, kThreads), kThreads, 0,
                      dev::as_stream(stream)>>>(q, scale, x, n, format, vec);
}

void amax(const float* x, I n, float* out, void* stream) {
  // +0.0f, the max of nothing and the identity of the max. An error of this call surfaces in the
  // caller's cudaGetLastError() with the kernel's.
  static_cast<void>(cudaMemsetAsync(out, 0, sizeof(float), dev::as_stream(stream)));
  if (n == 0) return;
  const bool vec = n % 4 == 0 && dev::aligned16(x);
  amax_kernel<<<dev::blocks_for(vec ? n / 4 : n, kThreads), kThreads, 0, dev::as_stream(stream)>>>(
      x, n, vec, reinterpret_cast<unsigned*>(out));
}

void fp8_scale(const float* amax, float fmax, float* scale, void* stream) {
  fp8_scale_kernel<<<1, 1, 0, dev::as_stream(stream)>>>(amax, fmax, scale);
}

}  // namespace tpx::cuda::kernels
