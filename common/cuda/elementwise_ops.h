// The per-element work of the backend's own elementwise kernels (elementwise.cu, rmsnorm.cu,
// rope.cu), written once for the device and the host: the kernels run these functors, and
// tests/test_cuda_twins.cc runs the same functors over host memory and compares them bit for bit
// with the cpu backend, so the rules below are checked on machines without a GPU.
//
// The op boundary of the mixed-precision recipe (DESIGN.md, "Mixed precision"), in registers: an
// operand stored in bf16 is read with load(), which widens it exactly (a bf16 value is an fp32
// value whose 16 low bits are zero); the op computes in fp32 as it does on fp32 tensors; an output
// stored in bf16 is rounded once, to nearest even, by store(). These are the rounding points of
// tpx::ops' Fp32Boundary (one rounding per op output, none inside), without its fp32 copies in
// memory. bf16 values are stored as their bit patterns, std::uint16_t (kernels.h).
//
// Each functor takes its operands' storage types as template parameters (float or
// std::uint16_t) and defines one(i), element i, and four(i), elements 4i .. 4i + 3 (the kernels'
// vector path: 16-byte loads of fp32, 8-byte loads of bf16).
//
// defines: tpx::cuda::elem::{widen, round_bf16, load, store, load4, store4, F4,
//          aligned4, sigmoid, Sgd, AdamW, Fill, Add, SwigluForward, SwigluBackward, MseBackward,
//          RmsNormY, RmsNormDx, rope_pair, mul_rn, add_rn, sub_rn}
#pragma once

#include "common/host_device.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace tpx::cuda::elem {

using I = std::int64_t;

// --- storage <-> fp32 ----------------------------------------------------------------------------

/// The fp32 value of a bf16 bit pattern (exact).
TPX_HD inline float widen(std::uint16_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
#else
  const std::uint32_t u = std::uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/// x rounded to the nearest bf16, ties to even, as its bit pattern: on the device the conversion
/// instruction (__float2bfloat16_rn, as the cast kernels), on the host the same rounding on the
/// bits, as tpx::bf16_bits (a NaN stays a NaN, made quiet).
TPX_HD inline std::uint16_t round_bf16(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

TPX_HD inline float load(const float* p, I i) {
  return p[i];
}
TPX_HD inline float load(const std::uint16_t* p, I i) {
  return widen(p[i]);
}
TPX_HD inline void store(float* p, I i, float v) {
  p[i] = v;
}
TPX_HD inline void store(std::uint16_t* p, I i, float v) {
  p[i] = round_bf16(v);
}

/// Four consecutive values in fp32.
struct F4 {
  float v[4];
};

/// Elements 4i .. 4i + 3: one 16-byte load of fp32, one 8-byte load of bf16 on the device.
TPX_HD inline F4 load4(const float* p, I i) {
#if defined(__CUDA_ARCH__)
  const float4 x = reinterpret_cast<const float4*>(p)[i];
  return {{x.x, x.y, x.z, x.w}};
#else
  return {{p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]}};
#endif
}
TPX_HD inline F4 load4(const std::uint16_t* p, I i) {
#if defined(__CUDA_ARCH__)
  const uint2 r = reinterpret_cast<const uint2*>(p)[i];  // little-endian: element 4i is r.x's low
  return {{__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
           __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u)}};
#else
  return {{widen(p[4 * i]), widen(p[4 * i + 1]), widen(p[4 * i + 2]), widen(p[4 * i + 3])}};
#endif
}
TPX_HD inline void store4(float* p, I i, const F4& x) {
#if defined(__CUDA_ARCH__)
  reinterpret_cast<float4*>(p)[i] = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
#else
  for (int k = 0; k < 4; ++k) p[4 * i + k] = x.v[k];
#endif
}
TPX_HD inline void store4(std::uint16_t* p, I i, const F4& x) {
#if defined(__CUDA_ARCH__)
  const auto b = [&](int k) { return static_cast<unsigned>(round_bf16(x.v[k])); };
  reinterpret_cast<uint2*>(p)[i] = make_uint2(b(0) | (b(1) << 16), b(2) | (b(3) << 16));
#else
  for (int k = 0; k < 4; ++k) p[4 * i + k] = round_bf16(x.v[k]);
#endif
}

