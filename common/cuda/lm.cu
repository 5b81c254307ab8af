// The language model's two ends on the device (tpx::ops says what each op computes; the cpu
// twins are common/cpu/lm.cc): the embedding's gather and its scatter-add, and the
// vocabulary-parallel cross-entropy's passes over a rank's logits. Logits, their gradient and the
// embedding's output and gradient are read and written as stored, fp32 or bf16 (widened as loaded,
// rounded once, to nearest even, as stored: elementwise_ops.h); all math is fp32, the loss's sum
// double.
//
// cross_entropy_partial reads each row of logits once: one thread block per row, each thread
// keeping the running maximum m and the sum of exponentials s rescaled onto it (the online
// softmax, Milakov & Gimelshein 2018) over its strided share of the row, 16 bytes per load (four
// fp32 or eight bf16) when the rows are aligned for it. The threads' (m, s) pairs are merged by
// warp shuffles and one shared-memory step: (m1, s1) ∘ (m2, s2) = (m, s1·e^(m1−m) + s2·e^(m2−m))
// with m = max(m1, m2), in a fixed tree, so a row's result does not change from run to run.
// cross_entropy_backward is the same block-per-row sweep, writing scale·e^(z−lse) minus scale at
// the target, in the cpu's order of operations (no FMA contraction).
//
// embedding_backward must sum each table row's positions in position order (ops.h), which rules
// out float atomics (their order is the scheduler's). Instead the positions are sorted by the
// table row their id hits (CUB's radix sort, which is stable: within a row the positions stay in
// increasing order; ids outside this rank's rows get the key `rows` and sort last). Then one thread
// block per (sorted entry, column tile of 256 columns) finds whether its entry starts a row's run;
// if so it adds the run's dout rows into the table row in that order, each thread owning four
// columns. The adds are the cpu's, in the cpu's order, so the result equals the cpu backend's bit
// for bit. A block whose entry does not start a run returns at once. The tiles are small so that
// a frequent token's row, a serial sum over many positions, is spread over many blocks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <cstdint>
#include <type_traits>

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
/// Threads of a scatter-add block, each owning four columns of its tile.
constexpr int kScatterThreads = 64;

// --- 16-byte vectors: four fp32 or eight bf16 ---------------------------------------------------

template <class T>
constexpr int kVecWidth = 16 / static_cast<int>(sizeof(T));

