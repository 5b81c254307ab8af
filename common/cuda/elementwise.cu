// Element-wise kernels and reductions over flat fp32 arrays.
//
// Shape: every kernel is a grid-stride loop over the elements, with just enough blocks to fill
// the device (device.h's grid_for). When the element count is a multiple of 4 and every pointer is
// 16-byte aligned (always true for whole tensors from the caching allocator) each thread moves
// float4s: one 16-byte load per operand per iteration, the widest a thread can issue, so a warp
// touches 512 contiguous bytes. Otherwise the scalar loop runs (odd sizes, sliced views).
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

// Full-precision expf (not __expf): these kernels are memory bound, accuracy is free.
__device__ __forceinline__ float sigmoid(float z) {
  return 1.0f / (1.0f + expf(-z));
}

// Each op is a functor applied per element; the kernel below runs it either on float4 groups
// (vectorised) or on single elements. Arity is fixed per op, so each functor defines both.

struct Fill {
  float* p;
  float v;
  __device__ void one(I i) const { p[i] = v; }
  __device__ void four(I i) const { st4(p, i, make_float4(v, v, v, v)); }
};

struct Add {
  const float* a;
  const float* b;
  float* out;
  __device__ void one(I i) const { out[i] = a[i] + b[i]; }
  __device__ void four(I i) const {
    const float4 x = ld4(a, i), y = ld4(b, i);
    st4(out, i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
  }
};

// AdamW per element, with the cpu's operations in the cpu's order and no contraction into FMA
// (the __f*_rn intrinsics), so that both backends round alike.
struct AdamW {
  float* w;
  const float* g;
  float* m;
  float* v;
  float beta1, beta2, eps, decay, step_size, sqrt_bias2;
  __device__ void one(I i) const {
    const float gi = g[i];
    const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, gi));
    const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(1.0f - beta2, __fmul_rn(gi, gi)));
    m[i] = mi;
    v[i] = vi;
    const float wi = __fmul_rn(w[i], decay);
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), sqrt_bias2), eps);
    w[i] = __fsub_rn(wi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
  }
  __device__ void four(I i) const {
    for (I k = 0; k < 4; ++k) one(i + k);
  }
};

struct Sgd {
  float* w;
  const float* g;
  float lr;
  __device__ void one(I i) const { w[i] -= lr * g[i]; }
  __device__ void four(I i) const {
    float4 x = ld4(w, i);
    const float4 d = ld4(g, i);
    x.x -= lr * d.x;
    x.y -= lr * d.y;
    x.z -= lr * d.z;
    x.w -= lr * d.w;
    st4(w, i, x);
  }
};

struct SwigluForward {
  const float* gate;
  const float* up;
  float* out;
  __device__ static float f(float g, float u) { return g * sigmoid(g) * u; }
  __device__ void one(I i) const { out[i] = f(gate[i], up[i]); }
  __device__ void four(I i) const {
    const float4 g = ld4(gate, i), u = ld4(up, i);
    st4(out, i, make_float4(f(g.x, u.x), f(g.y, u.y), f(g.z, u.z), f(g.w, u.w)));
  }
};

// d/dz silu(z) = σ(z)·(1 + z·(1 − σ(z))); dup = dout·silu(gate), dgate = dout·up·silu'(gate).
struct SwigluBackward {
  const float* dout;
  const float* gate;
  const float* up;
  float* dgate;
  float* dup;
  __device__ static void f(float d, float g, float u, float& dg, float& du) {
    const float s = sigmoid(g);
    du = d * g * s;
    dg = d * u * s * (1.0f + g * (1.0f - s));
  }
  __device__ void one(I i) const { f(dout[i], gate[i], up[i], dgate[i], dup[i]); }
  __device__ void four(I i) const {
    const float4 d = ld4(dout, i), g = ld4(gate, i), u = ld4(up, i);
    float4 dg, du;
    f(d.x, g.x, u.x, dg.x, du.x);
    f(d.y, g.y, u.y, dg.y, du.y);
    f(d.z, g.z, u.z, dg.z, du.z);
    f(d.w, g.w, u.w, dg.w, du.w);
    st4(dgate, i, dg);
    st4(dup, i, du);
  }
};

// dy = scale·(y − t): the difference in fp32 (as the cpu backend), the scaling in double.
struct MseBackward {
  const float* y;
  const float* t;
  double scale;
  float* dy;
  __device__ float f(float a, float b) const { return static_cast<float>(scale * double(a - b)); }
  __device__ void one(I i) const { dy[i] = f(y[i], t[i]); }
  __device__ void four(I i) const {
    const float4 a = ld4(y, i), b = ld4(t, i);
    st4(dy, i, make_float4(f(a.x, b.x), f(a.y, b.y), f(a.z, b.z), f(a.w, b.w)));
  }
};

template <class Op>
__global__ void __launch_bounds__(kThreads) map_kernel(Op op, I n, bool vec) {
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 4; i += stride) op.four(i);
  } else {
    for (; i < n; i += stride) op.one(i);
  }
}