/// Whether load4 / store4 may be used on p: 16-byte aligned fp32, 8-byte aligned bf16.
inline bool aligned4(const float* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}
inline bool aligned4(const std::uint16_t* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 8 == 0;
}

// fp32 products and sums rounded one at a time (host_device.h): never contracted into an FMA.
using hd::add_rn;
using hd::div_rn;
using hd::mul_rn;
using hd::sqrt_rn;
using hd::sub_rn;

// --- the ops -------------------------------------------------------------------------------------

/// SGD (tpx::ops::sgd_update): w −= lr·g, the product and the difference rounded one at a time as
/// the cpu's. With `copy` (else null) the same pass writes the new w rounded to bf16: the compute
/// copy of the --dtype bf16 recipe.
struct Sgd {
  float* w;
  const float* g;
  float lr;
  std::uint16_t* copy;
  TPX_HD float next(float wi, float gi) const { return sub_rn(wi, mul_rn(lr, gi)); }
  TPX_HD void one(I i) const {
    w[i] = next(w[i], g[i]);
    if (copy) copy[i] = round_bf16(w[i]);
  }
  TPX_HD void four(I i) const {
    F4 x = load4(w, i);
    const F4 d = load4(g, i);
    for (int k = 0; k < 4; ++k) x.v[k] = next(x.v[k], d.v[k]);
    store4(w, i, x);
    if (copy) store4(copy, i, x);
  }
};

/// AdamW (tpx::ops::adamw_update): the cpu's fp32 operations in the cpu's order, none contracted
/// into an FMA. `copy` as Sgd's. four(i) updates elements 4i .. 4i + 3, as every vector path.
struct AdamW {
  float* w;
  const float* g;
  float* m;
  float* v;
  float beta1, beta2, eps, decay, step_size, sqrt_bias2;
  std::uint16_t* copy;
  /// Element-wise: the new m, v and w from the old ones and the gradient.
  TPX_HD void next(float& wi, float& mi, float& vi, float gi) const {
    mi = add_rn(mul_rn(beta1, mi), mul_rn(1.0f - beta1, gi));
    vi = add_rn(mul_rn(beta2, vi), mul_rn(1.0f - beta2, mul_rn(gi, gi)));
    const float denom = add_rn(div_rn(sqrt_rn(vi), sqrt_bias2), eps);
    wi = sub_rn(mul_rn(wi, decay), mul_rn(step_size, div_rn(mi, denom)));
  }
  TPX_HD void one(I i) const {
    next(w[i], m[i], v[i], g[i]);
    if (copy) copy[i] = round_bf16(w[i]);
  }
  TPX_HD void four(I i) const {
    F4 x = load4(w, i), mm = load4(m, i), vv = load4(v, i);
    const F4 d = load4(g, i);
    for (int k = 0; k < 4; ++k) next(x.v[k], mm.v[k], vv.v[k], d.v[k]);
    store4(w, i, x);
    store4(m, i, mm);
    store4(v, i, vv);
    if (copy) store4(copy, i, x);
  }
};

/// Full-precision expf (not __expf): the kernels are memory bound, accuracy is free.
TPX_HD inline float sigmoid(float z) {
  return 1.0f / (1.0f + expf(-z));
}

template <class T>
struct Fill {
  T* p;
  float v;
  TPX_HD void one(I i) const { store(p, i, v); }
  TPX_HD void four(I i) const { store4(p, i, F4{{v, v, v, v}}); }
};

