// RMSNorm forward and backward over the rows of a [rows, h] matrix (rows = S·B tokens), fp32 or
// bf16: a bf16 x or dy is widened as it is loaded and a bf16 y or dx rounded once as it is stored
// (elementwise_ops.h); the statistics, the gain and its gradient are fp32.
//
// Forward and dx: one thread block per row. A row (h floats, 16 KiB at h = 4096) is read with
// float4 loads (four bf16 in one 8-byte load) strided across the block's threads, so each warp
// reads 512 contiguous bytes; the statistic Σx² is reduced in fp32 through warp shuffles and one
// shared-memory step. The second sweep over the row (normalise, or form dx) re-reads data this
// block has just brought into L1.
//
// dg = Σ_rows dy ⊙ x·rstd is a reduction down the columns, which a block-per-row kernel could only
// do with atomics on h addresses from every block (contention, and a non-deterministic sum). It is
// a separate column-parallel kernel instead: thread j owns column j of a chunk of rows (loads are
// coalesced across the warp, rstd[r] is a broadcast), writes one partial per chunk, and a second
// kernel adds the chunks in a fixed order. Deterministic, no atomics.
#include <cuda_runtime.h>

#include <algorithm>

#include "common.cuh"
#include "elementwise_ops.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::Elem;
using dev::I;
using dev::typed;
using elem::aligned4;
using elem::F4;
using elem::load;
using elem::load4;
using elem::store;
using elem::store4;

constexpr int kMaxThreads = 256;

int row_threads(I units) {
  return dev::row_threads(units, kMaxThreads);
}

template <bool kVec, class X, class Y>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_forward_kernel(const X* x, const float* g, Y* y, float* rstd, I h, float eps) {
  __shared__ float shared[dev::kWarp];
  const I row = blockIdx.x;
  const X* xr = x + row * h;
  Y* yr = y + row * h;
  float ss = 0.0f;
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const F4 v = load4(xr, i);
      ss += v.v[0] * v.v[0] + v.v[1] * v.v[1] + v.v[2] * v.v[2] + v.v[3] * v.v[3];
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) {
      const float v = load(xr, i);
      ss += v * v;
    }
  }
  ss = dev::block_sum(ss, shared);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) rstd[row] = inv;
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const F4 v = load4(xr, i), w = load4(g, i);
      F4 out;
      for (int k = 0; k < 4; ++k) out.v[k] = elem::rmsnorm_y(v.v[k], inv, w.v[k]);
      store4(yr, i, out);
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x)
      store(yr, i, elem::rmsnorm_y(load(xr, i), inv, g[i]));
  }
}

// With n = x·rstd and y = n ⊙ g: dx = rstd · (dy⊙g − n · mean(dy⊙g⊙n)).
template <bool kVec, class T, class O>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_backward_dx_kernel(const T* dy, const T* x, const float* g, const float* rstd, O* dx,
                               I h) {
  __shared__ float shared[dev::kWarp];
  const I row = blockIdx.x;
  const T* xr = x + row * h;
  const T* dyr = dy + row * h;
  O* dxr = dx + row * h;
  const float inv = rstd[row];
  float dot = 0.0f;  // Σ dy·g·x (times rstd below)
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const F4 d = load4(dyr, i), v = load4(xr, i), w = load4(g, i);
      dot += d.v[0] * w.v[0] * v.v[0] + d.v[1] * w.v[1] * v.v[1] + d.v[2] * w.v[2] * v.v[2] +
             d.v[3] * w.v[3] * v.v[3];
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) dot += load(dyr, i) * g[i] * load(xr, i);
  }
  const float mean = dev::block_sum(dot, shared) * inv / static_cast<float>(h);
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const F4 d = load4(dyr, i), v = load4(xr, i), w = load4(g, i);
      F4 out;
      for (int k = 0; k < 4; ++k) out.v[k] = elem::rmsnorm_dx(d.v[k], v.v[k], w.v[k], inv, mean);
      store4(dxr, i, out);
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x)
      store(dxr, i, elem::rmsnorm_dx(load(dyr, i), load(xr, i), g[i], inv, mean));
  }
}

