// Code that runs on the host and on the device: the TPX_HD marker, and fp32 arithmetic rounded
// one operation at a time. The cpu backend, the CUDA kernels and the tests' host twins of those
// kernels share the functions written with them (the FP8 casts, the element-wise ops, the
// attention kernels' index math), so a cpu test runs the same code a GPU does.
//
// defines: TPX_HD, tpx::hd::mul_rn, add_rn, sub_rn, div_rn, sqrt_rn
#pragma once

#include <cmath>

/// Marks a function callable from host and device code under nvcc; empty for the C++ compiler.
#if defined(__CUDACC__)
#define TPX_HD __host__ __device__
#else
#define TPX_HD
#endif

namespace tpx::hd {

/// a · b, a + b, a − b and a / b, each rounded to nearest fp32 on its own: on the device the
/// round-to-nearest intrinsics, which nvcc never contracts into an FMA and fast-math flags do not
/// touch; on the host the plain operators (the code that uses these is compiled without
/// contraction: -ffp-contract=off where it matters).
TPX_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TPX_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TPX_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TPX_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// √a rounded to nearest (IEEE 754's correctly rounded square root on both sides).
TPX_HD inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

}  // namespace tpx::hd