/// Elements W·i .. W·i + W − 1 of p (16-byte aligned), widened to fp32.
__device__ __forceinline__ void load16(const float* p, I i, float (&v)[4]) {
  const float4 x = reinterpret_cast<const float4*>(p)[i];
  v[0] = x.x;
  v[1] = x.y;
  v[2] = x.z;
  v[3] = x.w;
}
__device__ __forceinline__ void load16(const std::uint16_t* p, I i, float (&v)[8]) {
  const uint4 r = reinterpret_cast<const uint4*>(p)[i];  // little-endian: element 8i is r.x's low
  const unsigned w[4] = {r.x, r.y, r.z, r.w};
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
/// Stores W values at W·i (bf16: each rounded once, to nearest even).
__device__ __forceinline__ void store16(float* p, I i, const float (&v)[4]) {
  reinterpret_cast<float4*>(p)[i] = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store16(std::uint16_t* p, I i, const float (&v)[8]) {
  unsigned w[4];
  for (int k = 0; k < 4; ++k)
    w[k] = unsigned(elem::round_bf16(v[2 * k])) | (unsigned(elem::round_bf16(v[2 * k + 1])) << 16);
  reinterpret_cast<uint4*>(p)[i] = make_uint4(w[0], w[1], w[2], w[3]);
}

/// Whether rows of `cols` elements starting at p may be read 16 bytes at a time.
template <class T>
bool rows_aligned16(const T* p, I cols) {
  return cols % kVecWidth<T> == 0 && dev::aligned16(p);
}

// --- the online softmax's (max, sum of exponentials) pairs ---------------------------------------

/// e^(x − m) for a term already below the running maximum m; a term equal to it contributes 1
/// (so −inf, −inf gives 1 · its sum rather than e^NaN).
__device__ __forceinline__ float rescale_factor(float x, float m) {
  return x == m ? 1.0f : expf(x - m);
}

/// (m, s) ∘= (m2, s2).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  s = s * rescale_factor(m, mm) + s2 * rescale_factor(m2, mm);
  m = mm;
}

/// Adds `count` values to (m, s): the maximum moves once for all of them, then one exponential
/// each. A −inf value adds nothing (also while m is still −inf); NaN makes s NaN.
template <int N>
__device__ __forceinline__ void add_values(float& m, float& s, const float (&v)[N]) {
  float mv = v[0];
  for (int k = 1; k < N; ++k) mv = fmaxf(mv, v[k]);
  if (mv > m) {
    s *= expf(m - mv);  // 0 while m is −inf
    m = mv;
  }
  for (int k = 0; k < N; ++k) s += v[k] == -INFINITY ? 0.0f : expf(v[k] - m);
}

/// The block's merged (m, s), returned to thread 0. Contains __syncthreads().
__device__ void block_merge(float& m, float& s) {
  __shared__ float shared_m[dev::kWarp], shared_s[dev::kWarp];
  const int lane = threadIdx.x % dev::kWarp, warp = threadIdx.x / dev::kWarp;
  const int warps = (blockDim.x + dev::kWarp - 1) / dev::kWarp;
  for (int o = dev::kWarp / 2; o > 0; o /= 2) {
    const float m2 = __shfl_xor_sync(dev::kFullMask, m, o);
    const float s2 = __shfl_xor_sync(dev::kFullMask, s, o);
    merge(m, s, m2, s2);
  }
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) merge(m, s, shared_m[w], shared_s[w]);
  }
}

/// The local column of `id` among the first `cols` columns of a shard starting at `begin`, or −1.
__device__ __forceinline__ I local_column(std::int32_t id, I begin, I cols) {
  const I j = I(id) - begin;
  return j >= 0 && j < cols ? j : -1;
}

// --- cross-entropy ----------------------------------------------------------------------------------

template <bool kVec, class T>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_partial_kernel(const T* z, const std::int32_t* targets, I cols, I real, I begin,
                                 float* max, float* sumexp, float* target_logit) {
  const I row = blockIdx.x;
  const T* zr = z + row * cols;
  float m = -INFINITY, s = 0.0f;
  I tail = 0;
  if constexpr (kVec) {
    constexpr int W = kVecWidth<T>;
    const I vectors = real / W;
    for (I i = threadIdx.x; i < vectors; i += blockDim.x) {
      float v[W];
      load16(zr, i, v);
      add_values(m, s, v);
    }
    tail = vectors * W;
  }
  for (I j = tail + threadIdx.x; j < real; j += blockDim.x) {
    const float v[1] = {load(zr, j)};
    add_values(m, s, v);
  }
  block_merge(m, s);
  if (threadIdx.x == 0) {
    max[row] = m;
    sumexp[row] = s;
    const I t = local_column(targets[row], begin, real);
    target_logit[row] = t < 0 ? 0.0f : load(zr, t);
  }
}

template <bool kVec, class T>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_backward_kernel(const T* z, const std::int32_t* targets, const float* lse, I cols,
                                  I real, I begin, float scale, T* dz) {
  const I row = blockIdx.x;
  const T* zr = z + row * cols;
  T* dr = dz + row * cols;
  const float l = lse[row];
  const I target = local_column(targets[row], begin, real);
  // scale · e^(z − lse), then − scale at the target (the cpu's two roundings), 0 in the padding.
  const auto grad = [&](I j, float x) {
    if (j >= real) return 0.0f;
    const float p = elem::mul_rn(scale, expf(x - l));
    return j == target ? elem::sub_rn(p, scale) : p;
  };
  I tail = 0;
  if constexpr (kVec) {
    constexpr int W = kVecWidth<T>;
    const I vectors = cols / W;
    for (I i = threadIdx.x; i < vectors; i += blockDim.x) {
      float v[W];
      load16(zr, i, v);
      for (int k = 0; k < W; ++k) v[k] = grad(i * W + k, v[k]);
      store16(dr, i, v);
    }
    tail = vectors * W;
  }
  for (I j = tail + threadIdx.x; j < cols; j += blockDim.x) store(dr, j, grad(j, load(zr, j)));
}

