// RMSNorm forward and backward over the rows of a [rows, h] fp32 matrix (rows = S·B tokens).
//
// Forward and dx: one thread block per row. A row (h floats, 16 KiB at h = 4096) is read with
// float4 loads strided across the block's threads, so each warp reads 512 contiguous bytes; the
// statistic Σx² is reduced in fp32 through warp shuffles and one shared-memory step. The second
// sweep over the row (normalise, or form dx) re-reads data this block has just brought into L1.
//
// dg = Σ_rows dy ⊙ x·rstd is a reduction down the columns, which a block-per-row kernel could only
// do with atomics on h addresses from every block (contention, and a non-deterministic sum). It is
// a separate column-parallel kernel instead: thread j owns column j of a chunk of rows (loads are
// coalesced across the warp, rstd[r] is a broadcast), writes one partial per chunk, and a second
// kernel adds the chunks in a fixed order. Deterministic, no atomics.
#include <cuda_runtime.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;
using dev::ld4;
using dev::st4;

constexpr int kMaxThreads = 256;

/// Threads for a block that sweeps `units` items of one row: a multiple of the warp size, at
/// most kMaxThreads, no more than there is work for.
int row_threads(I units) {
  const I t = std::min<I>(kMaxThreads, (units + dev::kWarp - 1) / dev::kWarp * dev::kWarp);
  return static_cast<int>(std::max<I>(dev::kWarp, t));
}

template <bool kVec>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_forward_kernel(const float* x, const float* g, float* y, float* rstd, I h, float eps) {
  __shared__ float shared[dev::kWarp];
  const I row = blockIdx.x;
  const float* xr = x + row * h;
  float* yr = y + row * h;
  float ss = 0.0f;
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const float4 v = ld4(xr, i);
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
  }
  ss = dev::block_sum(ss, shared);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) rstd[row] = inv;
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const float4 v = ld4(xr, i), w = ld4(g, i);
      st4(yr, i, make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w));
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) yr[i] = xr[i] * inv * g[i];
  }
}

// With n = x·rstd and y = n ⊙ g: dx = rstd · (dy⊙g − n · mean(dy⊙g⊙n)).
template <bool kVec>
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_backward_dx_kernel(const float* dy, const float* x, const float* g, const float* rstd,
                               float* dx, I h) {
  __shared__ float shared[dev::kWarp];
  const I row = blockIdx.x;
  const float* xr = x + row * h;
  const float* dyr = dy + row * h;
  float* dxr = dx + row * h;
  const float inv = rstd[row];
  float dot = 0.0f;  // Σ dy·g·x (times rstd below)
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const float4 d = ld4(dyr, i), v = ld4(xr, i), w = ld4(g, i);
      dot += d.x * w.x * v.x + d.y * w.y * v.y + d.z * w.z * v.z + d.w * w.w * v.w;
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) dot += dyr[i] * g[i] * xr[i];
  }
  const float mean = dev::block_sum(dot, shared) * inv / static_cast<float>(h);
  const float c = inv * mean;  // dx = inv·dy·g − x·inv·c
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x) {
      const float4 d = ld4(dyr, i), v = ld4(xr, i), w = ld4(g, i);
      st4(dxr, i,
          make_float4(inv * (d.x * w.x - v.x * c), inv * (d.y * w.y - v.y * c),
                      inv * (d.z * w.z - v.z * c), inv * (d.w * w.w - v.w * c)));
    }
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) dxr[i] = inv * (dyr[i] * g[i] - xr[i] * c);
  }
}

// Grid (column blocks, row chunks). Thread (j, chunk) sums dy·x·rstd over its chunk's rows.
__global__ void __launch_bounds__(kMaxThreads)
    rmsnorm_dg_partial_kernel(const float* dy, const float* x, const float* rstd, float* partial,
                              I rows, I h, I rows_per_chunk) {
  const I j = I(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  const I r0 = I(blockIdx.y) * rows_per_chunk;
  const I r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = 0.0f;
  for (I r = r0; r < r1; ++r) acc += dy[r * h + j] * (x[r * h + j] * rstd[r]);
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

void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, I rows, I h, float eps,
                     void* stream) {
  if (rows == 0) return;
  const bool vec = h % 4 == 0 && dev::aligned16(x, g, y);
  const int threads = row_threads(vec ? h / 4 : h);
  const auto grid = static_cast<unsigned>(rows);
  if (vec)
    rmsnorm_forward_kernel<true>
        <<<grid, threads, 0, dev::as_stream(stream)>>>(x, g, y, rstd, h, eps);
  else
    rmsnorm_forward_kernel<false>
        <<<grid, threads, 0, dev::as_stream(stream)>>>(x, g, y, rstd, h, eps);
}

void rmsnorm_backward_dx(const float* dy, const float* x, const float* g, const float* rstd,
                         float* dx, I rows, I h, void* stream) {
  if (rows == 0) return;
  const bool vec = h % 4 == 0 && dev::aligned16(dy, x, g, dx);
  const int threads = row_threads(vec ? h / 4 : h);
  const auto grid = static_cast<unsigned>(rows);
  if (vec)
    rmsnorm_backward_dx_kernel<true>
        <<<grid, threads, 0, dev::as_stream(stream)>>>(dy, x, g, rstd, dx, h);
  else
    rmsnorm_backward_dx_kernel<false>
        <<<grid, threads, 0, dev::as_stream(stream)>>>(dy, x, g, rstd, dx, h);
}

int rmsnorm_dg_chunks(I rows, I h) {
  // Enough (column block, chunk) blocks to fill the device, but at least 16 rows per chunk so a
  // thread's loop amortises its partial's write.
  const I col_blocks = (h + kMaxThreads - 1) / kMaxThreads;
  const I target = dev::blocks_for(I{1} << 40, kMaxThreads);  // a full device's worth of blocks
  const I chunks = std::min((target + col_blocks - 1) / col_blocks, (rows + 15) / 16);
  return static_cast<int>(std::max<I>(1, chunks));
}

void rmsnorm_backward_dg(const float* dy, const float* x, const float* rstd, float* partial,
                         float* dg, I rows, I h, void* stream) {
  const I chunks = rmsnorm_dg_chunks(rows, h);
  const I per_chunk = (rows + chunks - 1) / chunks;
  const int threads = row_threads(h);
  const auto col_blocks = static_cast<unsigned>((h + threads - 1) / threads);
  rmsnorm_dg_partial_kernel<<<dim3(col_blocks, static_cast<unsigned>(chunks)), threads, 0,
                              dev::as_stream(stream)>>>(dy, x, rstd, partial, rows, h, per_chunk);
  rmsnorm_dg_sum_kernel<<<col_blocks, threads, 0, dev::as_stream(stream)>>>(partial, dg, chunks, h);
}

}  // namespace tpx::cuda::kernels
