// Fused causal attention (FlashAttention-2: Dao 2023, arXiv:2307.08691, Algorithms 1 and 2) on
// the [S, B, heads·D] tensors, read in place: query head bh = b·heads + h of row i starts at
// i·ldq + bh·D in q, out, dout, dq (ldq = B·heads·D). Nothing of size S×S is ever stored; forward
// keeps lse [B·heads, S] = log Σ_j exp(q_i·k_j / sqrt(D)) per query row, and backward recomputes
// each block of probabilities as exp(q_i·k_j / sqrt(D) − lse_i).
//
// Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): k, v, dk, dv are
// [S, B, kv_heads·D] (row stride ldkv = B·kv_heads·D), and query head bh reads KV head
// bh / group, group = heads / kv_heads (b·heads + h over group is b·kv_heads + h / group, since
// group divides heads). The forward kernels, one block per (query block, query head), only read
// K and V there. The backward kernels run one block per (key block, KV head) and loop over the
// group's query heads inside the block, accumulating the sum over the group in registers before
// writing each key row once: no atomics, so dK and dV stay deterministic, at the price of a grid
// `group` times smaller with `group` times the work per block. kv_heads = heads is a group of
// one.
//
// Two families of kernels, the same algorithm:
//  - tensor cores (bf16 tensors, D = 32, 64, 128): FlashAttention-2's work partitioning (Dao
//    2023, section 3.3): 4 warps per block, each owning 32 query rows (forward at D = 32 and 64:
//    a block of 128; 16 at D = 128, a block of 64) or key rows (backward: 32 at D = 32, 16
//    otherwise), all sharing the other side's tiles in shared memory. Products are
//    mma.sync.aligned.m16n8k16 (bf16 × bf16 + fp32) in inline PTX, operands from shared memory
//    by ldmatrix.x4 (.trans for a row-major B); the score tile and the O / dQ / dK / dV
//    accumulators stay in registers, the online softmax runs on the score fragments (a row's
//    max over the 4 lanes of a quad: two shuffles), and P and dS go from C fragments to A
//    fragments in the same registers (flash_tc_math.h has the fragment layouts, masks, bounds,
//    tile copies and softmax steps, shared with tests/test_flash_tc_twin.cc, the kernels' CPU
//    twin). Q, K, V, dO are read as the bf16 tensors store them: cp.async.cg copies 16 bytes at
//    a time from global to shared memory without passing through registers, and K/V (or Q/dO)
//    tiles are double-buffered, tile t + 1 copying into one buffer while tile t is multiplied
//    from the other (the pipeline above flash_forward_mma). O, dK, dV are stored as TOut:
//    bf16, each value rounded once from its fp32 accumulator (the recipe's rounding point: the
//    op's output), or fp32 (fp32 tensors under bf16 compute, whose inputs the caller rounds into
//    bf16 copies; chunk pairs, added to what is there). dQ is summed over the key blocks in an
//    fp32 accumulator in a fixed order (below), then rounded once into a bf16 dq (or it is the
//    fp32 dq itself). lse and Δ stay fp32.
//  - CUDA cores (fp32 compute, any D <= 256, and bf16 compute where the tensor cores do not run):
//    one warp per row (4 rows per warp, 16 per block), lanes striding over D, tiles of 32 rows of
//    the other side in shared memory; fp32 or bf16 tensors (T), widened as they are loaded,
//    rounded to bf16 as operands under bf16 compute, outputs stored as T.
//
// Budget of the tensor-core kernels with bf16 inputs and cp.async buffers (written before
// tuning; ptxas's numbers are checked at build time, for every instance, by the ctest
// flash_resources, tests/check_flash_resources.py). 128 threads a block; sm_90 has 64 Ki
// registers, 228 KB shared (1 KB reserved per block) per SM, sm_80 64 Ki and 164 KB. A tile in
// flight costs no registers (cp.async writes shared memory directly; the fp32 inputs of before
// needed 16 staging registers a thread for the rounding on the way).
//   kernel     tiles               registers/thread (D = 128)           shared bytes (D 64 / 128)
//   forward    64 q × 64 keys      O 64 + S 32 + ~60: <= 255              55296 /  87040
//              (128 q at D 32, 64)
//   backward   64 keys × 32 q      dK 64 + dV 64 + Sᵀ 16 + dPᵀ 16 + ~60   42496 /  75264
//              (128 keys at D 32)
//                                  (then dQ's quarter 32 in Sᵀ's, dPᵀ's place)
// (shared: the block's own rows once, the other side's tiles twice, rows of D + 8 bf16; the
// backward also lse and Δ twice and the dSᵀ tile, 64 × (32 + 8) bf16). So 2 blocks (8 warps)
// per SM on sm_90 and sm_80 for both kernels and every D (registers <= 255 = 65536 / (2 ·
// 128), shared <= 113 KB on sm_90, 81 KB on sm_80), except the forward at D = 128 on sm_80 (87
// KB: 1 block). Two blocks of 4 warps let one block's products run while the other waits at a
// barrier or for its next tile; a third would need both fewer registers (<= 168) and, at D =
// 128, smaller tiles.
// 32 rows a warp (FlashAttention-2's forward: 128 × 64 tiles, 4 warps): each K and V fragment a
// warp reads from shared memory feeds two row tiles' products instead of one, halving those reads
// per product. The forward takes them at D = 32 and 64 (tc::forward_row_tiles; ptxas, sm_90: 189
// and 234 registers, no spills, 2 blocks per SM; fewer instructions per product, below). At
// D = 128 the accumulators alone, O 128 and S 64 registers, leave too few: ptxas uses 255 and
// spills 212 bytes, so the forward keeps 16 rows a warp there. The backward takes 32 key rows a
// warp (tc::bwd_row_tiles, a block of 128 keys sharing each Q and dO fragment) at D = 32: 227
// registers on sm_90, 222 on sm_80, no spills, 2 blocks per SM. At D = 64 ptxas fits 32 rows on
// sm_90 (246 registers) but spills 12 bytes on sm_80, so it keeps 16; at D = 128, dK and dV alone
// would take 256 registers.
// Bytes per FLOP at D = 128, global, per tile (bf16: 2 B an element):
// forward 2·64·D·2 B of K, V for 4·64·64·D FLOP = 1/64 (1/32 with the fp32 inputs of before);
// backward 2·32·D·2 B of Q, dO for 10·64·32·D FLOP = 1/160, plus 2·32·D·4 B of dQ's fp32
// accumulator read and written = 1/80 (mostly L2: 32 MB at S 2048, B·NH 32, D 128). Shared
// memory, every warp reading the shared tiles by ldmatrix for each of its products: 1/16 B per
// FLOP with 16 rows a warp (a 64-row block is shared-memory-bound at about 16 FLOP/B), the
// K and V reads halved at 32 rows a warp, plus the cp.async writes, 1/64 (forward) or less.
// Instructions per tensor-core op, read from the build's sm_90 SASS by the ctest flash_sass
// (tests/check_flash_sass.py, nvdisasm): in each mma.sync kernel's main loop (the loop whose body
// holds the most HMMA) the body's instructions over its HMMA, counted once each. Each instance,
// bf16 and fp32 outputs alike, must stay at or below its budget below, so that a change that
// makes a loop fatter fails. The budgets are the counts of these kernels as they are (before
// the clear tiles ran without a mask, the exponent became one FFMA and one ex2.approx.ftz and
// a tile's copies one address per thread stepped by a stride: forward 10.6 at D 128). The
// backward's step does five products where the two kernels before it did seven (dQ 3.2 and
// dK/dV 5.1 per HMMA at D 128: 960 instructions for the 224 HMMA of a 64-key × 32-query block of
// work, against 876 for 160 now); its extra instructions per HMMA are dSᵀ's stores, dQ's adds
// and the turn. The aim is 4 or fewer (copies without bounds on interior tiles, 32 query rows a
// warp).
// The forward at 32 rows a warp (D 32, 64) went from 9.2 and 6.1 to 8.4 and 5.3. The backward's
// at D 32 rose from 14.7 to 15.5: its loop holds the masked and the unmasked dS step once per row
// tile, and the static count takes both (a step runs one of them).
//                kernel          D 32   D 64  D 128
//   sass budget  flash_forward    8.4    5.3    4.7
//   sass budget  flash_bwd       15.5    8.7    5.5
// Forward, per query row i over keys j <= i, with a running maximum m and sum l:
//   m' = max(m, s_j);  l = l·exp(m − m') + exp(s_j − m');  o = o·exp(m − m') + exp(s_j − m')·v_j
// (the tensor-core kernel does the same for 64 keys at a time), then o /= l, lse = m + log l.
// Backward, with Δ_i = Σ_d dO_i ∘ O_i (flash_delta_kernel; under bf16 compute dO rounded as the
// dP products read it, O as the forward stored it, flash_operands.h), P = exp(s − lse_i):
//   dV_j = Σ_i P_ij dO_i;  dP_ij = dO_i·v_j;  dS = P ∘ (dP − Δ_i);
//   dQ_i = Σ_j dS_ij k_j / sqrt(D);  dK_j = Σ_i dS_ij q_i / sqrt(D)
// (dK_j and dV_j also summed over the query heads of the group) in one kernel parallel over key
// blocks, recomputing P: five products per step (Sᵀ, dPᵀ, dV, dK, dQ), where a dQ kernel
// parallel over query blocks beside a dK/dV kernel would take seven (S, dP and dQ again). dK and
// dV are each a block's own; dQ_i sums over the key blocks, each adding its share to an fp32
// accumulator at its turn, key block 0 first (flash_tc_math.h, "dQ's turns"): no atomic add, a
// fixed order, so the result is the same bits on every run. (The CUDA-core kernels keep the two
// kernels, flash_dq_simple and flash_dkdv_simple, with their seven products.) Causal blocks above
// the diagonal are never visited.
//
// Context parallelism (stage 08) runs the kernels on one pair of sequence chunks at a time, as
// the cpu backend runs its loops (common/cpu/attention.cc): the keys' global positions lie
// `shift` rows before the queries', key j is visible to query i when j <= i + shift (sees();
// tc::visible for the tensor-core kernels), and the loops' bounds and masks come from that one
// rule. Shift 0 is the causal attention above, with the same launch shapes. A query row that
// sees no key of the pair ends with l = 0: output 0 and lse −inf, which attention_merge() skips.
// Backward's pairs add into dq, dk, dv (accumulate) instead of overwriting them, as each query
// chunk meets several key chunks. The tensor-core kernels implement the shift and the
// accumulation too, with fp32 outputs (TOut = float: a pair's partial output and gradients stay
// fp32 until the merge; the CPU twin checks them): stage 08 under --dtype bf16 runs its pairs
// there, on its bf16 q, k, v, dO and O as they are stored. A pair whose shapes the tensor cores
// do not take runs on the CUDA-core kernels on fp32 copies under bf16 compute (ops.cc), and
// --dtype fp32 on the fp32 CUDA-core kernels. Only bf16 outputs cannot accumulate (valid()).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common.cuh"
#include "flash_operands.h"
#include "flash_tc_math.h"
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