__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_rescale_kernel(const float* local_max, const float* max, float* sumexp, I n) {
  const I stride = I(gridDim.x) * blockDim.x;
  for (I r = I(blockIdx.x) * blockDim.x + threadIdx.x; r < n; r += stride) {
    const float lm = local_max[r];
    sumexp[r] = lm == -INFINITY ? 0.0f : sumexp[r] * expf(lm - max[r]);
  }
}

// lse = max + log(sumexp) in fp32; Σ (lse − target) in double, per block, then summed by one
// block in a fixed order (deterministic, no atomics).
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_loss_kernel(const float* max, const float* sumexp, const float* target_logit,
                              float* lse, I n, double* partials) {
  __shared__ double shared[kMaxThreads / dev::kWarp];
  const I stride = I(gridDim.x) * blockDim.x;
  double acc = 0.0;
  for (I r = I(blockIdx.x) * blockDim.x + threadIdx.x; r < n; r += stride) {
    const float l = max[r] + logf(sumexp[r]);
    lse[r] = l;
    acc += double(l) - double(target_logit[r]);
  }
  acc = dev::block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// --- embedding ----------------------------------------------------------------------------------

template <bool kVec, class O>
__global__ void __launch_bounds__(kMaxThreads)
    embedding_forward_kernel(const std::int32_t* ids, const float* table, I rows, I h, I begin,
                             O* out) {
  const I pos = blockIdx.x;
  const I j = local_column(ids[pos], begin, rows);
  const float* e = table + (j < 0 ? 0 : j) * h;
  O* y = out + pos * h;
  if constexpr (kVec) {
    for (I i = threadIdx.x; i < h / 4; i += blockDim.x)
      store4(y, i, j < 0 ? F4{{0.0f, 0.0f, 0.0f, 0.0f}} : load4(e, i));
  } else {
    for (I i = threadIdx.x; i < h; i += blockDim.x) store(y, i, j < 0 ? 0.0f : e[i]);
  }
}

/// keys[t] = the table row position t's id hits, or `rows` when it hits none; positions[t] = t.
__global__ void __launch_bounds__(kMaxThreads)
    embedding_keys_kernel(const std::int32_t* ids, I n, I rows, I begin, std::uint32_t* keys,
                          std::uint32_t* positions) {
  const I stride = I(gridDim.x) * blockDim.x;
  for (I t = I(blockIdx.x) * blockDim.x + threadIdx.x; t < n; t += stride) {
    const I j = local_column(ids[t], begin, rows);
    keys[t] = static_cast<std::uint32_t>(j < 0 ? rows : j);
    positions[t] = static_cast<std::uint32_t>(t);
  }
}

/// Block (e, tile): if sorted entry e starts a run of one table row, adds that run's dout rows
/// into the row's column tile, in the sorted (= position) order.
template <bool kVec, class T>
__global__ void __launch_bounds__(kScatterThreads)
    embedding_backward_kernel(const std::uint32_t* keys, const std::uint32_t* positions, I n,
                              I rows, const T* dout, I h, float* dtable) {
  const I e = blockIdx.x;
  const std::uint32_t key = keys[e];
  if (key == rows || (e > 0 && keys[e - 1] == key)) return;
  const I i = I(blockIdx.y) * blockDim.x + threadIdx.x;  // a column, or four of them (kVec)
  if (i >= (kVec ? h / 4 : h)) return;
  float* de = dtable + I(key) * h;
  if constexpr (kVec) {
    F4 acc = load4(de, i);
    for (I k = e; k < n && keys[k] == key; ++k) {
      const F4 d = load4(dout + I(positions[k]) * h, i);
      for (int c = 0; c < 4; ++c) acc.v[c] += d.v[c];
    }
    store4(de, i, acc);
  } else {
    float acc = de[i];
    for (I k = e; k < n && keys[k] == key; ++k) acc += load(dout + I(positions[k]) * h, i);
    de[i] = acc;
  }
}

/// The significant bits of the sort keys 0 … rows.
int key_bits(I rows) {
  int bits = 1;
  while (bits < 32 && (I{1} << bits) <= rows) ++bits;
  return bits;
}

/// Scratch of embedding_backward: keys and positions, in and sorted, then CUB's temporary
/// storage; each part 256-byte aligned.
struct EmbeddingScratch {
  std::size_t array = 0, sort = 0;
  std::size_t total() const { return 4 * array + sort; }
};
EmbeddingScratch embedding_scratch_layout(I n, I rows) {
  EmbeddingScratch s;
  s.array = (static_cast<std::size_t>(n) * sizeof(std::uint32_t) + 255) / 256 * 256;
  cub::DeviceRadixSort::SortPairs(
      nullptr, s.sort, static_cast<const std::uint32_t*>(nullptr),
      static_cast<std::uint32_t*>(nullptr), static_cast<const std::uint32_t*>(nullptr),
      static_cast<std::uint32_t*>(nullptr), static_cast<int>(n), 0, key_bits(rows));
  return s;
}

}  // namespace

