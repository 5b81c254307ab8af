// Fused causal attention (FlashAttention-2: Dao 2023, arXiv:2307.08691, Algorithms 1 and 2) on
// the [S, B, heads·D] fp32 tensors, read in place: query head bh = b·heads + h of row i starts at
// i·ldq + bh·D in q, out, dout, dq (ldq = B·heads·D). Nothing of size S×S is ever stored; forward
// keeps lse [B·heads, S] = log Σ_j exp(q_i·k_j / sqrt(D)) per query row, and backward recomputes
// each block of probabilities as exp(q_i·k_j / sqrt(D) − lse_i).
//
// Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): k, v, dk, dv are
// [S, B, kv_heads·D] (row stride ldkv = B·kv_heads·D), and query head bh reads KV head
// bh / group, group = heads / kv_heads (b·heads + h over group is b·kv_heads + h / group, since
// group divides heads). The forward and dQ kernels, one block per (query block, query head), only
// read K and V there. The dK/dV kernels run one block per (key block, KV head) and loop over the
// group's query heads inside the block, accumulating the sum over the group in registers (the
// CUDA-core kernel) or WMMA fragments (the tensor-core kernel) before writing each key row once:
// no atomics and no scratch, so dK and dV stay deterministic, at the price of a grid `group`
// times smaller with `group` times the work per block. kv_heads = heads is a group of one.
//
// Two families of kernels, the same algorithm:
//  - tensor cores (bf16 compute, D = 32, 64, 128): 4 warps per block, each owning 16 rows of a
//    64-row block; operand tiles of 64 rows are rounded to bf16 as they are loaded into shared
//    memory, the block products run on WMMA 16×16×16 bf16 fragments with fp32 accumulation,
//    and the softmax is fp32 (two lanes per row, 32 columns each).
//  - CUDA cores (fp32 compute, any D <= 256, and bf16 for other D): one warp per row (4 rows per
//    warp, 16 per block), lanes striding over D, tiles of 32 rows of the other side in shared
//    memory; with bf16 compute the operands are rounded to bf16 as they are loaded.
// Forward, per query row i over keys j <= i, with a running maximum m and sum l:
//   m' = max(m, s_j);  l = l·exp(m − m') + exp(s_j − m');  o = o·exp(m − m') + exp(s_j − m')·v_j
// (the tensor-core kernel does the same for 64 keys at a time), then o /= l, lse = m + log l.
// Backward, with Δ_i = Σ_d dO_i ∘ O_i (flash_delta_kernel; under bf16 compute dO rounded as the
// dP products read it, flash_operands.h), P = exp(s − lse_i):
//   dV_j = Σ_i P_ij dO_i;  dP_ij = dO_i·v_j;  dS = P ∘ (dP − Δ_i);
//   dQ_i = Σ_j dS_ij k_j / sqrt(D);  dK_j = Σ_i dS_ij q_i / sqrt(D)
// (dK_j and dV_j also summed over the query heads of the group) split into a dQ kernel (parallel
// over query blocks) and a dK/dV kernel (parallel over key blocks), each recomputing P: no
// atomics, so results are deterministic. Causal blocks above the diagonal are never visited.
//
// Context parallelism (stage 08) runs the CUDA-core kernels on one pair of sequence chunks at a
// time, as the cpu backend runs its loops (common/cpu/attention.cc): the keys' global positions
// lie `shift` rows before the queries', key j is visible to query i when j <= i + shift (sees()),
// and the loops' bounds and masks come from that one rule. Shift 0 is the causal attention
// above, with the same launch shapes. A query row that sees no key of the pair ends with l = 0:
// output 0 and lse −inf, which attention_merge() skips. Backward's pairs add into dq, dk, dv
// (kAccumulate) instead of overwriting them, as each query chunk meets several key chunks. The
// tensor-core kernels are the causal case only (the pairs are fp32).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

#include "common.cuh"
#include "flash_operands.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;
using dev::kFullMask;
using dev::kWarp;
using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------------
// CUDA-core kernels (any D <= 256)
// ---------------------------------------------------------------------------------------------

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;  // 16
constexpr int kTile = 32;                             // rows of the other side per shared tile

using flash::operand;  // x as the GEMM operand: itself, or rounded to bf16 for bf16 compute

/// Row `row` of one head, D values spread over the lanes (lane + 32·t), zero past D or S.
template <int kPerLane, bool kBf16>
__device__ __forceinline__ void load_row(float (&dst)[kPerLane], const float* p, I row, I s, I d,
                                         I ld, int lane) {
  for (int t = 0; t < kPerLane; ++t) {
    const I c = lane + kWarp * t;
    dst[t] = row < s && c < d ? operand<kBf16>(p[row * ld + c]) : 0.0f;
  }
}

/// Rows row0 .. row0 + kTile − 1 of one head into shared memory [kTile][d], zero past S.
template <bool kBf16>
__device__ __forceinline__ void load_tile_f32(float* dst, const float* p, I row0, I s, I d, I ld) {
  for (I e = threadIdx.x; e < kTile * d; e += blockDim.x) {
    const I r = row0 + e / d;
    dst[e] = r < s ? operand<kBf16>(p[r * ld + e % d]) : 0.0f;
  }
}