/// out = a + b (out may alias a or b: each element is read before it is written).
template <class A, class B, class O>
struct Add {
  const A* a;
  const B* b;
  O* out;
  TPX_HD void one(I i) const { store(out, i, load(a, i) + load(b, i)); }
  TPX_HD void four(I i) const {
    const F4 x = load4(a, i), y = load4(b, i);
    store4(out, i, F4{{x.v[0] + y.v[0], x.v[1] + y.v[1], x.v[2] + y.v[2], x.v[3] + y.v[3]}});
  }
};

/// out = silu(gate)·up, with the cpu's operations in the cpu's order.
template <class T, class O>
struct SwigluForward {
  const T* gate;
  const T* up;
  O* out;
  TPX_HD static float f(float g, float u) { return g * sigmoid(g) * u; }
  TPX_HD void one(I i) const { store(out, i, f(load(gate, i), load(up, i))); }
  TPX_HD void four(I i) const {
    const F4 g = load4(gate, i), u = load4(up, i);
    store4(out, i,
           F4{{f(g.v[0], u.v[0]), f(g.v[1], u.v[1]), f(g.v[2], u.v[2]), f(g.v[3], u.v[3])}});
  }
};

/// d/dz silu(z) = σ(z)·(1 + z·(1 − σ(z))); dup = dout·silu(gate), dgate = dout·up·silu'(gate),
/// with the cpu's operations in the cpu's order.
template <class T, class O>
struct SwigluBackward {
  const T* dout;
  const T* gate;
  const T* up;
  O* dgate;
  O* dup;
  TPX_HD static void f(float d, float g, float u, float& dg, float& du) {
    const float s = sigmoid(g);
    du = d * (g * s);
    dg = d * u * s * (1.0f + g * (1.0f - s));
  }
  TPX_HD void one(I i) const {
    float dg, du;
    f(load(dout, i), load(gate, i), load(up, i), dg, du);
    store(dgate, i, dg);
    store(dup, i, du);
  }
  TPX_HD void four(I i) const {
    const F4 d = load4(dout, i), g = load4(gate, i), u = load4(up, i);
    F4 dg, du;
    for (int k = 0; k < 4; ++k) f(d.v[k], g.v[k], u.v[k], dg.v[k], du.v[k]);
    store4(dgate, i, dg);
    store4(dup, i, du);
  }
};

/// dy = scale·(y − t): the difference in fp32 (as the cpu backend), the scaling in double.
template <class Y, class T, class O>
struct MseBackward {
  const Y* y;
  const T* t;
  double scale;
  O* dy;
  TPX_HD float f(float a, float b) const { return static_cast<float>(scale * double(a - b)); }
  TPX_HD void one(I i) const { store(dy, i, f(load(y, i), load(t, i))); }
  TPX_HD void four(I i) const {
    const F4 a = load4(y, i), b = load4(t, i);
    store4(dy, i, F4{{f(a.v[0], b.v[0]), f(a.v[1], b.v[1]), f(a.v[2], b.v[2]), f(a.v[3], b.v[3])}});
  }
};

/// RMSNorm forward's second sweep, given the row's inverse rms `inv`: y = x·inv·g (the cpu's
/// order). The statistic itself is a reduction (rmsnorm.cu), not an element-wise step.
TPX_HD inline float rmsnorm_y(float x, float inv, float g) {
  return x * inv * g;
}
/// RMSNorm backward's dx, given the row's inverse rms and mean = Σ dy·g·x·inv / h:
/// dx = inv·(dy·g − x·inv·mean), the cpu's order.
TPX_HD inline float rmsnorm_dx(float dy, float x, float g, float inv, float mean) {
  return inv * (dy * g - x * inv * mean);
}

/// RoPE's rotation of the pair (x1, x2) by the angle whose cos is c and (signed) sin is s:
/// (x1·c − x2·s, x2·c + x1·s), every product and sum rounded on its own (no FMA), as the cpu.
TPX_HD inline void rope_pair(float& x1, float& x2, float c, float s) {
  const float a = x1, b = x2;
  x1 = sub_rn(mul_rn(a, c), mul_rn(b, s));
  x2 = add_rn(mul_rn(b, c), mul_rn(a, s));
}

}  // namespace tpx::cuda::elem