void embedding_forward(const std::int32_t* ids, const float* table, I rows, I h, I begin, Dst out,
                       I n, void* stream) {
  if (n == 0 || h == 0) return;
  typed(out, [&](auto* po) {
    using O = Elem<decltype(po)>;
    const bool vec = h % 4 == 0 && aligned4(table) && aligned4(po);
    const int threads = dev::row_threads(vec ? h / 4 : h, kMaxThreads);
    const auto grid = static_cast<unsigned>(n);
    if (vec)
      embedding_forward_kernel<true, O>
          <<<grid, threads, 0, dev::as_stream(stream)>>>(ids, table, rows, h, begin, po);
    else
      embedding_forward_kernel<false, O>
          <<<grid, threads, 0, dev::as_stream(stream)>>>(ids, table, rows, h, begin, po);
  });
}

std::size_t embedding_backward_scratch_bytes(I n, I rows) {
  return embedding_scratch_layout(n, rows).total();
}

int embedding_backward(const std::int32_t* ids, Src dout, I n, I rows, I h, I begin, float* dtable,
                       void* scratch, void* stream) {
  if (n == 0 || h == 0) return 0;
  const EmbeddingScratch layout = embedding_scratch_layout(n, rows);
  auto* base = static_cast<char*>(scratch);
  auto* keys = reinterpret_cast<std::uint32_t*>(base);
  auto* positions = reinterpret_cast<std::uint32_t*>(base + layout.array);
  auto* sorted_keys = reinterpret_cast<std::uint32_t*>(base + 2 * layout.array);
  auto* sorted_positions = reinterpret_cast<std::uint32_t*>(base + 3 * layout.array);
  void* sort_storage = base + 4 * layout.array;
  const cudaStream_t s = dev::as_stream(stream);
  embedding_keys_kernel<<<dev::blocks_for(n, kMaxThreads), kMaxThreads, 0, s>>>(ids, n, rows, begin,
                                                                                keys, positions);
  std::size_t sort_bytes = layout.sort;
  const cudaError_t sorted =
      cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys, sorted_keys, positions,
                                      sorted_positions, static_cast<int>(n), 0, key_bits(rows), s);
  if (sorted != cudaSuccess) return static_cast<int>(sorted);
  typed(dout, [&](auto* pd) {
    using T = Elem<decltype(pd)>;
    const bool vec = h % 4 == 0 && aligned4(pd) && aligned4(dtable);
    const I units = vec ? h / 4 : h;
    const int threads = dev::row_threads(units, kScatterThreads);
    const dim3 grid(static_cast<unsigned>(n),
                    static_cast<unsigned>((units + threads - 1) / threads));
    if (vec)
      embedding_backward_kernel<true, T>
          <<<grid, threads, 0, s>>>(sorted_keys, sorted_positions, n, rows, pd, h, dtable);
    else
      embedding_backward_kernel<false, T>
          <<<grid, threads, 0, s>>>(sorted_keys, sorted_positions, n, rows, pd, h, dtable);
  });
  return 0;
}