/// The one mask of every CUDA-core kernel: key j is visible to query i (keys `shift` rows
/// earlier than the queries; shift 0 is the causal mask).
__device__ __forceinline__ bool sees(I i, I j, I shift) {
  return j <= i + shift;
}

/// One past the last key a query block whose last row is `last` sees: min(S, last + shift + 1).
__device__ __forceinline__ I keys_end(I last, I s, I shift) {
  return max(I(0), min(s, last + shift + 1));
}

/// The first query that sees key j: max(0, j − shift).
__device__ __forceinline__ I first_query(I j, I shift) {
  return max(I(0), j - shift);
}

/// A gradient's value written (the whole attention) or added (a chunk pair's share).
template <bool kAccumulate>
__device__ __forceinline__ void put(float* p, float x) {
  if constexpr (kAccumulate)
    *p += x;
  else
    *p = x;
}

/// Σ_d a·b over the warp: each lane's partial products, then a butterfly sum.
template <int kPerLane>
__device__ __forceinline__ float warp_dot(const float (&a)[kPerLane], const float* b, I d,
                                          int lane) {
  float part = 0.0f;
  for (int t = 0; t < kPerLane; ++t) {
    const I c = lane + kWarp * t;
    if (c < d) part += a[t] * b[c];
  }
  return dev::warp_sum(part);
}