template <class Op, class... P>
void launch_map(const Op& op, I n, void* stream, const P*... ptrs) {
  if (n == 0) return;
  const bool vec = n % 4 == 0 && dev::aligned16(ptrs...);
  const I work = vec ? n / 4 : n;
  map_kernel<<<dev::blocks_for(work, kThreads), kThreads, 0, dev::as_stream(stream)>>>(op, n, vec);
}

// fp32 -> bf16, round to nearest even. Vector path: 8 elements per thread per iteration, two
// 16-byte loads of fp32 and one 16-byte store of bf16.
__global__ void __launch_bounds__(kThreads)
    f32_to_bf16_kernel(const float* in, __nv_bfloat16* out, I n, bool vec) {
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 8; i += stride) {
      const float4 a = ld4(in, 2 * i), b = ld4(in, 2 * i + 1);
      __align__(16)
          __nv_bfloat162 r[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                                 __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
      reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(r);
    }
  } else {
    for (; i < n; i += stride) out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    bf16_to_f32_kernel(const __nv_bfloat16* in, float* out, I n, bool vec) {
  const I stride = I(gridDim.x) * blockDim.x;
  I i = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 8; i += stride) {
      const uint4 raw = reinterpret_cast<const uint4*>(in)[i];
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
      const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
      const float2 c = __bfloat1622float2(h[2]), d = __bfloat1622float2(h[3]);
      st4(out, 2 * i, make_float4(a.x, a.y, b.x, b.y));
      st4(out, 2 * i + 1, make_float4(c.x, c.y, d.x, d.y));
    }
  } else {
    for (; i < n; i += stride) out[i] = __bfloat162float(in[i]);
  }
}

// Σ (x − y)² in double (the difference too, as the cpu backend does). Pass 1: each block reduces
// its grid-stride share into partials[block]; pass 2: one block adds the partials in a fixed order.
// Deterministic, no atomics. Double per thread costs nothing here: the loop is bound by memory
// bandwidth, not arithmetic.
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const float* x, const float* y, I n, double* partials) {
  __shared__ double shared[kThreads / dev::kWarp];
  const I stride = I(gridDim.x) * blockDim.x;
  double acc = 0.0;
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double d = y ? double(x[i]) - double(y[i]) : double(x[i]);
    acc += d * d;
  }
  acc = dev::block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* partials, int count, double* result) {
  __shared__ double shared[kThreads / dev::kWarp];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = dev::block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

}  // namespace

void fill(float* p, float value, I n, void* stream) {
  launch_map(Fill{p, value}, n, stream, p);
}

void add(const float* a, const float* b, float* out, I n, void* stream) {
  launch_map(Add{a, b, out}, n, stream, a, b, out);
}

void sgd(float* w, const float* grad, float lr, I n, void* stream) {
  launch_map(Sgd{w, grad, lr}, n, stream, w, grad);
}

void adamw(float* w, const float* grad, float* m, float* v, float beta1, float beta2, float eps,
           float decay, float step_size, float sqrt_bias2, I n, void* stream) {
  launch_map(AdamW{w, grad, m, v, beta1, beta2, eps, decay, step_size, sqrt_bias2}, n, stream, w,
             grad, m, v);
}

void swiglu_forward(const float* gate, const float* up, float* out, I n, void* stream) {
  launch_map(SwigluForward{gate, up, out}, n, stream, gate, up, out);
}

void swiglu_backward(const float* dout, const float* gate, const float* up, float* dgate,
                     float* dup, I n, void* stream) {
  launch_map(SwigluBackward{dout, gate, up, dgate, dup}, n, stream, dout, gate, up, dgate, dup);
}

void mse_backward(const float* y, const float* t, double scale, float* dy, I n, void* stream) {
  launch_map(MseBackward{y, t, scale, dy}, n, stream, y, t, dy);
}

void f32_to_bf16(const float* in, std::uint16_t* out, I n, void* stream) {
  if (n == 0) return;
  const bool vec = n % 8 == 0 && dev::aligned16(in, out);
  f32_to_bf16_kernel<<<dev::blocks_for(vec ? n / 8 : n, kThreads), kThreads, 0,
                       dev::as_stream(stream)>>>(in, reinterpret_cast<__nv_bfloat16*>(out), n, vec);
}

void bf16_to_f32(const std::uint16_t* in, float* out, I n, void* stream) {
  if (n == 0) return;
  const bool vec = n % 8 == 0 && dev::aligned16(in, out);
  bf16_to_f32_kernel<<<dev::blocks_for(vec ? n / 8 : n, kThreads), kThreads, 0,
                       dev::as_stream(stream)>>>(reinterpret_cast<const __nv_bfloat16*>(in), out, n,
                                                 vec);
}

int reduction_blocks(I n) {
  return static_cast<int>(dev::blocks_for(n, kThreads));
}

void sum_squares(const float* x, const float* y, I n, double* partials, double* result,
                 void* stream) {
  const int blocks = reduction_blocks(n);
  sum_squares_kernel<<<blocks, kThreads, 0, dev::as_stream(stream)>>>(x, y, n, partials);
  sum_partials_kernel<<<1, kThreads, 0, dev::as_stream(stream)>>>(partials, blocks, result);
}

}  // namespace tpx::cuda::kernels