/// A stored value widened to fp32 (exact), and an fp32 value as it is stored (bf16: rounded once,
/// to nearest even).
__device__ __forceinline__ float wide(float x) {
  return x;
}
__device__ __forceinline__ float wide(bf16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ __forceinline__ T narrow(float x) {
  if constexpr (std::is_same_v<T, bf16>)
    return __float2bfloat16_rn(x);
  else
    return x;
}

/// Row `row` of one head, D values spread over the lanes (lane + 32·t), zero past D or S.
template <int kPerLane, bool kBf16, class T>
__device__ __forceinline__ void load_row(float (&dst)[kPerLane], const T* p, I row, I s, I d, I ld,
                                         int lane) {
  for (int t = 0; t < kPerLane; ++t) {
    const I c = lane + kWarp * t;
    dst[t] = row < s && c < d ? operand<kBf16>(wide(p[row * ld + c])) : 0.0f;
  }
}

/// Rows row0 .. row0 + kTile − 1 of one head into shared memory [kTile][d], zero past S.
template <bool kBf16, class T>
__device__ __forceinline__ void load_tile_f32(float* dst, const T* p, I row0, I s, I d, I ld) {
  for (I e = threadIdx.x; e < kTile * d; e += blockDim.x) {
    const I r = row0 + e / d;
    dst[e] = r < s ? operand<kBf16>(wide(p[r * ld + e % d])) : 0.0f;
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
template <bool kAccumulate, class T>
__device__ __forceinline__ void put(T* p, float x) {
  if constexpr (kAccumulate) {
    static_assert(std::is_same_v<T, float>, "a chunk pair's share is added in fp32");
    *p += x;
  } else {
    *p = narrow<T>(x);
  }
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

template <int kPerLane, bool kBf16, class T>
__global__ void __launch_bounds__(kThreads)
    flash_forward_simple(const T* q, const T* k, const T* v, T* out, float* lse, I s, I d, I ldq,
                         I ldkv, I group, float scale, I shift) {
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
    load_row<kPerLane, kBf16, T>(qr[r], q, rows[r], s, d, ldq, lane);
    for (int t = 0; t < kPerLane; ++t) o[r][t] = 0.0f;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Keys up to those the block's last query row sees (shift 0: up to the diagonal).
  const I end = keys_end(min(s, row0 + kRowsPerBlock) - 1, s, shift);
  for (I j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the previous tiles are no longer read
    load_tile_f32<kBf16, T>(ks, k, j0, s, d, ldkv);
    load_tile_f32<kBf16, T>(vs, v, j0, s, d, ldkv);
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
      if (c < d) out[rows[r] * ldq + c] = narrow<T>(seen ? o[r][t] / l[r] : 0.0f);
    }
    if (lane == 0) lse[bh * s + rows[r]] = seen ? m[r] + logf(l[r]) : -INFINITY;
  }
}

template <int kPerLane, bool kBf16, bool kAccumulate, class T>
__global__ void __launch_bounds__(kThreads)
    flash_dq_simple(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                    const float* delta, T* dq, I s, I d, I ldq, I ldkv, I group, float scale,
                    I shift) {
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
    load_row<kPerLane, kBf16, T>(qr[r], q, rows[r], s, d, ldq, lane);
    load_row<kPerLane, kBf16, T>(dor[r], dout, rows[r], s, d, ldq, lane);
    for (int t = 0; t < kPerLane; ++t) acc[r][t] = 0.0f;
    lse_r[r] = rows[r] < s ? lse[bh * s + rows[r]] : 0.0f;
    delta_r[r] = rows[r] < s ? delta[bh * s + rows[r]] : 0.0f;
  }
  const I end = keys_end(min(s, row0 + kRowsPerBlock) - 1, s, shift);
  for (I j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();
    load_tile_f32<kBf16, T>(ks, k, j0, s, d, ldkv);
    load_tile_f32<kBf16, T>(vs, v, j0, s, d, ldkv);
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
template <int kPerLane, bool kBf16, bool kAccumulate, class T>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_simple(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                      const float* delta, T* dk, T* dv, I s, I d, I ldq, I ldkv, I group,
                      float scale, I shift) {
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
    load_row<kPerLane, kBf16, T>(kr[r], k, rows[r], s, d, ldkv, lane);
    load_row<kPerLane, kBf16, T>(vr[r], v, rows[r], s, d, ldkv, lane);
    for (int t = 0; t < kPerLane; ++t) dka[r][t] = dva[r][t] = 0.0f;
  }
  for (I g = 0; g < group; ++g) {
    const I bh = kvh * group + g;  // a query head of this KV head's group
    const T* qh = q + bh * d;
    const T* doh = dout + bh * d;
    const float* lh = lse + bh * s;
    const float* dh = delta + bh * s;
    // Queries from the first that sees the block's first key (shift 0: that key's own row):
    // every earlier query sees none of its keys.
    for (I i0 = first_query(row0, shift); i0 < s; i0 += kTile) {
      __syncthreads();  // the previous tiles (of this head or the last) are no longer read
      load_tile_f32<kBf16, T>(qs, qh, i0, s, d, ldq);
      load_tile_f32<kBf16, T>(dos, doh, i0, s, d, ldq);
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
template <bool kBf16, class TD, class TO>
__global__ void __launch_bounds__(256)
    flash_delta_kernel(const TD* dout, const TO* out, float* delta, I s, I heads_total, I d, I ld) {
  const int lane = threadIdx.x % kWarp;
  const I warps = I(gridDim.x) * (blockDim.x / kWarp);
  for (I rr = I(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp; rr < heads_total * s;
       rr += warps) {
    const I bh = rr / s, i = rr % s;
    const I base = i * ld + bh * d;
    float part = 0.0f;
    for (I c = lane; c < d; c += kWarp)
      part += flash::delta_term<kBf16>(wide(dout[base + c]), wide(out[base + c]));
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
// Tensor-core kernels: mma.sync m16n8k16 (bf16 operands, fp32 accumulation; D = 32, 64, 128)
// ---------------------------------------------------------------------------------------------
// The index math, the masks, the loops' bounds and the softmax steps are flash_tc_math.h's
// (shared with the CPU twin of these kernels, tests/test_flash_tc_twin.cc).

namespace tc = flash::tc;
using tc::kBlockRows;
using tc::kKeyTile;
using tc::kQueryTile;
using tc::kWarpRows;

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8×8 bf16 matrices from shared memory (rows addressed by lanes 8m .. 8m + 7) into r[m].
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}
/// The same, each matrix transposed on the way (B fragments of a row-major [k][n] tile).
__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t (&r)[4], const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}
/// c (16×8, f32) += A (16×16, bf16, a0..a7 in a[0..3]) · B (16×8, bf16, b0..b3 in b0, b1).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/// Two floats as one register of two bf16 (lo in the lower half), each rounded to nearest even.
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}
/// The A fragment of keys (or queries) 16kk .. 16kk + 15 of a C-fragment block: from c[2kk]
/// and c[2kk + 1], rounded to bf16 (tc::a_from_c_half / a_from_c_index say which is which).
template <int N>
__device__ __forceinline__ void a_from_c(std::uint32_t (&a)[4], const float (&c)[N][4], int kk) {
  for (int r = 0; r < 4; ++r) {
    const int lo = 2 * r, hi = 2 * r + 1;
    a[r] = pack_bf16(c[2 * kk + tc::a_from_c_half(lo)][tc::a_from_c_index(lo)],
                     c[2 * kk + tc::a_from_c_half(hi)][tc::a_from_c_index(hi)]);
  }
}

/// The max over the four lanes of a quad (one row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

/// Two adjacent values of a lane's accumulator row stored as the output's type: fp32 (one 8-byte
/// store; added to what is there with `accumulate`, a chunk pair's share), or bf16, each rounded
/// once to nearest even (one 4-byte store; the launchers never ask bf16 outputs to accumulate).
__device__ __forceinline__ void store_pair(float* p, float x, float y, bool accumulate) {
  float2* dst = reinterpret_cast<float2*>(p);
  if (accumulate) {
    const float2 old = *dst;
    x += old.x;
    y += old.y;
  }
  *dst = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(bf16* p, float x, float y, bool /*accumulate*/) {
  *reinterpret_cast<std::uint32_t*>(p) = pack_bf16(x, y);
}

/// acc[N][4] (rows row0 + c_row, columns 8n + c_col of one head) × scale, written or added to
/// p[row·ld + col] for rows inside S.
template <int N, class T>
__device__ __forceinline__ void store_acc(const float (&acc)[N][4], float scale, T* p, I row0, I s,
                                          I ld, bool accumulate, int lane) {
  for (int h = 0; h < 2; ++h) {
    const I row = row0 + tc::c_row(lane, 2 * h);
    if (row >= s) continue;
    for (int n = 0; n < N; ++n)
      store_pair(p + row * ld + 8 * n + tc::c_col(lane, 0), acc[n][2 * h] * scale,
                 acc[n][2 * h + 1] * scale, accumulate);
  }
}

/// 16 bytes from global to shared memory without passing through registers (cp.async.cg, cached
/// in L2 only: PTX ISA, "Data Movement and Conversion Instructions: cp.async"). `bytes` 0 reads
/// nothing and writes 16 zero bytes (a row past S); src must still be an address of the tensor.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(bytes)
               : "memory");
}
/// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/// Waits until at most N of this thread's committed groups (the newest N) are still in flight.
/// Only the thread's own copies: a __syncthreads must follow before others read them.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Issues the copy of rows row0 .. row0 + R − 1 of one head (bf16, row stride ld) into a
/// [R][D + 8] shared tile, rows past S zero: R·D/8 chunks of 16 bytes, thread x taking chunks
/// x, x + 128, ... (tc::chunk_row, chunk_col). Nothing waits here: the tile is there after a
/// cp_async_wait that covers its group and a __syncthreads.
/// A row's chunks divide the block's threads, so chunk x + 128·u is row chunk_row(x) + u·(128 /
/// chunks per row), column chunk_col(x): one address per thread, stepped by a stride per chunk.
template <int R, int D>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* p, I row0, I s, I ld) {
  constexpr int kPerRow = tc::row_chunks(D), kRowsPerPass = tc::kThreads / kPerRow;
  static_assert(tc::kThreads % kPerRow == 0 && R % kRowsPerPass == 0);
  const int r = tc::chunk_row(int(threadIdx.x), D), c = tc::chunk_col(int(threadIdx.x), D);
  const bf16* src = p + (row0 + r) * ld + c;
  const I stride = kRowsPerPass * ld;
  const I left = s - row0 - r;  // rows from this thread's first to S's end
  for (int u = 0; u < R / kRowsPerPass; ++u, src += stride) {
    const bool in = u * kRowsPerPass < left;
    cp_async16(tile + (r + u * kRowsPerPass) * tc::ld_tile(D) + c, in ? src : p, in ? 16 : 0);
  }
}

/// acc[M][2·NB][4] (M row tiles of 16 × 16·NB) += A (M 16-row tiles, rows 16m .. of a
/// row-major [m][D] tile, columns 16kk ..) · Bᵀ for B = rows 0 .. 16·NB − 1 of an [n][D] tile,
/// for one k step kk (16 of D). Each B fragment is read once for the M row tiles.
template <int M, int NB, int D>
__device__ __forceinline__ void mma_abt(float (&acc)[M][2 * NB][4], const bf16* a_tile,
                                        const bf16* b_tile, int kk, int lane) {
  constexpr int ld = tc::ld_tile(D);
  std::uint32_t a[M][4];
  const tc::RowCol pa = tc::ldsm_a(lane), pb = tc::ldsm_b(lane);
#pragma unroll
  for (int mt = 0; mt < M; ++mt)
    ldsm_x4(a[mt], a_tile + (16 * mt + pa.row) * ld + 16 * kk + pa.col);
  for (int nb = 0; nb < NB; ++nb) {
    std::uint32_t b[4];
    ldsm_x4(b, b_tile + (16 * nb + pb.row) * ld + 16 * kk + pb.col);
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
      mma_bf16(acc[mt][2 * nb], a[mt], b[0], b[1]);
      mma_bf16(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
    }
  }
}
/// acc[M][W/8][4] (M row tiles of 16 × W) += A[m] (M 16 × 16 blocks, registers) · rows
/// 16kk .. 16kk + 15 of a row-major [k][D] tile, its first W columns (from b_tile), read with
/// ldmatrix.trans once for the M row tiles.
template <int M, int D, int W = D>
__device__ __forceinline__ void mma_av(float (&acc)[M][W / 8][4], const std::uint32_t (&a)[M][4],
                                       const bf16* b_tile, int kk, int lane) {
  constexpr int ld = tc::ld_tile(D);
  const tc::RowCol pb = tc::ldsm_a(lane);  // the .trans B layout addresses rows as A does
  for (int nb = 0; nb < W / 16; ++nb) {
    std::uint32_t b[4];
    ldsm_x4_trans(b, b_tile + (16 * kk + pb.row) * ld + 16 * nb + pb.col);
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
      mma_bf16(acc[mt][2 * nb], a[mt], b[0], b[1]);
      mma_bf16(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

/// acc = A·Bᵀ over the whole of D, the score-like products (S = Q·Kᵀ in the forward, Sᵀ = K·Qᵀ
/// and dPᵀ = V·dOᵀ in the backward): A the warp's M 16-row tiles of an [m][D] tile, B all 16·NB
/// rows of an [n][D] tile, both in shared memory.
template <int M, int NB, int D>
__device__ __forceinline__ void product_abt(float (&acc)[M][2 * NB][4], const bf16* a_tile,
                                            const bf16* b_tile, int lane) {
#pragma unroll
  for (int mt = 0; mt < M; ++mt) zero(acc[mt]);
  for (int kk = 0; kk < D / 16; ++kk) mma_abt<M, NB, D>(acc, a_tile, b_tile, kk, lane);
}
/// acc (M row tiles of 16 × D) += C · tile, the products that weight a tile's rows (P·V, Pᵀ·dO,
/// dSᵀ·Q): C, M blocks of [16][8·NC] accumulators, turned into A fragments in the same registers
/// (rounded to bf16), the tile its 8·NC rows of D.
template <int M, int NC, int D>
__device__ __forceinline__ void product_cv(float (&acc)[M][D / 8][4], const float (&c)[M][NC][4],
                                           const bf16* tile, int lane) {
  for (int kk = 0; kk < NC / 2; ++kk) {
    std::uint32_t a[M][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) a_from_c(a[mt], c[mt], kk);
    mma_av<M, D>(acc, a, tile, kk, lane);
  }
}

/// The warp's dSᵀ (16 keys × 32 queries, C fragments) into its rows of the shared dSᵀ tile,
/// rounded to bf16 as the dK product rounded it (a_from_c): two values per 4-byte store.
template <int N>
__device__ __forceinline__ void store_ds(bf16* rows, const float (&c)[N][4], int lane) {
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<std::uint32_t*>(rows + tc::c_row(lane, 2 * h) * tc::ld_ds() + 8 * n +
                                        tc::c_col(lane, 0)) =
          pack_bf16(c[n][2 * h], c[n][2 * h + 1]);
}

// dQ's turns (tc::dq_turn): the block waits until a query tile's counter reads its turn, adds
// its share, and sets the counter to the next turn. Thread 0 spins with an acquire load and, after
// a barrier behind every thread's adds, sets the counter with a release store (PTX ISA, "Memory
// Consistency Model": ld.acquire.gpu, st.release.gpu). The barriers order the other threads'
// accesses with thread 0's (causality order is transitive through them), so the next block reads
// every add of this one. The accumulator is read and written through L2 (ld.global.cg,
// st.global.cg): an SM's L1 is not coherent with the others'.
__device__ __forceinline__ void wait_turn(const unsigned* turn, unsigned mine) {
  if (threadIdx.x == 0) {
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(turn) : "memory");
    } while (seen != mine);
  }
  __syncthreads();
}
__device__ __forceinline__ void pass_turn(unsigned* turn, unsigned next) {
  __syncthreads();
  if (threadIdx.x == 0)
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(turn), "r"(next) : "memory");
}
/// acc (16 × W: query rows row0 + c_row, columns 8n + c_col from p) × scale added to the fp32
/// accumulator p[row·ld + col], rows inside S.
template <int NW>
__device__ __forceinline__ void add_dq(const float (&acc)[NW][4], float scale, float* p, I row0,
                                       I s, I ld, int lane) {
  for (int h = 0; h < 2; ++h) {
    const I row = row0 + tc::c_row(lane, 2 * h);
    if (row >= s) continue;
    for (int n = 0; n < NW; ++n) {
      float2* dst = reinterpret_cast<float2*>(p + row * ld + 8 * n + tc::c_col(lane, 0));
      const float2 x = __ldcg(dst);
      __stcg(dst,
             make_float2(fmaf(acc[n][2 * h], scale, x.x), fmaf(acc[n][2 * h + 1], scale, x.y)));
    }
  }
}

// The pipeline of every tensor-core kernel, per tile t of the loop (buffer b = t mod 2):
//   issue the copies of tile t + 1 into buffer 1 − b; commit (an empty group after the last
//   tile, so that the count stays one group per tile); cp.async.wait_group 1: every group but
//   the newest, i.e. tile t, has landed for this thread; __syncthreads: for every thread;
//   the products on buffer b; __syncthreads: nobody reads buffer b any more, so tile t + 2 may
//   be copied into it.
// Tile t + 1's copy runs during tile t's products; the prologue puts the block's own rows and
// tile 0 in one group before the loop.

/// Issues the copies of K/V tile t (keys t·64 ..) into buffer tc::buffer_of(t): the forward's key
/// tiles.
template <int D>
__device__ __forceinline__ void load_kv_tile(bf16* ks, bf16* vs, const bf16* k, const bf16* v, I t,
                                             I s, I ldkv) {
  constexpr int kTile = kKeyTile * tc::ld_tile(D);
  const int b = tc::buffer_of(t);
  load_tile<kKeyTile, D>(ks + b * kTile, k, t * kKeyTile, s, ldkv);
  load_tile<kKeyTile, D>(vs + b * kTile, v, t * kKeyTile, s, ldkv);
}

/// The pipeline's step at key tile t of `tiles` (above): tile t + 1's copies issued into the
/// other buffer (an empty group after the last tile), then tile t landed for every thread.
template <int D>
__device__ __forceinline__ void next_kv_tile(bf16* ks, bf16* vs, const bf16* k, const bf16* v, I t,
                                             I tiles, I s, I ldkv) {
  if (t + 1 < tiles) load_kv_tile<D>(ks, vs, k, v, t + 1, s, ldkv);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
}

// Forward: one block per (tc::forward_rows(D) query rows, query head), 4 warps of M =
// tc::forward_row_tiles(D) tiles of 16 rows (32 or 16 rows a warp); key tiles of 64 in two
// buffers. Per tile: S = Q·Kᵀ for the warp's row tiles (each K fragment read once for them), the
// online softmax on S's fragments, O += P·V with P as A fragments from S's registers (each V
// fragment read once). O is stored as TOut (bf16: rounded once), lse in fp32.
template <int D, class TOut>
__global__ void __launch_bounds__(tc::kThreads, 2)
    flash_forward_mma(const bf16* q, const bf16* k, const bf16* v, TOut* out, float* lse, I s,
                      I ldq, I ldkv, I group, float scale_log2, I shift) {
  constexpr int M = tc::forward_row_tiles(D), kRows = tc::forward_rows(D);
  extern __shared__ __align__(128) unsigned char mma_smem[];
  constexpr int kTile = kKeyTile * tc::ld_tile(D);  // bf16 per K or V tile
  bf16* qs = reinterpret_cast<bf16*>(mma_smem);
  bf16* ks = qs + kRows * tc::ld_tile(D);  // [2][64][D + 8]
  bf16* vs = ks + 2 * kTile;               // [2][64][D + 8]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const I qb = I(gridDim.y) - 1 - blockIdx.y;  // the longest rows first (tc_grid())
  const I bh = blockIdx.x, q0 = qb * kRows, kvh = bh / group;
  q += bh * D, k += kvh * D, v += kvh * D, out += bh * D;
  const I tiles = tc::key_tiles(q0, s, shift, kRows);
  const I row0 = q0 + warp * M * kWarpRows;  // the warp's first query row; tile mt at + 16·mt
  load_tile<kRows, D>(qs, q, q0, s, ldq);
  if (tiles > 0) load_kv_tile<D>(ks, vs, k, v, 0, s, ldkv);
  cp_async_commit();
  const bf16* qw = qs + warp * M * kWarpRows * tc::ld_tile(D);
  float o[M][D / 8][4];
  float m[M][2], l[M][2];  // l: this lane's share of the sum
#pragma unroll
  for (int mt = 0; mt < M; ++mt) {
    zero(o[mt]);
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }
  // One key tile; kMasked for the tiles after the clear ones (the diagonal, S's ragged end).
  auto step = [&](I t, auto masked) {
    const int b = tc::buffer_of(t);
    next_kv_tile<D>(ks, vs, k, v, t, tiles, s, ldkv);
    float sc[M][kKeyTile / 8][4];
    product_abt<M, kKeyTile / 16, D>(sc, qw, ks + b * kTile, lane);
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
      if constexpr (decltype(masked)::value)
        tc::mask(sc[mt], lane, row0 + mt * kWarpRows, t * kKeyTile, s, shift);
      for (int h = 0; h < 2; ++h) {
        float alpha;
        const float offset =
            tc::online_max(m[mt][h], quad_max(tc::lane_row_max(sc[mt], h)), scale_log2, alpha);
        l[mt][h] = l[mt][h] * alpha + tc::exp_row(sc[mt], h, scale_log2, offset);
        for (int n = 0; n < D / 8; ++n) o[mt][n][2 * h] *= alpha, o[mt][n][2 * h + 1] *= alpha;
      }
    }
    product_cv<M, kKeyTile / 8, D>(o, sc, vs + b * kTile, lane);
    __syncthreads();
  };
  const I clear = tc::clear_key_tiles(q0, s, shift, kRows);
  for (I t = 0; t < clear; ++t) step(t, std::false_type{});
  for (I t = clear; t < tiles; ++t) step(t, std::true_type{});
  cp_async_wait<0>();  // (a block that visited no tile still has its Q in flight)
#pragma unroll
  for (int mt = 0; mt < M; ++mt)
    for (int h = 0; h < 2; ++h) {
      const float lr = quad_sum(l[mt][h]);
      const I row = row0 + mt * kWarpRows + tc::c_row(lane, 2 * h);
      if (row >= s) continue;
      const float f = tc::out_factor(lr);
      for (int n = 0; n < D / 8; ++n)
        store_pair(out + row * ldq + 8 * n + tc::c_col(lane, 0), o[mt][n][2 * h] * f,
                   o[mt][n][2 * h + 1] * f, false);
      if (tc::thread_in_group(lane) == 0) lse[bh * s + row] = tc::row_lse(m[mt][h], lr);
    }
}

// Backward: one block per (tc::bwd_rows(D) keys, KV head), 4 warps of M = tc::bwd_row_tiles(D)
// tiles of 16 keys (32 or 16 keys a warp), its work from a ticket
// (tc::bwd_work: key block 0 of every head first). The steps go over the query tiles of 32 from
// the first that sees the block's keys, and for each tile over the query heads of the group
// (tile-major, so that key block j stays about two steps behind key block j − 1, whose dQ turns
// it waits for, instead of catching up with it head by head); Q, dO, lse and Δ of step t + 1
// copy into two buffers while step t runs. Per step, the five products (FlashAttention-2's
// Algorithm 2): on the transposed blocks Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, Pᵀ and dSᵀ on the
// fragments, dV += Pᵀ·dO and dK += dSᵀ·Q in registers (summed over the group, written once);
// then dSᵀ into shared memory, and dQ (the tile's 32 rows × D, each warp a quarter) = dS·K, added
// to the fp32 accumulator dq_acc at the block's turn (tc::dq_turn). dq_acc is the fp32 output
// itself, or scratch that the launcher rounds into bf16 after the kernel.
template <int D, class TOut>
__global__ void __launch_bounds__(tc::kThreads, 2)
    flash_bwd_mma(const bf16* dout, const bf16* q, const bf16* k, const bf16* v, const float* lse,
                  const float* delta, float* dq_acc, unsigned* sync, TOut* dk, TOut* dv, I s, I ldq,
                  I ldkv, I group, I kv_heads, float scale, float scale_log2, I shift,
                  bool accumulate) {
  constexpr int M = tc::bwd_row_tiles(D), kRows = tc::bwd_rows(D);
  extern __shared__ __align__(128) unsigned char mma_smem[];
  __shared__ unsigned ticket;
  constexpr int kTile = kQueryTile * tc::ld_tile(D);
  bf16* ks = reinterpret_cast<bf16*>(mma_smem);
  bf16* vs = ks + kRows * tc::ld_tile(D);
  bf16* qs = vs + kRows * tc::ld_tile(D);                      // [2][32][D + 8]
  bf16* dos = qs + 2 * kTile;                                  // [2][32][D + 8]
  float* lse_s = reinterpret_cast<float*>(dos + 2 * kTile);    // [2][32], × log2(e)
  float* dl_s = lse_s + 2 * kQueryTile;                        // [2][32]
  bf16* dss = reinterpret_cast<bf16*>(dl_s + 2 * kQueryTile);  // dSᵀ [kRows][32 + 8]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (threadIdx.x == 0) ticket = atomicAdd(sync, 1u);
  __syncthreads();
  const tc::BwdWork work = tc::bwd_work(ticket, kv_heads);
  unsigned* turns = sync + 1;  // [heads_total][query tiles]
  const I kvh = work.kv_head, k0 = work.key_block * kRows;
  const unsigned my_turn = tc::dq_turn(work.key_block);
  k += kvh * D, v += kvh * D, dk += kvh * D, dv += kvh * D;
  const I first = tc::first_query_tile(k0, shift), end = tc::query_tiles_end(s);
  const I total = end > first ? group * (end - first) : 0;  // (query tile, head) steps
  const I row0 = k0 + warp * M * kWarpRows;  // the warp's first key; tile mt at + 16·mt
  // A step: its query tile and query head, counted up (no division in the loop).
  struct Step {
    I tile, head;
  };
  const I head0 = kvh * group;
  auto after = [&](Step p) { return ++p.head == head0 + group ? Step{p.tile + 1, head0} : p; };
  // The step's query and dO tiles into buffer b (issued, not waited for).
  auto load_step = [&](Step p, int b) {
    const I i0 = p.tile * kQueryTile;
    load_tile<kQueryTile, D>(qs + b * kTile, q + p.head * D, i0, s, ldq);
    load_tile<kQueryTile, D>(dos + b * kTile, dout + p.head * D, i0, s, ldq);
  };
  // lse (× log2 e) and Δ of the step's query tile: threads 0-31 fetch lse, 32-63 Δ, one float
  // each, into a register (scaled: cp.async cannot), stored after the step's products.
  auto stats = [&](Step p) {
    const I i0 = p.tile * kQueryTile;
    const int t = int(threadIdx.x) % kQueryTile;
    const float* src = threadIdx.x < kQueryTile ? lse : delta;
    const float scale_of = threadIdx.x < kQueryTile ? tc::kLog2e : 1.0f;
    return i0 + t < s ? src[p.head * s + i0 + t] * scale_of : 0.0f;
  };
  auto put_stats = [&](int b, float x) {
    const int t = int(threadIdx.x) % kQueryTile;
    (threadIdx.x < kQueryTile ? lse_s : dl_s)[b * kQueryTile + t] = x;
  };
  const bool stat_thread = threadIdx.x < 2 * kQueryTile;
  load_tile<kRows, D>(ks, k, k0, s, ldkv);
  load_tile<kRows, D>(vs, v, k0, s, ldkv);
  Step cur{first, head0};
  if (total > 0) {
    load_step(cur, 0);
    if (stat_thread) put_stats(0, stats(cur));
  }
  cp_async_commit();
  const bf16* kw = ks + warp * M * kWarpRows * tc::ld_tile(D);
  const bf16* vw = vs + warp * M * kWarpRows * tc::ld_tile(D);
  bf16* dsw = dss + warp * M * kWarpRows * tc::ld_ds();  // the warp's 16·M key rows of dSᵀ
  // dQ's quarter of the warp: query rows dq_row .. + 15 of the tile, columns dq_col .. + D/2 − 1.
  const bf16* ds_read = dss + tc::dq_row(warp);
  const bf16* k_read = ks + tc::dq_col(warp, D);
  float* dq_warp = dq_acc + tc::dq_col(warp, D);
  float dka[M][D / 8][4], dva[M][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < M; ++mt) {
    zero(dka[mt]);
    zero(dva[mt]);
  }
  for (I it = 0; it < total; ++it) {
    const int b = tc::buffer_of(it), bn = tc::buffer_of(it + 1);
    const bool next = it + 1 < total;
    const Step nxt = after(cur);
    float st = 0.0f;
    if (next) {
      load_step(nxt, bn);
      if (stat_thread) st = stats(nxt);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* qc = qs + b * kTile;
    const bf16* dc = dos + b * kTile;
    const I i0 = cur.tile * kQueryTile;
    {
      float pt[M][kQueryTile / 8][4], dpt[M][kQueryTile / 8][4];
      product_abt<M, kQueryTile / 16, D>(pt, kw, qc, lane);
      product_abt<M, kQueryTile / 16, D>(dpt, vw, dc, lane);
#pragma unroll
      for (int mt = 0; mt < M; ++mt) {
        // The mask's test only on the tiles that need it (the diagonal's, S's ragged end).
        const I r = row0 + mt * kWarpRows;
        if (tc::all_visible(i0, kQueryTile, r, kWarpRows, s, shift))
          tc::ds_cols<false>(pt[mt], dpt[mt], lane, r, i0, s, shift, scale_log2,
                             lse_s + b * kQueryTile, dl_s + b * kQueryTile);
        else
          tc::ds_cols<true>(pt[mt], dpt[mt], lane, r, i0, s, shift, scale_log2,
                            lse_s + b * kQueryTile, dl_s + b * kQueryTile);
      }
      product_cv<M, kQueryTile / 8, D>(dva, pt, dc, lane);
      product_cv<M, kQueryTile / 8, D>(dka, dpt, qc, lane);
#pragma unroll
      for (int mt = 0; mt < M; ++mt) store_ds(dsw + mt * kWarpRows * tc::ld_ds(), dpt[mt], lane);
    }
    if (next && stat_thread) put_stats(bn, st);  // buffer bn's last readers passed the last barrier
    __syncthreads();                             // dSᵀ whole
    float dqa[1][D / 16][4];
    zero(dqa[0]);
    for (int kk = 0; kk < kRows / 16; ++kk) {
      std::uint32_t a[1][4];
      const tc::RowCol pa = tc::ldsm_at(lane);
      ldsm_x4_trans(a[0], ds_read + (16 * kk + pa.row) * tc::ld_ds() + pa.col);
      mma_av<1, D, D / 2>(dqa, a, k_read, kk, lane);
    }
    unsigned* turn = turns + cur.head * end + cur.tile;
    wait_turn(turn, my_turn);
    add_dq(dqa[0], scale, dq_warp + cur.head * D, i0 + tc::dq_row(warp), s, ldq, lane);
    pass_turn(turn, my_turn + 1);  // its barrier also frees buffer b and dSᵀ for the next step
    cur = nxt;
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mt = 0; mt < M; ++mt) {
    store_acc(dka[mt], scale, dk, row0 + mt * kWarpRows, s, ldkv, accumulate, lane);
    store_acc(dva[mt], 1.0f, dv, row0 + mt * kWarpRows, s, ldkv, accumulate, lane);
  }
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

/// True when the mma.sync kernels can run: d = 32, 64 or 128, rows of bf16 that are whole
/// 16-byte chunks (the strides multiples of 8 elements: cp.async copies 16 bytes), and the
/// device lets a block have their shared memory.
cudaError_t tensor_cores_fit(I d, I ldq, I ldkv, bool& use) {
  use = false;
  if ((d != 32 && d != 64 && d != 128) || ldq % 8 != 0 || ldkv % 8 != 0) return cudaSuccess;
  int optin = 0;
  if (const cudaError_t e = smem_optin(optin); e != cudaSuccess) return e;
  const int dd = static_cast<int>(d);
  use = tc::forward_smem(dd) <= optin && tc::bwd_smem(dd) <= optin;
  return cudaSuccess;
}

/// Every pointer 16-byte aligned (cp.async's sources; the outputs' 8-byte stores).
bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

unsigned blocks_of(I rows, int per_block) {
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

/// The forward's grid: (head, tile of `per_tile` query rows) as (x, y). The GPU issues blocks in
/// the order of their linear index, x fastest, so every head's first tile goes before any head's
/// second. The kernel takes its tiles longest first (the last query tiles, which see the most
/// keys), so the last wave holds the shortest tiles of every head instead of tiles of every length
/// of the last heads (at S 2048, D 128, NH 32 on 132 SMs: 1024 blocks, 3.9 waves). The backward
/// takes the same order from its tickets (tc::bwd_work: key block 0, which meets every query
/// tile, of every head first). y holds at most 65535 tiles (S up to 4 Mi at 64 rows a tile): more
/// is refused as an invalid configuration.
cudaError_t tc_grid(I rows, int per_tile, I heads, dim3& grid) {
  const unsigned tiles = blocks_of(rows, per_tile);
  if (tiles > 65535u || heads > 0x7fffffff) return cudaErrorInvalidConfiguration;
  grid = dim3(static_cast<unsigned>(heads), tiles);
  return cudaSuccess;
}

/// The arguments every launcher refuses before it launches anything: a group that does not
/// divide the heads, or a pair's share added into outputs that cannot hold a sum (`add_into`
/// false: bf16 outputs, each rounded once, and the forward, whose outputs are overwritten).
/// Any shift is allowed: every kernel masks with it.
bool valid(I heads_total, I group, bool add_into, FlashPair pair) {
  return group >= 1 && heads_total % group == 0 && (add_into || !pair.accumulate);
}

const bf16* as_bf16(const std::uint16_t* p) {
  return reinterpret_cast<const bf16*>(p);
}

/// The fp32 kernels, or the CUDA-core ones with bf16 compute, on tensors of element type T
/// (every input and output T: float, or bf16 for the CUDA-core fallback of bf16 tensors).
template <class T>
cudaError_t forward_simple(const T* q, const T* k, const T* v, T* out, float* lse, I s,
                           I heads_total, I group, I d, I ldq, I ldkv, bool bf16_compute,
                           FlashPair pair, cudaStream_t st) {
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const int smem = static_cast<int>(2 * kTile * d * sizeof(float));
  const dim3 grid(blocks_of(s, kRowsPerBlock), static_cast<unsigned>(heads_total));
  cudaError_t err = cudaSuccess;
  with_per_lane(d, [&](auto per_lane) {
    constexpr int P = decltype(per_lane)::value;
    auto* kernel = flash_forward_simple<P, true, T>;
    if constexpr (std::is_same_v<T, float>)
      if (!bf16_compute) kernel = flash_forward_simple<P, false, T>;
    err = allow_smem(kernel, smem);
    if (err != cudaSuccess) return;
    kernel<<<grid, kThreads, smem, st>>>(q, k, v, out, lse, s, d, ldq, ldkv, group, scale,
                                         pair.shift);
  });
  return err;
}

template <class T>
cudaError_t backward_simple(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                            const float* delta, T* dq, T* dk, T* dv, I s, I heads_total, I group,
                            I d, I ldq, I ldkv, bool bf16_compute, FlashPair pair,
                            cudaStream_t st) {
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const auto kv_total = static_cast<unsigned>(heads_total / group);  // B·kv_heads
  const unsigned blocks = blocks_of(s, kRowsPerBlock);
  const int smem_dq = static_cast<int>(2 * kTile * d * sizeof(float));
  const int smem_dkdv = static_cast<int>((2 * kTile * d + 2 * kTile) * sizeof(float));
  cudaError_t err = cudaSuccess;
  with_per_lane(d, [&](auto per_lane) {
    constexpr int P = decltype(per_lane)::value;
    // bf16 compute or fp32, each overwriting its outputs or (fp32 outputs, a chunk pair's
    // share) adding to them; bf16 outputs never accumulate (valid()).
    auto* dq_kernel = flash_dq_simple<P, true, false, T>;
    auto* dkdv_kernel = flash_dkdv_simple<P, true, false, T>;
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_compute) {
        if (pair.accumulate) {
          dq_kernel = flash_dq_simple<P, true, true, T>;
          dkdv_kernel = flash_dkdv_simple<P, true, true, T>;
        }
      } else {
        dq_kernel = pair.accumulate ? flash_dq_simple<P, false, true, T>
                                    : flash_dq_simple<P, false, false, T>;
        dkdv_kernel = pair.accumulate ? flash_dkdv_simple<P, false, true, T>
                                      : flash_dkdv_simple<P, false, false, T>;
      }
    }
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

/// Δ = rowsum(dO ∘ O) (dO as the products read it), dO and O each in its stored type.
template <bool kBf16, class TD, class TO>
void launch_delta(const TD* dout, const TO* out, float* delta, I s, I heads_total, I d, I ld,
                  cudaStream_t st) {
  flash_delta_kernel<kBf16, TD, TO><<<dev::blocks_for(heads_total * s * kWarp, 256), 256, 0, st>>>(
      dout, out, delta, s, heads_total, d, ld);
}

/// The tensor-core kernels, bf16 inputs, outputs of type TOut.
template <class TOut>
cudaError_t forward_mma(const bf16* q, const bf16* k, const bf16* v, TOut* out, float* lse, I s,
                        I heads_total, I group, I d, I ldq, I ldkv, FlashPair pair,
                        cudaStream_t st) {
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  cudaError_t err = cudaSuccess;
  with_head_dim(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    err = allow_smem(flash_forward_mma<D, TOut>, tc::forward_smem(D));
    if (err != cudaSuccess) return;
    dim3 grid;
    if (err = tc_grid(s, tc::forward_rows(D), heads_total, grid); err != cudaSuccess) return;
    flash_forward_mma<D, TOut><<<grid, tc::kThreads, tc::forward_smem(D), st>>>(
        q, k, v, out, lse, s, ldq, ldkv, group, scale * tc::kLog2e, pair.shift);
  });
  return err;
}

/// The backward on the tensor cores: Δ first (the caller's launch_delta), then flash_bwd_mma,
/// whose dQ goes to an fp32 accumulator: dq itself when it is fp32 (zeroed first, unless a chunk
/// pair adds into it), else scratch.dq_acc, rounded into the bf16 dq after the kernel. The ticket
/// and the turn counters start at 0.
template <class TOut>
cudaError_t backward_mma(const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                         const float* lse, const float* delta, FlashScratch scratch, TOut* dq,
                         TOut* dk, TOut* dv, I s, I heads_total, I group, I d, I ldq, I ldkv,
                         FlashPair pair, cudaStream_t st) {
  constexpr bool kF32 = std::is_same_v<TOut, float>;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const I kv_heads = heads_total / group;
  float* acc = nullptr;
  if constexpr (kF32)
    acc = dq;
  else
    acc = scratch.dq_acc;
  if (acc == nullptr || scratch.sync == nullptr) return cudaErrorInvalidValue;
  const auto bytes = [](I n, std::size_t each) { return static_cast<std::size_t>(n) * each; };
  cudaError_t err = cudaSuccess;
  if (!(kF32 && pair.accumulate)) err = cudaMemsetAsync(acc, 0, bytes(s * ldq, sizeof(float)), st);
  if (err == cudaSuccess)
    err = cudaMemsetAsync(scratch.sync, 0, bytes(flash_sync_words(heads_total, s), 4), st);
  if (err != cudaSuccess) return err;
  with_head_dim(d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const I blocks = kv_heads * static_cast<I>(blocks_of(s, tc::bwd_rows(D)));
    if (blocks > 0x7fffffff) {
      err = cudaErrorInvalidConfiguration;
      return;
    }
    err = allow_smem(flash_bwd_mma<D, TOut>, tc::bwd_smem(D));
    if (err != cudaSuccess) return;
    flash_bwd_mma<D, TOut><<<static_cast<unsigned>(blocks), tc::kThreads, tc::bwd_smem(D), st>>>(
        dout, q, k, v, lse, delta, acc, scratch.sync, dk, dv, s, ldq, ldkv, group, kv_heads, scale,
        scale * tc::kLog2e, pair.shift, pair.accumulate);
  });
  if (err != cudaSuccess) return err;
  if constexpr (!kF32) f32_to_bf16(acc, reinterpret_cast<std::uint16_t*>(dq), s * ldq, st);
  return cudaSuccess;
}

}  // namespace

int flash_tensor_cores(I d, I ldq, I ldkv, bool& use) {
  return tensor_cores_fit(d, ldq, ldkv, use);
}

I flash_sync_words(I heads_total, I s) {
  return 1 + tc::dq_counters(heads_total, s);
}

int flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                            I s, I heads_total, I group, I d, I ldq, I ldkv, bool bf16_compute,
                            FlashPair pair, void* stream) {
  if (!valid(heads_total, group, false, pair)) return cudaErrorInvalidValue;
  if (s == 0 || heads_total == 0) return cudaSuccess;
  return forward_simple(q, k, v, out, lse, s, heads_total, group, d, ldq, ldkv, bf16_compute, pair,
                        dev::as_stream(stream));
}

int flash_attention_backward(const float* dout, const float* q, const float* k, const float* v,
                             const float* out, const float* lse, float* delta, float* dq, float* dk,
                             float* dv, I s, I heads_total, I group, I d, I ldq, I ldkv,
                             bool bf16_compute, FlashPair pair, void* stream) {
  if (!valid(heads_total, group, true, pair)) return cudaErrorInvalidValue;
  if (s == 0 || heads_total == 0) return cudaSuccess;
  const cudaStream_t st = dev::as_stream(stream);
  if (bf16_compute)
    launch_delta<true>(dout, out, delta, s, heads_total, d, ldq, st);
  else
    launch_delta<false>(dout, out, delta, s, heads_total, d, ldq, st);
  return backward_simple(dout, q, k, v, lse, delta, dq, dk, dv, s, heads_total, group, d, ldq, ldkv,
                         bf16_compute, pair, st);
}

int flash_attention_forward_bf16(const std::uint16_t* q, const std::uint16_t* k,
                                 const std::uint16_t* v, Dst out, float* lse, I s, I heads_total,
                                 I group, I d, I ldq, I ldkv, FlashPair pair, void* stream) {
  if (!valid(heads_total, group, false, pair)) return cudaErrorInvalidValue;
  bool mma = false;
  if (const cudaError_t e = tensor_cores_fit(d, ldq, ldkv, mma); e != cudaSuccess) return e;
  mma = mma && aligned16({q, k, v, out.p});
  if (!mma && !out.bf16) return cudaErrorInvalidValue;  // fp32 outputs need the tensor cores
  if (s == 0 || heads_total == 0) return cudaSuccess;
  const cudaStream_t st = dev::as_stream(stream);
  if (!mma)
    return forward_simple(as_bf16(q), as_bf16(k), as_bf16(v), static_cast<bf16*>(out.p), lse, s,
                          heads_total, group, d, ldq, ldkv, true, pair, st);
  if (out.bf16)
    return forward_mma(as_bf16(q), as_bf16(k), as_bf16(v), static_cast<bf16*>(out.p), lse, s,
                       heads_total, group, d, ldq, ldkv, pair, st);
  return forward_mma(as_bf16(q), as_bf16(k), as_bf16(v), static_cast<float*>(out.p), lse, s,
                     heads_total, group, d, ldq, ldkv, pair, st);
}

int flash_attention_backward_bf16(const std::uint16_t* dout, const std::uint16_t* q,
                                  const std::uint16_t* k, const std::uint16_t* v, Src out,
                                  const float* lse, FlashScratch scratch, Dst dq, Dst dk, Dst dv,
                                  I s, I heads_total, I group, I d, I ldq, I ldkv, FlashPair pair,
                                  void* stream) {
  if (dq.bf16 != dk.bf16 || dq.bf16 != dv.bf16) return cudaErrorInvalidValue;
  if (!valid(heads_total, group, !dq.bf16, pair)) return cudaErrorInvalidValue;
  bool mma = false;
  if (const cudaError_t e = tensor_cores_fit(d, ldq, ldkv, mma); e != cudaSuccess) return e;
  mma = mma && aligned16({dout, q, k, v, dq.p, dk.p, dv.p});
  if (!mma && !dq.bf16) return cudaErrorInvalidValue;  // fp32 outputs need the tensor cores
  if (s == 0 || heads_total == 0) return cudaSuccess;
  const cudaStream_t st = dev::as_stream(stream);
  if (out.bf16)
    launch_delta<true>(as_bf16(dout), static_cast<const bf16*>(out.p), scratch.delta, s,
                       heads_total, d, ldq, st);
  else
    launch_delta<true>(as_bf16(dout), static_cast<const float*>(out.p), scratch.delta, s,
                       heads_total, d, ldq, st);
  if (!mma)
    return backward_simple(as_bf16(dout), as_bf16(q), as_bf16(k), as_bf16(v), lse, scratch.delta,
                           static_cast<bf16*>(dq.p), static_cast<bf16*>(dk.p),
                           static_cast<bf16*>(dv.p), s, heads_total, group, d, ldq, ldkv, true,
                           pair, st);
  if (dq.bf16)
    return backward_mma(as_bf16(dout), as_bf16(q), as_bf16(k), as_bf16(v), lse, scratch.delta,
                        scratch, static_cast<bf16*>(dq.p), static_cast<bf16*>(dk.p),
                        static_cast<bf16*>(dv.p), s, heads_total, group, d, ldq, ldkv, pair, st);
  return backward_mma(as_bf16(dout), as_bf16(q), as_bf16(k), as_bf16(v), lse, scratch.delta,
                      scratch, static_cast<float*>(dq.p), static_cast<float*>(dk.p),
                      static_cast<float*>(dv.p), s, heads_total, group, d, ldq, ldkv, pair, st);
}

void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, I s,
                     I heads_total, I d, I ld, void* stream) {
  if (s == 0 || heads_total == 0) return;
  flash_merge_kernel<<<dev::blocks_for(heads_total * s * kWarp, 256), 256, 0,
                       dev::as_stream(stream)>>>(out, lse, part_out, part_lse, s, heads_total, d,
                                                 ld);
}

}  // namespace tpx::cuda::kernels