template <int kPerLane, bool kBf16>
__global__ void __launch_bounds__(kThreads)
    flash_forward_simple(const float* q, const float* k, const float* v, float* out, float* lse,
                         I s, I d, I ldq, I ldkv, I group, float scale, I shift) {
  extern __shared__ float smem[];
  float* ks = smem;              // [kTile][d]
  float* vs = smem + kTile * d;  // [kTile][d]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I bh = blockIdx.y, row0 = I(blockIdx.x) * kRowsPerBlock;
  const I kvh = bh / group;  // the KV head this query head reads
  q += bh * d, k += kvh * d, v += kvh * d, out += bh * d;
  float qr[kRowsPerWarp][kPerLane], o[kRowsPerWarp][kPerLane];
  float m[kRowsPerWarp], l[kRowsPerWarp];
  I rows[kRowsPerWarp];
  for (int r = 0; r < kRowsPerWarp; ++r) {
    rows[r] = row0 + warp * kRowsPerWarp + r;
    load_row<kPerLane, kBf16>(qr[r], q, rows[r], s, d, ldq, lane);
    for (int t = 0; t < kPerLane; ++t) o[r][t] = 0.0f;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Keys up to those the block's last query row sees (shift 0: up to the diagonal).
  const I end = keys_end(min(s, row0 + kRowsPerBlock) - 1, s, shift);
  for (I j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the previous tiles are no longer read
    load_tile_f32<kBf16>(ks, k, j0, s, d, ldkv);
    load_tile_f32<kBf16>(vs, v, j0, s, d, ldkv);
    __syncthreads();
    const I n = min(I(kTile), end - j0);
    for (I jj = 0; jj < n; ++jj) {
      const I j = j0 + jj;
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (rows[r] >= s || !sees(rows[r], j, shift)) continue;  // the same for the whole warp
        const float x = warp_dot<kPerLane>(qr[r], ks + jj * d, d, lane) * scale;
        const float m_new = fmaxf(m[r], x);
        const float alpha = expf(m[r] - m_new), p = expf(x - m_new);
        l[r] = l[r] * alpha + p;
        m[r] = m_new;
        for (int t = 0; t < kPerLane; ++t) {
          const I c = lane + kWarp * t;
          o[r][t] = o[r][t] * alpha + (c < d ? p * vs[jj * d + c] : 0.0f);
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (rows[r] >= s) continue;
    const bool seen = l[r] > 0.0f;  // false only for a chunk pair's row that sees no key
    for (int t = 0; t < kPerLane; ++t) {
      const I c = lane + kWarp * t;
      if (c < d) out[rows[r] * ldq + c] = seen ? o[r][t] / l[r] : 0.0f;
    }
    if (lane == 0) lse[bh * s + rows[r]] = seen ? m[r] + logf(l[r]) : -INFINITY;
  }
}

template <int kPerLane, bool kBf16, bool kAccumulate>
__global__ void __launch_bounds__(kThreads)
    flash_dq_simple(const float* dout, const float* q, const float* k, const float* v,
                    const float* lse, const float* delta, float* dq, I s, I d, I ldq, I ldkv,
                    I group, float scale, I shift) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * d;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I bh = blockIdx.y, row0 = I(blockIdx.x) * kRowsPerBlock;
  const I kvh = bh / group;
  dout += bh * d, q += bh * d, k += kvh * d, v += kvh * d, dq += bh * d;
  float qr[kRowsPerWarp][kPerLane], dor[kRowsPerWarp][kPerLane], acc[kRowsPerWarp][kPerLane];
  float lse_r[kRowsPerWarp], delta_r[kRowsPerWarp];
  I rows[kRowsPerWarp];
  for (int r = 0; r < kRowsPerWarp; ++r) {
    rows[r] = row0 + warp * kRowsPerWarp + r;
    load_row<kPerLane, kBf16>(qr[r], q, rows[r], s, d, ldq, lane);
    load_row<kPerLane, kBf16>(dor[r], dout, rows[r], s, d, ldq, lane);
    for (int t = 0; t < kPerLane; ++t) acc[r][t] = 0.0f;
    lse_r[r] = rows[r] < s ? lse[bh * s + rows[r]] : 0.0f;
    delta_r[r] = rows[r] < s ? delta[bh * s + rows[r]] : 0.0f;
  }
  const I end = keys_end(min(s, row0 + kRowsPerBlock) - 1, s, shift);
  for (I j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();
    load_tile_f32<kBf16>(ks, k, j0, s, d, ldkv);
    load_tile_f32<kBf16>(vs, v, j0, s, d, ldkv);
    __syncthreads();
    const I n = min(I(kTile), end - j0);
    for (I jj = 0; jj < n; ++jj) {
      const I j = j0 + jj;
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (rows[r] >= s || !sees(rows[r], j, shift)) continue;  // (lse is finite where it sees)
        const float p = expf(warp_dot<kPerLane>(qr[r], ks + jj * d, d, lane) * scale - lse_r[r]);
        const float ds = p * (warp_dot<kPerLane>(dor[r], vs + jj * d, d, lane) - delta_r[r]);
        for (int t = 0; t < kPerLane; ++t) {
          const I c = lane + kWarp * t;
          if (c < d) acc[r][t] += ds * ks[jj * d + c];
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (rows[r] >= s) continue;
    for (int t = 0; t < kPerLane; ++t) {
      const I c = lane + kWarp * t;
      if (c < d) put<kAccumulate>(&dq[rows[r] * ldq + c], acc[r][t] * scale);
    }
  }
}

// One block per (16 keys, KV head): it loops over the query heads of the KV head's group, one
// after another, accumulating their contributions to dK and dV in registers, and writes each of
// its key rows once: no atomics, no scratch, a fixed order of summation.
template <int kPerLane, bool kBf16, bool kAccumulate>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_simple(const float* dout, const float* q, const float* k, const float* v,
                      const float* lse, const float* delta, float* dk, float* dv, I s, I d, I ldq,
                      I ldkv, I group, float scale, I shift) {
  extern __shared__ float smem[];
  float* qs = smem;                     // [kTile][d]
  float* dos = smem + kTile * d;        // [kTile][d]
  float* lse_s = smem + 2 * kTile * d;  // [kTile]
  float* delta_s = lse_s + kTile;       // [kTile]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I kvh = blockIdx.y, row0 = I(blockIdx.x) * kRowsPerBlock;  // KV head, first key row
  k += kvh * d, v += kvh * d, dk += kvh * d, dv += kvh * d;
  float kr[kRowsPerWarp][kPerLane], vr[kRowsPerWarp][kPerLane];
  float dka[kRowsPerWarp][kPerLane], dva[kRowsPerWarp][kPerLane];
  I rows[kRowsPerWarp];
  for (int r = 0; r < kRowsPerWarp; ++r) {
    rows[r] = row0 + warp * kRowsPerWarp + r;
    load_row<kPerLane, kBf16>(kr[r], k, rows[r], s, d, ldkv, lane);
    load_row<kPerLane, kBf16>(vr[r], v, rows[r], s, d, ldkv, lane);
    for (int t = 0; t < kPerLane; ++t) dka[r][t] = dva[r][t] = 0.0f;
  }
  for (I g = 0; g < group; ++g) {
    const I bh = kvh * group + g;  // a query head of this KV head's group
    const float* qh = q + bh * d;
    const float* doh = dout + bh * d;
    const float* lh = lse + bh * s;
    const float* dh = delta + bh * s;
    // Queries from the first that sees the block's first key (shift 0: that key's own row):
    // every earlier query sees none of its keys.
    for (I i0 = first_query(row0, shift); i0 < s; i0 += kTile) {
      __syncthreads();  // the previous tiles (of this head or the last) are no longer read
      load_tile_f32<kBf16>(qs, qh, i0, s, d, ldq);
      load_tile_f32<kBf16>(dos, doh, i0, s, d, ldq);
      for (I t = threadIdx.x; t < kTile; t += blockDim.x) {
        lse_s[t] = i0 + t < s ? lh[i0 + t] : 0.0f;
        delta_s[t] = i0 + t < s ? dh[i0 + t] : 0.0f;
      }
      __syncthreads();
      const I n = min(I(kTile), s - i0);
      for (I ii = 0; ii < n; ++ii) {
        const I i = i0 + ii;
        for (int r = 0; r < kRowsPerWarp; ++r) {
          if (rows[r] >= s || !sees(i, rows[r], shift)) continue;
          const float p = expf(warp_dot<kPerLane>(kr[r], qs + ii * d, d, lane) * scale - lse_s[ii]);
          const float ds = p * (warp_dot<kPerLane>(vr[r], dos + ii * d, d, lane) - delta_s[ii]);
          for (int t = 0; t < kPerLane; ++t) {
            const I c = lane + kWarp * t;
            if (c < d) {
              dva[r][t] += p * dos[ii * d + c];
              dka[r][t] += ds * qs[ii * d + c];
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (rows[r] >= s) continue;
    for (int t = 0; t < kPerLane; ++t) {
      const I c = lane + kWarp * t;
      if (c < d) {
        put<kAccumulate>(&dk[rows[r] * ldkv + c], dka[r][t] * scale);
        put<kAccumulate>(&dv[rows[r] * ldkv + c], dva[r][t]);
      }
    }
  }
}

/// Δ[bh·S + i] = Σ_d dO ∘ O of query row i of head bh: one warp per row, grid-stride. Under bf16
/// compute dO is rounded to bf16, as every dP = dO·Vᵀ of the backward kernels reads it: Δ is
/// then Σ_j P·dP of those same dP, and dS = P·(dP − Δ) sums to zero over a row as it should
/// (flash_operands.h). An unrounded dO left every dS off by Σ_d (dO − bf16(dO))·O; at S = 1,
/// where dQ and dK are exactly zero, they came out as that residue (~1e-3) times K and Q.
template <bool kBf16>
__global__ void __launch_bounds__(256)
    flash_delta_kernel(const float* dout, const float* out, float* delta, I s, I heads_total, I d,
                       I ld) {
  const int lane = threadIdx.x % kWarp;
  const I warps = I(gridDim.x) * (blockDim.x / kWarp);
  for (I rr = I(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; rr < heads_total * s;
       rr += warps) {
    const I bh = rr / s, i = rr % s;
    const I base = i * ld + bh * d;
    float part = 0.0f;
    for (I c = lane; c < d; c += kWarp)
      part += flash::delta_term<kBf16>(dout[base + c], out[base + c]);
    part = dev::warp_sum(part);
    if (lane == 0) delta[rr] = part;
  }
}

/// The log-sum-exp merge of query row i of head bh (row rr = bh·S + i): with m = max(lse, lse'),
/// out = (e^(lse−m)·out + e^(lse'−m)·out') / (e^(lse−m) + e^(lse'−m)), lse = m + log(the sum);
/// a row whose part saw no key (lse' = −inf) is left as it is. One warp per row, grid-stride.
__global__ void __launch_bounds__(256)
    flash_merge_kernel(float* out, float* lse, const float* part_out, const float* part_lse, I s,
                       I heads_total, I d, I ld) {
  const int lane = threadIdx.x % kWarp;
  const I warps = I(gridDim.x) * (blockDim.x / kWarp);
  for (I rr = I(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; rr < heads_total * s;
       rr += warps) {
    const float l1 = lse[rr], l2 = part_lse[rr];
    if (l2 == -INFINITY) continue;  // the same for the whole warp
    const float m = fmaxf(l1, l2);
    const float w1 = expf(l1 - m), w2 = expf(l2 - m);  // w1 = 0 where out saw no key yet
    const float inv = 1.0f / (w1 + w2);
    const I bh = rr / s, i = rr % s;
    const I base = i * ld + bh * d;
    for (I c = lane; c < d; c += kWarp)
      out[base + c] = (w1 * out[base + c] + w2 * part_out[base + c]) * inv;
    __syncwarp();  // every lane has read lse[rr]
    if (lane == 0) lse[rr] = m + logf(w1 + w2);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernels (bf16 operands, fp32 accumulation; D = 32, 64, 128)
// ---------------------------------------------------------------------------------------------

namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kTcRows = 64;        // rows per block and per tile: 16 per warp
constexpr int kLdS = kTcRows + 4;  // fp32 [16][64] score rows, padded against bank conflicts
constexpr int kLdP = kTcRows + 8;  // bf16 [16][64] probability rows (a multiple of 8)
constexpr int kWarpRows = 16;      // rows a warp owns
template <int D>
constexpr int kLdT = D + 8;  // bf16 operand tile rows [64][D]
template <int D>
constexpr int kLdO = D + 4;  // fp32 accumulator rows [16][D]

/// Shared-memory bytes of each region, multiples of 128 so every region (and every 16-row,
/// 16-column fragment inside it) meets WMMA's 256-bit alignment.
constexpr int tile_bytes(int d) {
  return 2 * kTcRows * (d + 8);  // a bf16 [64][D + 8] tile
}
constexpr int kScoreBytes = 4 * kWarps * kWarpRows * kLdS;  // one fp32 [16][64] per warp
constexpr int kProbBytes = 2 * kWarps * kWarpRows * kLdP;   // one bf16 [16][64] per warp
constexpr int acc_bytes(int d) {
  return 4 * kWarps * kWarpRows * (d + 4);  // one fp32 [16][D + 4] per warp
}
static_assert(tile_bytes(32) % 128 == 0 && kScoreBytes % 128 == 0 && kProbBytes % 128 == 0);

template <int D>
constexpr int kForwardTcSmem = 3 * tile_bytes(D) + kScoreBytes + kProbBytes + acc_bytes(D);
// dQ: Q, dO, K, V tiles; two fp32 [16][64] per warp (scores, dP; then the dQ staging); dS.
template <int D>
constexpr int kDqTcSmem = 4 * tile_bytes(D) + 2 * kScoreBytes + kProbBytes;
// dK/dV: K, V, Q, dO tiles; lse and Δ of 64 queries; two fp32 [16][64] per warp; Pᵀ and dSᵀ.
template <int D>
constexpr int kDkdvTcSmem = 4 * tile_bytes(D) + 2 * kTcRows * 4 + 2 * kScoreBytes + 2 * kProbBytes;
// The staging of a warp's [16][D] result fits in its two fp32 [16][64] blocks.
static_assert(kWarpRows * kLdO<128> <= 2 * kWarpRows * kLdS);

/// Rows row0 .. row0 + 63 of one head, rounded to bf16, into a [64][D + 8] tile; zero past S.
template <int D>
__device__ __forceinline__ void load_tile_bf16(bf16* dst, const float* p, I row0, I s, I ld) {
  for (int e = threadIdx.x; e < kTcRows * D; e += blockDim.x) {
    const int r = e / D, c = e % D;
    dst[r * kLdT<D> + c] = __float2bfloat16_rn(row0 + r < s ? p[(row0 + r) * ld + c] : 0.0f);
  }
}

/// dst [16][64] (fp32, ld kLdS) = A Bᵀ for A = 16 rows of a tile, B = a whole 64-row tile.
template <int D>
__device__ __forceinline__ void scores_tc(float* dst, const bf16* a, const bf16* b) {
  for (int n = 0; n < kTcRows / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA fa;
      FragBt fb;  // Bᵀ: element (k, n') is b[(16n + n')·ld + 16kk + k], column-major
      wmma::load_matrix_sync(fa, a + kk * 16, kLdT<D>);
      wmma::load_matrix_sync(fb, b + n * 16 * kLdT<D> + kk * 16, kLdT<D>);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(dst + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

/// acc[n] (16 x D as D/16 fragments) += P (bf16 [16][64], ld kLdP) · tile (bf16 [64][D]).
template <int D>
__device__ __forceinline__ void accumulate_tc(FragC (&acc)[D / 16], const bf16* p,
                                              const bf16* tile) {
  for (int n = 0; n < D / 16; ++n)
    for (int kk = 0; kk < kTcRows / 16; ++kk) {
      FragA fa;
      FragB fb;
      wmma::load_matrix_sync(fa, p + kk * 16, kLdP);
      wmma::load_matrix_sync(fb, tile + kk * 16 * kLdT<D> + n * 16, kLdT<D>);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
}

/// Writes a warp's [16][D] fragments times `scale` to rows row0.. (< S) of one head, staged
/// through `stage` (fp32, at least 16 x (D + 4) floats).
template <int D>
__device__ __forceinline__ void store_rows_tc(FragC (&acc)[D / 16], float scale, float* stage,
                                              float* p, I row0, I s, I ld, int lane) {
  for (int n = 0; n < D / 16; ++n) {
    for (int t = 0; t < acc[n].num_elements; ++t) acc[n].x[t] *= scale;
    wmma::store_matrix_sync(stage + n * 16, acc[n], kLdO<D>, wmma::mem_row_major);
  }
  __syncwarp();
  for (int e = lane; e < kWarpRows * D; e += kWarp) {
    const int r = e / D, c = e % D;
    if (row0 + r < s) p[(row0 + r) * ld + c] = stage[r * kLdO<D> + c];
  }
  __syncwarp();
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_tc(const float* q, const float* k, const float* v, float* out, float* lse, I s,
                     I ldq, I ldkv, I group, float scale) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  bf16* qs = reinterpret_cast<bf16*>(tc_smem);
  bf16* ks = qs + kTcRows * kLdT<D>;
  bf16* vs = ks + kTcRows * kLdT<D>;
  float* ss = reinterpret_cast<float*>(vs + kTcRows * kLdT<D>);
  bf16* ps = reinterpret_cast<bf16*>(ss + kWarps * kWarpRows * kLdS);
  float* os = reinterpret_cast<float*>(ps + kWarps * kWarpRows * kLdP);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I qb = I(gridDim.x) - 1 - blockIdx.x;  // the longest rows first
  const I bh = blockIdx.y, q0 = qb * kTcRows;
  const I kvh = bh / group;  // the KV head this query head reads
  q += bh * D, k += kvh * D, v += kvh * D, out += bh * D;
  float* sw = ss + warp * kWarpRows * kLdS;
  bf16* pw = ps + warp * kWarpRows * kLdP;
  float* ow = os + warp * kWarpRows * kLdO<D>;
  load_tile_bf16<D>(qs, q, q0, s, ldq);
  for (int e = lane; e < kWarpRows * kLdO<D>; e += kWarp) ow[e] = 0.0f;
  // Two lanes per row: row r of the warp's 16, columns half·32 .. half·32 + 31 of each tile.
  const int r = lane / 2, half = lane % 2;
  const I i = q0 + warp * kWarpRows + r;
  float m = -INFINITY, l = 0.0f;
  for (I kb = 0; kb <= qb; ++kb) {
    __syncthreads();  // Q is loaded; nobody reads the previous K, V any more
    load_tile_bf16<D>(ks, k, kb * kTcRows, s, ldkv);
    load_tile_bf16<D>(vs, v, kb * kTcRows, s, ldkv);
    __syncthreads();
    scores_tc<D>(sw, qs + warp * kWarpRows * kLdT<D>, ks);
    __syncwarp();
    float* srow = sw + r * kLdS + half * 32;
    const I j0 = kb * kTcRows + half * 32;
    float mx = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      const float x = j0 + c <= i ? srow[c] * scale : -INFINITY;  // causal mask
      srow[c] = x;
      mx = fmaxf(mx, x);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays 0
    float sum = 0.0f;
    bf16* prow = pw + r * kLdP + half * 32;
    for (int c = 0; c < 32; ++c) {
      const float p = expf(srow[c] - m_use);
      sum += p;
      prow[c] = __float2bfloat16_rn(p);
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    const float alpha = expf(m - m_use);
    l = l * alpha + sum;
    m = m_new;
    float* orow = ow + r * kLdO<D> + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) orow[c] *= alpha;
    __syncwarp();
    FragC acc[D / 16];
    for (int n = 0; n < D / 16; ++n)
      wmma::load_matrix_sync(acc[n], ow + n * 16, kLdO<D>, wmma::mem_row_major);
    accumulate_tc<D>(acc, pw, vs);
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(ow + n * 16, acc[n], kLdO<D>, wmma::mem_row_major);
    __syncwarp();
  }
  // Every lane of the warp writes: row rr's l is held by lanes 2rr and 2rr + 1.
  for (int e = lane; e < kWarpRows * D; e += kWarp) {
    const int rr = e / D, c = e % D;
    const float lr = __shfl_sync(kFullMask, l, 2 * rr);
    const I ii = q0 + warp * kWarpRows + rr;
    if (ii < s) out[ii * ldq + c] = ow[rr * kLdO<D> + c] / lr;
  }
  if (half == 0 && i < s) lse[bh * s + i] = m + logf(l);
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_dq_tc(const float* dout, const float* q, const float* k, const float* v, const float* lse,
                const float* delta, float* dq, I s, I ldq, I ldkv, I group, float scale) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  bf16* qs = reinterpret_cast<bf16*>(tc_smem);
  bf16* dos = qs + kTcRows * kLdT<D>;
  bf16* ks = dos + kTcRows * kLdT<D>;
  bf16* vs = ks + kTcRows * kLdT<D>;
  float* scratch = reinterpret_cast<float*>(vs + kTcRows * kLdT<D>);
  bf16* dss = reinterpret_cast<bf16*>(scratch + 2 * kWarps * kWarpRows * kLdS);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I qb = I(gridDim.x) - 1 - blockIdx.x;
  const I bh = blockIdx.y, q0 = qb * kTcRows;
  const I kvh = bh / group;
  dout += bh * D, q += bh * D, k += kvh * D, v += kvh * D, dq += bh * D;
  float* sw = scratch + 2 * warp * kWarpRows * kLdS;  // scores
  float* dpw = sw + kWarpRows * kLdS;                 // dP = dO Vᵀ
  bf16* dsw = dss + warp * kWarpRows * kLdP;
  load_tile_bf16<D>(qs, q, q0, s, ldq);
  load_tile_bf16<D>(dos, dout, q0, s, ldq);
  const int r = lane / 2, half = lane % 2;
  const I i = q0 + warp * kWarpRows + r;
  const float lse_i = i < s ? lse[bh * s + i] : 0.0f;
  const float delta_i = i < s ? delta[bh * s + i] : 0.0f;
  FragC acc[D / 16];
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
  for (I kb = 0; kb <= qb; ++kb) {
    __syncthreads();
    load_tile_bf16<D>(ks, k, kb * kTcRows, s, ldkv);
    load_tile_bf16<D>(vs, v, kb * kTcRows, s, ldkv);
    __syncthreads();
    scores_tc<D>(sw, qs + warp * kWarpRows * kLdT<D>, ks);
    scores_tc<D>(dpw, dos + warp * kWarpRows * kLdT<D>, vs);
    __syncwarp();
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const I j = kb * kTcRows + c;
      const float p = j <= i && i < s ? expf(sw[r * kLdS + c] * scale - lse_i) : 0.0f;
      dsw[r * kLdP + c] = __float2bfloat16_rn(p * (dpw[r * kLdS + c] - delta_i));
    }
    __syncwarp();
    accumulate_tc<D>(acc, dsw, ks);
  }
  __syncwarp();
  store_rows_tc<D>(acc, scale, sw, dq, q0 + warp * kWarpRows, s, ldq, lane);
}

// One block per (64 keys, KV head), looping over the query heads of the group one after another
// with dK and dV accumulating in the same fragments; each key row is written once.
template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_tc(const float* dout, const float* q, const float* k, const float* v,
                  const float* lse, const float* delta, float* dk, float* dv, I s, I ldq, I ldkv,
                  I group, float scale) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  bf16* ks = reinterpret_cast<bf16*>(tc_smem);
  bf16* vs = ks + kTcRows * kLdT<D>;
  bf16* qs = vs + kTcRows * kLdT<D>;
  bf16* dos = qs + kTcRows * kLdT<D>;
  float* lse_s = reinterpret_cast<float*>(dos + kTcRows * kLdT<D>);
  float* delta_s = lse_s + kTcRows;
  float* scratch = delta_s + kTcRows;
  bf16* pts = reinterpret_cast<bf16*>(scratch + 2 * kWarps * kWarpRows * kLdS);
  bf16* dsts = pts + kWarps * kWarpRows * kLdP;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I kb = blockIdx.x, kvh = blockIdx.y, k0 = kb * kTcRows;  // key block, KV head
  k += kvh * D, v += kvh * D, dk += kvh * D, dv += kvh * D;
  float* stw = scratch + 2 * warp * kWarpRows * kLdS;  // Sᵀ: 16 keys x 64 queries
  float* dptw = stw + kWarpRows * kLdS;                // dPᵀ = V dOᵀ
  bf16* ptw = pts + warp * kWarpRows * kLdP;
  bf16* dstw = dsts + warp * kWarpRows * kLdP;
  load_tile_bf16<D>(ks, k, k0, s, ldkv);
  load_tile_bf16<D>(vs, v, k0, s, ldkv);
  const int r = lane / 2, half = lane % 2;
  const I j = k0 + warp * kWarpRows + r;  // this lane's key
  FragC dk_acc[D / 16], dv_acc[D / 16];
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk_acc[n], 0.0f);
    wmma::fill_fragment(dv_acc[n], 0.0f);
  }
  const I blocks = (s + kTcRows - 1) / kTcRows;
  for (I g = 0; g < group; ++g) {
    const I bh = kvh * group + g;  // a query head of this KV head's group
    const float* qh = q + bh * D;
    const float* doh = dout + bh * D;
    const float* lh = lse + bh * s;
    const float* dh = delta + bh * s;
    for (I qb = kb; qb < blocks; ++qb) {  // query blocks from the diagonal down
      const I q0 = qb * kTcRows;
      __syncthreads();  // K, V are loaded; nobody reads the previous Q, dO, lse, Δ any more
      load_tile_bf16<D>(qs, qh, q0, s, ldq);
      load_tile_bf16<D>(dos, doh, q0, s, ldq);
      for (int t = threadIdx.x; t < kTcRows; t += blockDim.x) {
        lse_s[t] = q0 + t < s ? lh[q0 + t] : 0.0f;
        delta_s[t] = q0 + t < s ? dh[q0 + t] : 0.0f;
      }
      __syncthreads();
      scores_tc<D>(stw, ks + warp * kWarpRows * kLdT<D>, qs);
      scores_tc<D>(dptw, vs + warp * kWarpRows * kLdT<D>, dos);
      __syncwarp();
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        const I i = q0 + c;
        const float p = i < s && j <= i ? expf(stw[r * kLdS + c] * scale - lse_s[c]) : 0.0f;
        ptw[r * kLdP + c] = __float2bfloat16_rn(p);
        dstw[r * kLdP + c] = __float2bfloat16_rn(p * (dptw[r * kLdS + c] - delta_s[c]));
      }
      __syncwarp();
      accumulate_tc<D>(dv_acc, ptw, dos);
      accumulate_tc<D>(dk_acc, dstw, qs);
    }
  }
  __syncwarp();
  store_rows_tc<D>(dk_acc, scale, stw, dk, k0 + warp * kWarpRows, s, ldkv, lane);
  store_rows_tc<D>(dv_acc, 1.0f, stw, dv, k0 + warp * kWarpRows, s, ldkv, lane);
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

template <int N>
using Int = std::integral_constant<int, N>;

/// Calls f with the lanes' share of D (values per lane) as a compile-time constant.
template <class F>
void with_per_lane(I d, F&& f) {
  if (d <= 32)
    f(Int<1>{});
  else if (d <= 64)
    f(Int<2>{});
  else if (d <= 128)
    f(Int<4>{});
  else
    f(Int<8>{});
}

/// Calls f with the head dim as a compile-time constant (d is 32, 64 or 128).
template <class F>
void with_head_dim(I d, F&& f) {
  if (d == 32)
    f(Int<32>{});
  else if (d == 64)
    f(Int<64>{});
  else
    f(Int<128>{});
}

/// Lets `kernel` use `bytes` of dynamic shared memory (needed above 48 KiB).
template <class K>
cudaError_t allow_smem(K* kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

/// The shared memory one block may opt in to on the current device.
cudaError_t smem_optin(int& bytes) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

/// True when the tensor-core kernels of head dim d fit this device's shared memory (they run
/// the causal attention only; chunk pairs are fp32 on CUDA cores).
cudaError_t use_tensor_cores(I d, bool bf16_compute, bool& use) {
  use = false;
  if (!bf16_compute || (d != 32 && d != 64 && d != 128)) return cudaSuccess;
  int optin = 0;
  if (const cudaError_t e = smem_optin(optin); e != cudaSuccess) return e;
  with_head_dim(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    use = kForwardTcSmem<D> <= optin && kDqTcSmem<D> <= optin && kDkdvTcSmem<D> <= optin;
  });
  return cudaSuccess;
}

unsigned blocks_of(I rows, int per_block) {
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

/// The arguments every launcher refuses before it launches anything: a group that does not
/// divide the heads, a chunk pair with bf16 compute (the pairs are fp32).
bool valid(I heads_total, I group, bool bf16_compute, FlashPair pair) {
  const bool causal = pair.shift == 0 && !pair.accumulate;
  return group >= 1 && heads_total % group == 0 && (causal || !bf16_compute);
}

}  // namespace

int flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                            I s, I heads_total, I group, I d, I ldq, I ldkv, bool bf16_compute,
                            FlashPair pair, void* stream) {
  if (!valid(heads_total, group, bf16_compute, pair)) return cudaErrorInvalidValue;
  if (s == 0 || heads_total == 0) return cudaSuccess;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const cudaStream_t st = dev::as_stream(stream);
  bool tc = false;
  cudaError_t err = use_tensor_cores(d, bf16_compute, tc);
  if (err != cudaSuccess) return err;
  if (tc) {
    with_head_dim(d, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      err = allow_smem(flash_forward_tc<D>, kForwardTcSmem<D>);
      if (err != cudaSuccess) return;
      const dim3 grid(blocks_of(s, kTcRows), static_cast<unsigned>(heads_total));
      flash_forward_tc<D><<<grid, kThreads, kForwardTcSmem<D>, st>>>(q, k, v, out, lse, s, ldq,
                                                                     ldkv, group, scale);
    });
    return err;
  }
  const int smem = static_cast<int>(2 * kTile * d * sizeof(float));
  const dim3 grid(blocks_of(s, kRowsPerBlock), static_cast<unsigned>(heads_total));
  with_per_lane(d, [&](auto per_lane) {
    constexpr int P = decltype(per_lane)::value;
    auto* kernel = bf16_compute ? flash_forward_simple<P, true> : flash_forward_simple<P, false>;
    err = allow_smem(kernel, smem);
    if (err != cudaSuccess) return;
    kernel<<<grid, kThreads, smem, st>>>(q, k, v, out, lse, s, d, ldq, ldkv, group, scale,
                                         pair.shift);
  });
  return err;
}

int flash_attention_backward(const float* dout, const float* q, const float* k, const float* v,
                             const float* out, const float* lse, float* delta, float* dq, float* dk,
                             float* dv, I s, I heads_total, I group, I d, I ldq, I ldkv,
                             bool bf16_compute, FlashPair pair, void* stream) {
  if (!valid(heads_total, group, bf16_compute, pair)) return cudaErrorInvalidValue;
  if (s == 0 || heads_total == 0) return cudaSuccess;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const cudaStream_t st = dev::as_stream(stream);
  const auto kv_total = static_cast<unsigned>(heads_total / group);  // B·kv_heads
  auto* delta_kernel = bf16_compute ? flash_delta_kernel<true> : flash_delta_kernel<false>;
  delta_kernel<<<dev::blocks_for(heads_total * s * kWarp, 256), 256, 0, st>>>(dout, out, delta, s,
                                                                              heads_total, d, ldq);
  bool tc = false;
  cudaError_t err = use_tensor_cores(d, bf16_compute, tc);
  if (err != cudaSuccess) return err;
  if (tc) {
    with_head_dim(d, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      const unsigned blocks = blocks_of(s, kTcRows);
      err = allow_smem(flash_dq_tc<D>, kDqTcSmem<D>);
      if (err != cudaSuccess) return;
      flash_dq_tc<D>
          <<<dim3(blocks, static_cast<unsigned>(heads_total)), kThreads, kDqTcSmem<D>, st>>>(
              dout, q, k, v, lse, delta, dq, s, ldq, ldkv, group, scale);
      err = allow_smem(flash_dkdv_tc<D>, kDkdvTcSmem<D>);
      if (err != cudaSuccess) return;
      flash_dkdv_tc<D><<<dim3(blocks, kv_total), kThreads, kDkdvTcSmem<D>, st>>>(
          dout, q, k, v, lse, delta, dk, dv, s, ldq, ldkv, group, scale);
    });
    return err;
  }
  const unsigned blocks = blocks_of(s, kRowsPerBlock);
  const int smem_dq = static_cast<int>(2 * kTile * d * sizeof(float));
  const int smem_dkdv = static_cast<int>((2 * kTile * d + 2 * kTile) * sizeof(float));
  with_per_lane(d, [&](auto per_lane) {
    constexpr int P = decltype(per_lane)::value;
    // bf16 compute, fp32, or fp32 adding a chunk pair's share (valid() refused bf16 pairs).
    auto* dq_kernel = bf16_compute      ? flash_dq_simple<P, true, false>
                      : pair.accumulate ? flash_dq_simple<P, false, true>
                                        : flash_dq_simple<P, false, false>;
    auto* dkdv_kernel = bf16_compute      ? flash_dkdv_simple<P, true, false>
                        : pair.accumulate ? flash_dkdv_simple<P, false, true>
                                          : flash_dkdv_simple<P, false, false>;
    err = allow_smem(dq_kernel, smem_dq);
    if (err != cudaSuccess) return;
    dq_kernel<<<dim3(blocks, static_cast<unsigned>(heads_total)), kThreads, smem_dq, st>>>(
        dout, q, k, v, lse, delta, dq, s, d, ldq, ldkv, group, scale, pair.shift);
    err = allow_smem(dkdv_kernel, smem_dkdv);
    if (err != cudaSuccess) return;
    dkdv_kernel<<<dim3(blocks, kv_total), kThreads, smem_dkdv, st>>>(
        dout, q, k, v, lse, delta, dk, dv, s, d, ldq, ldkv, group, scale, pair.shift);
  });
  return err;
}

void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, I s,
                     I heads_total, I d, I ld, void* stream) {
  if (s == 0 || heads_total == 0) return;
  flash_merge_kernel<<<dev::blocks_for(heads_total * s * kWarp, 256), 256, 0,
                       dev::as_stream(stream)>>>(out, lse, part_out, part_lse, s, heads_total, d,
                                                 ld);
}

}  // namespace tpx::cuda::kernels