// Grid (column blocks, row chunks). Thread (j, chunk) sums dy·x·rstd over its chunk's rows.
template <class T>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_dg_partial_kernel(const T* dy, const T* x, const float* rstd, float* partial, I rows,
                              I h, I rows_per_chunk) {
  const I j = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  const I r0 = I(blockIdx.y) * rows_per_chunk;
  const I r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = 0.0f;
  for (I r = r0; r < r1; ++r) acc += load(dy, r * h + j) * (load(x, r * h + j) * rstd[r]);
  partial[I(blockIdx.y) * h + j] = acc;
}

// dg[j] = Σ_chunks partial[chunk, j], in chunk order.
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_dg_sum_kernel(const float* partial, float* dg, I chunks, I h) {
  const I j = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  float acc = 0.0f;
  for (I c = 0; c < chunks; ++c) acc += partial[c * h + j];
  dg[j] = acc;
}

}  // namespace

void rmsnorm_forward(Src x, const float* g, Dst y, float* rstd, I rows, I h, float eps,
                     void* stream) {
  if (rows == 0) return;
  typed(x, [&](auto* px) {
    typed(y, [&](auto* py) {
      const bool vec = h % 4 == 0 && aligned4(px) && aligned4(g) && aligned4(py);
      const int threads = row_threads(vec ? h / 4 : h);
      const auto grid = static_cast<unsigned>(rows);
      using X = Elem<decltype(px)>;
      using Y = Elem<decltype(py)>;
      if (vec)
        rmsnorm_forward_kernel<true, X, Y>
            <<<grid, threads, 0, dev::as_stream(stream)>>>(px, g, py, rstd, h, eps);
      else
        rmsnorm_forward_kernel<false, X, Y>
            <<<grid, threads, 0, dev::as_stream(stream)>>>(px, g, py, rstd, h, eps);
    });
  });
}

void rmsnorm_backward_dx(Src dy, Src x, const float* g, const float* rstd, Dst dx, I rows, I h,
                         void* stream) {
  if (rows == 0) return;
  typed(x, [&](auto* px) {
    using T = Elem<decltype(px)>;
    const auto* pdy = static_cast<const T*>(dy.p);
    typed(dx, [&](auto* pdx) {
      using O = Elem<decltype(pdx)>;
      const bool vec = h % 4 == 0 && aligned4(pdy) && aligned4(px) && aligned4(g) && aligned4(pdx);
      const int threads = row_threads(vec ? h / 4 : h);
      const auto grid = static_cast<unsigned>(rows);
      if (vec)
        rmsnorm_backward_dx_kernel<true, T, O>
            <<<grid, threads, 0, dev::as_stream(stream)>>>(pdy, px, g, rstd, pdx, h);
      else
        rmsnorm_backward_dx_kernel<false, T, O>
            <<<grid, threads, 0, dev::as_stream(stream)>>>(pdy, px, g, rstd, pdx, h);
    });
  });
}

int rmsnorm_dg_chunks(I rows, I h) {
  // Enough (column block, chunk) blocks to fill the device, but at least 16 rows per chunk so a
  // thread's loop amortises its partial's write.
  const I col_blocks = (h + kMaxThreads - 1) / kMaxThreads;
  const I target = dev::blocks_for(I{1} << 40, kMaxThreads);  // a full device's worth of blocks
  const I chunks = std::min((target + col_blocks - 1) / col_blocks, (rows + 15) / 16);
  return static_cast<int>(std::max<I>(1, chunks));
}

void rmsnorm_backward_dg(Src dy, Src x, const float* rstd, float* partial, float* dg, I rows, I h,
                         void* stream) {
  const I chunks = rmsnorm_dg_chunks(rows, h);
  const I per_chunk = (rows + chunks - 1) / chunks;
  const int threads = row_threads(h);
  const auto col_blocks = static_cast<unsigned>((h + threads - 1) / threads);
  typed(x, [&](auto* px) {
    using T = Elem<decltype(px)>;
    rmsnorm_dg_partial_kernel<<<dim3(col_blocks, static_cast<unsigned>(chunks)), threads, 0,
                                dev::as_stream(stream)>>>(static_cast<const T*>(dy.p), px, rstd,
                                                          partial, rows, h, per_chunk);
  });
  rmsnorm_dg_sum_kernel<<<col_blocks, threads, 0, dev::as_stream(stream)>>>(partial, dg, chunks, h);
}

}  // namespace tpx::cuda::kernels