void cross_entropy_partial(Src logits, const std::int32_t* targets, I n, I cols, I begin, I vocab,
                           float* max, float* sumexp, float* target_logit, void* stream) {
  if (n == 0) return;
  const I real = vocab - begin < 0 ? 0 : vocab - begin < cols ? vocab - begin : cols;
  typed(logits, [&](auto* pz) {
    using T = Elem<decltype(pz)>;
    const bool vec = rows_aligned16(pz, cols);
    const int threads = dev::row_threads(vec ? real / kVecWidth<T> : real, kMaxThreads);
    const auto grid = static_cast<unsigned>(n);
    if (vec)
      cross_entropy_partial_kernel<true, T><<<grid, threads, 0, dev::as_stream(stream)>>>(
          pz, targets, cols, real, begin, max, sumexp, target_logit);
    else
      cross_entropy_partial_kernel<false, T><<<grid, threads, 0, dev::as_stream(stream)>>>(
          pz, targets, cols, real, begin, max, sumexp, target_logit);
  });
}

void cross_entropy_rescale(const float* local_max, const float* max, float* sumexp, I n,
                           void* stream) {
  if (n == 0) return;
  cross_entropy_rescale_kernel<<<dev::blocks_for(n, kMaxThreads), kMaxThreads, 0,
                                 dev::as_stream(stream)>>>(local_max, max, sumexp, n);
}

int cross_entropy_loss_blocks(I n) {
  return static_cast<int>(dev::blocks_for(n, kMaxThreads));
}

void cross_entropy_loss(const float* max, const float* sumexp, const float* target_logit,
                        float* lse, I n, double* partials, double* result, void* stream) {
  const int blocks = cross_entropy_loss_blocks(n);
  cross_entropy_loss_kernel<<<blocks, kMaxThreads, 0, dev::as_stream(stream)>>>(
      max, sumexp, target_logit, lse, n, partials);
  dev::sum_partials_kernel<kMaxThreads>
      <<<1, kMaxThreads, 0, dev::as_stream(stream)>>>(partials, blocks, result);
}

void cross_entropy_backward(Src logits, const std::int32_t* targets, const float* lse, I n, I cols,
                            I begin, I vocab, float scale, Dst dlogits, void* stream) {
  if (n == 0 || cols == 0) return;
  const I real = vocab - begin < 0 ? 0 : vocab - begin < cols ? vocab - begin : cols;
  typed(logits, [&](auto* pz) {
    using T = Elem<decltype(pz)>;
    auto* pd = static_cast<T*>(dlogits.p);
    const bool vec = rows_aligned16(pz, cols) && dev::aligned16(pd);
    const int threads = dev::row_threads(vec ? cols / kVecWidth<T> : cols, kMaxThreads);
    const auto grid = static_cast<unsigned>(n);
    if (vec)
      cross_entropy_backward_kernel<true, T><<<grid, threads, 0, dev::as_stream(stream)>>>(
          pz, targets, lse, cols, real, begin, scale, pd);
    else
      cross_entropy_backward_kernel<false, T><<<grid, threads, 0, dev::as_stream(stream)>>>(
          pz, targets, lse, cols, real, begin, scale, pd);
  });
}

}  // namespace tpx::cuda::kernels
