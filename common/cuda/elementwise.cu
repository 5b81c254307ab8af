// Element-wise kernels and reductions over flat arrays of fp32 or bf16.
//
// Shape: every kernel is a grid-stride loop over the elements, with just enough blocks to fill
// the device (device.h's grid_for). When the element count is a multiple of 4 and every pointer is
// aligned for it (16 bytes for fp32, 8 for bf16: always true for whole tensors from the caching
// allocator) each thread moves four elements per operand per iteration, a float4 or four bf16 in
// one load, so a warp touches 512 (256) contiguous bytes. Otherwise the scalar loop runs (odd
// sizes, sliced views).
//
// The per-element work is elementwise_ops.h's functors, instantiated for the operands' storage
// types (Src / Dst, kernels.h): a bf16 operand is widened as it is loaded, a bf16 output rounded
// once as it is stored, so an op on bf16 tensors needs no fp32 copies of them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "elementwise_ops.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;
using dev::ld4;
using dev::st4;

constexpr int kThreads = 256;

using dev::Elem;
using dev::typed;
using elem::aligned4;

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
  const bool vec = n % 4 == 0 && (aligned4(ptrs) && ...);
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
template <class X, class Y>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const X* x, const Y* y, I n, double* partials) {
  __shared__ double shared[kThreads / dev::kWarp];
  const I stride = I(gridDim.x) * blockDim.x;
  double acc = 0.0;
  for (I i = I(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double d =
        y ? double(elem::load(x, i)) - double(elem::load(y, i)) : double(elem::load(x, i));
    acc += d * d;
  }
  acc = dev::block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

}  // namespace

void fill(Dst p, float value, I n, void* stream) {
  typed(p, [&](auto* t) { launch_map(elem::Fill<Elem<decltype(t)>>{t, value}, n, stream, t); });
}

void add(Src a, Src b, Dst out, I n, void* stream) {
  typed(a, [&](auto* pa) {
    typed(b, [&](auto* pb) {
      typed(out, [&](auto* po) {
        launch_map(
            elem::Add<Elem<decltype(pa)>, Elem<decltype(pb)>, Elem<decltype(po)>>{pa, pb, po}, n,
            stream, pa, pb, po);
      });
    });
  });
}

void sgd(float* w, const float* grad, float lr, std::uint16_t* copy, I n, void* stream) {
  const elem::Sgd op{w, grad, lr, copy};
  // The vector path needs the copy aligned too (null is).
  if (copy)
    launch_map(op, n, stream, w, grad, static_cast<const std::uint16_t*>(copy));
  else
    launch_map(op, n, stream, w, grad);
}

void adamw(float* w, const float* grad, float* m, float* v, float beta1, float beta2, float eps,
           float decay, float step_size, float sqrt_bias2, std::uint16_t* copy, I n, void* stream) {
  const elem::AdamW op{w, grad, m, v, beta1, beta2, eps, decay, step_size, sqrt_bias2, copy};
  if (copy)
    launch_map(op, n, stream, w, grad, m, v, static_cast<const std::uint16_t*>(copy));
  else
    launch_map(op, n, stream, w, grad, m, v);
}

void swiglu_forward(Src gate, Src up, Dst out, I n, void* stream) {
  typed(gate, [&](auto* g) {
    using T = Elem<decltype(g)>;
    const auto* u = static_cast<const T*>(up.p);
    typed(out, [&](auto* o) {
      launch_map(elem::SwigluForward<T, Elem<decltype(o)>>{g, u, o}, n, stream, g, u, o);
    });
  });
}

void swiglu_backward(Src dout, Src gate, Src up, Dst dgate, Dst dup, I n, void* stream) {
  typed(gate, [&](auto* g) {
    using T = Elem<decltype(g)>;
    const auto* d = static_cast<const T*>(dout.p);
    const auto* u = static_cast<const T*>(up.p);
    typed(dgate, [&](auto* dg) {
      using O = Elem<decltype(dg)>;
      auto* du = static_cast<O*>(dup.p);
      launch_map(elem::SwigluBackward<T, O>{d, g, u, dg, du}, n, stream, d, g, u, dg, du);
    });
  });
}

void mse_backward(Src y, Src t, double scale, Dst dy, I n, void* stream) {
  typed(y, [&](auto* py) {
    typed(t, [&](auto* pt) {
      typed(dy, [&](auto* pd) {
        launch_map(
            elem::MseBackward<Elem<decltype(py)>, Elem<decltype(pt)>, Elem<decltype(pd)>>{
                py, pt, scale, pd},
            n, stream, py, pt, pd);
      });
    });
  });
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

void sum_squares(Src x, Src y, I n, double* partials, double* result, void* stream) {
  const int blocks = reduction_blocks(n);
  typed(x, [&](auto* px) {
    typed(y, [&](auto* py) {
      sum_squares_kernel<<<blocks, kThreads, 0, dev::as_stream(stream)>>>(px, py, n, partials);
    });
  });
  dev::sum_partials_kernel<kThreads>
      <<<1, kThreads, 0, dev::as_stream(stream)>>>(partials, blocks, result);
}

}  // namespace tpx::cuda::kernels
