// The index math and the per-lane arithmetic of the tensor-core attention kernels
// (flash_attention.cu, "mma.sync kernels"), as functions that also run on the host: the fragment
// layouts of mma.m16n8k16 and of ldmatrix, the tiles' shapes and shared-memory bytes, which
// thread copies which 16-byte chunk of a tile (cp.async) and which of the two buffers a tile goes
// to, the loops' bounds, the one visibility rule (causal, a chunk pair's shift, S not a multiple of
// a tile) and the online softmax on accumulator fragments. tests/test_flash_tc_twin.cc runs the
// kernels' per-warp algorithm on the CPU through these same functions (32 lanes as arrays, an
// emulated mma and ldmatrix) against a double-precision attention. That checks the algorithm, the
// tiling and that these functions agree with each other; whether they agree with the hardware (the
// fragment layouts below as the PTX ISA states them, read here) only a GPU run can check.
//
// Fragment layouts, PTX ISA (CUDA 13.0), section 9.7.14.5.8, "Matrix Fragments for
// mma.m16n8k16 with floating point type": in a warp, lane = 4·groupID + threadID_in_group;
//  - A, 16×16 (m×k, .row), bf16: a0..a7 (four .b32 registers of two bf16, the lower index in the
//    lower half): row = groupID + 8 for a2, a3, a6, a7 (else groupID);
//    col = 2·threadID_in_group + (i & 1) + 8 for i >= 4.
//  - B, 16×8 (k×n, .col), bf16: b0..b3 (two registers): row (k) = 2·threadID_in_group + (i & 1)
//    + 8 for i >= 2; col (n) = groupID.
//  - C and D, 16×8, f32: c0..c3: row = groupID + 8 for c2, c3; col = 2·threadID_in_group + (i & 1).
// ldmatrix (section 9.7.14.5.15, "ldmatrix"), .m8n8.x4.b16: lanes 8·m .. 8·m + 7 give the
// addresses of the 8 rows (16 bytes each) of matrix m; lane l receives, in register m, the
// elements (l / 4, 2·(l % 4)) and (l / 4, 2·(l % 4) + 1) of matrix m, or with .trans the elements
// (2·(l % 4), l / 4) and (2·(l % 4) + 1, l / 4).
//
// defines: tpx::cuda::flash::tc::* (the constants, tile chunks and buffers, fragment and
//          ldmatrix indices, tile bounds, visible(), the backward's work and dQ's turns, the
//          softmax steps)
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_operands.h"

namespace tpx::cuda::flash::tc {

using I = std::int64_t;

inline constexpr int kLanes = 32;
inline constexpr int kWarps = 4;  // per block
inline constexpr int kThreads = kWarps * kLanes;
inline constexpr int kWarpRows = 16;                   // query (or key) rows a warp owns
inline constexpr int kBlockRows = kWarps * kWarpRows;  // 64: a block of 16 rows a warp
inline constexpr int kKeyTile = 64;                    // keys per tile (forward)
inline constexpr int kQueryTile = 32;                  // queries per tile (backward)
inline constexpr int kPad = 8;                         // bf16 per shared row past D
inline constexpr float kLog2e = 1.4426950408889634f;   // scores go to exp2
inline constexpr float kLn2 = 0.6931471805599453f;

/// A shared tile's row stride in bf16: D + 8, so the 8 rows one ldmatrix reads start 16 bytes
/// apart modulo 128 and hit 8 different 4-byte bank groups (no conflicts).
constexpr int ld_tile(int d) {
  return d + kPad;
}
/// Bytes of a bf16 [rows][D + 8] tile.
constexpr int tile_bytes(int rows, int d) {
  return 2 * rows * ld_tile(d);
}
/// The forward's query rows per warp, in 16-row tiles: 2 (32 rows, FlashAttention-2's 128-row
/// block of 4 warps) where ptxas fits them in 255 registers without spilling, D = 32 and 64; 1 at
/// D = 128, where O alone would take 128 registers and the scores 64 more (ptxas spills them;
/// flash_attention.cu's header has the numbers). Each of a warp's row tiles reads the same K and V
/// fragments: two tiles halve the shared-memory reads per product.
constexpr int forward_row_tiles(int d) {
  return d <= 64 ? 2 : 1;
}
/// The forward block's query rows: 4 warps of forward_row_tiles(d) · 16.
constexpr int forward_rows(int d) {
  return kWarps * kWarpRows * forward_row_tiles(d);
}
/// Dynamic shared memory of each kernel. Forward: Q, then K and V twice (double-buffered).
constexpr int forward_smem(int d) {
  return tile_bytes(forward_rows(d), d) + 4 * tile_bytes(kKeyTile, d);
}
/// The backward's dSᵀ tile: the block's keys by a step's 32 queries, bf16, rows of 32 + 8
/// (80 bytes: the 8 rows an ldmatrix reads start at 8 different 16-byte bank groups, and the
/// 32 lanes' 4-byte stores of a fragment hit 32 different banks).
constexpr int ld_ds() {
  return kQueryTile + kPad;
}
/// The backward's key rows per warp, in 16-row tiles: 2 (32 keys, a block of 128) at D = 32,
/// where ptxas fits them in 255 registers without spilling on sm_80 and sm_90; 1 at D = 64
/// (sm_80 spills at 32 keys a warp) and 128, where dK and dV alone would take 256 registers
/// (flash_attention.cu's header has the numbers). The row tiles share every Q and dO fragment
/// the warp reads.
constexpr int bwd_row_tiles(int d) {
  return d <= 32 ? 2 : 1;
}
/// The backward block's keys: 4 warps of bwd_row_tiles(d) · 16.
constexpr int bwd_rows(int d) {
  return kWarps * kWarpRows * bwd_row_tiles(d);
}
/// Backward: K and V of the block's keys, then Q and dO twice, then lse and Δ (fp32) twice, then
/// the dSᵀ tile that dQ = dS·K reads.
constexpr int bwd_smem(int d) {
  return 2 * tile_bytes(bwd_rows(d), d) + 4 * tile_bytes(kQueryTile, d) + 2 * 2 * kQueryTile * 4 +
         2 * bwd_rows(d) * ld_ds();
}

// ---- Tiles copied by cp.async ---------------------------------------------------------------

/// 16-byte chunks (8 bf16) in a row of D: the unit of a tile's cp.async copies.
TPX_HD constexpr int row_chunks(int d) {
  return d / 8;
}
/// Chunk e of a [rows][D] tile (thread x copies chunks x, x + kThreads, ...): its row, and its
/// first column in bf16.
TPX_HD constexpr int chunk_row(int e, int d) {
  return e / row_chunks(d);
}
TPX_HD constexpr int chunk_col(int e, int d) {
  return 8 * (e % row_chunks(d));
}
/// The shared buffer (0 or 1) that tile t of a loop is copied into: tile t + 1 goes into the
/// other one while tile t is multiplied.
TPX_HD constexpr int buffer_of(I t) {
  return static_cast<int>(t & 1);
}

// ---- Fragments (PTX ISA 9.7.14.5.8) ------------------------------------------------------------

TPX_HD constexpr int group_id(int lane) {
  return lane >> 2;
}
TPX_HD constexpr int thread_in_group(int lane) {
  return lane & 3;
}
/// Row and column of element a_i (i = 0..7) of lane's A fragment (16×16).
TPX_HD constexpr int a_row(int lane, int i) {
  return group_id(lane) + ((i >> 1) & 1) * 8;
}
TPX_HD constexpr int a_col(int lane, int i) {
  return 2 * thread_in_group(lane) + (i & 1) + (i >> 2) * 8;
}
/// Row (k) and column (n) of element b_i (i = 0..3) of lane's B fragment (16×8).
TPX_HD constexpr int b_row(int lane, int i) {
  return 2 * thread_in_group(lane) + (i & 1) + (i >> 1) * 8;
}
TPX_HD constexpr int b_col(int lane, int /*i*/) {
  return group_id(lane);
}
/// Row and column of element c_i (i = 0..3) of lane's C/D fragment (16×8).
TPX_HD constexpr int c_row(int lane, int i) {
  return group_id(lane) + (i >> 1) * 8;
}
TPX_HD constexpr int c_col(int lane, int i) {
  return 2 * thread_in_group(lane) + (i & 1);
}

/// The A fragment of a 16×16 block whose two 16×8 halves are the C fragments lo (columns 0-7)
/// and hi (8-15): a0..a3 = lo's c0..c3 and a4..a7 = hi's, element for element (a_row/a_col of
/// a_i equal c_row/c_col of c_(i % 4), plus 8 columns for i >= 4). This is how a product's
/// result (scores, dS) becomes the next product's operand without leaving the registers.
TPX_HD constexpr int a_from_c_half(int i) {
  return i >> 2;  // 0: lo, 1: hi
}
TPX_HD constexpr int a_from_c_index(int i) {
  return i & 3;
}

// ---- ldmatrix.x4 addresses (PTX ISA 9.7.14.5.15) -----------------------------------------------

struct RowCol {
  int row, col;
};
/// Matrix m = lane / 8 and its row lane % 8, for the row address lane gives ldmatrix.x4.
TPX_HD constexpr int ldsm_matrix(int lane) {
  return lane >> 3;
}
/// The A fragment of the 16×16 block at (0, 0) of a row-major [m][k] tile: matrices (rows 0-7,
/// cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are registers a0a1, a2a3, a4a5, a6a7.
/// Also the B fragments of two 8-wide n blocks from a [k][n] tile read with .trans: matrices
/// (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) are b0b1 and b2b3 of n
/// block 0, then of n block 1.
TPX_HD constexpr RowCol ldsm_a(int lane) {
  return {(lane & 7) + (ldsm_matrix(lane) & 1) * 8, (ldsm_matrix(lane) >> 1) * 8};
}
/// The B fragments of two 8-wide n blocks from an [n][k] tile (K for Q·Kᵀ; Q, dO for K·Qᵀ),
/// without .trans: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
/// are b0b1 and b2b3 of n block 0, then of n block 1. Returned as (tile row = n, column = k).
TPX_HD constexpr RowCol ldsm_b(int lane) {
  return {(lane & 7) + (ldsm_matrix(lane) >> 1) * 8, (ldsm_matrix(lane) & 1) * 8};
}
/// The A fragment of the 16×16 block at (0, 0) of an [m][k] matrix stored transposed, as a
/// [k][m] tile (dSᵀ: keys by queries, for dQ = dS·K), read with .trans: matrices (m 0-7, k 0-7),
/// (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) lie at tile rows (k) 8·(matrix >> 1) ..,
/// column (m) 8·(matrix & 1). Returned as (tile row = k, column = m).
TPX_HD constexpr RowCol ldsm_at(int lane) {
  return {(lane & 7) + (ldsm_matrix(lane) >> 1) * 8, (ldsm_matrix(lane) & 1) * 8};
}
/// What lane receives from one 8×8 matrix: element j (0, 1) of its register is the matrix's
/// (row, col); with .trans the transposed position.
TPX_HD constexpr RowCol ldsm_element(int lane, int j, bool trans) {
  return trans ? RowCol{2 * (lane & 3) + j, lane >> 2} : RowCol{lane >> 2, 2 * (lane & 3) + j};
}

// ---- Tiles and the visibility rule --------------------------------------------------------------

/// Key j is visible to query i: both inside the sequence, and j <= i + shift (shift 0: the causal
/// mask; a chunk pair's keys lie `shift` positions before its queries).
TPX_HD constexpr bool visible(I i, I j, I s, I shift) {
  return i < s && j < s && j <= i + shift;
}
/// visible() for the elements of one tile, in 32-bit arithmetic: query row0 + i and key col0 + j
/// (0 <= i, j < 64) see each other iff i < rows, j < cols and j − i <= diag, with rows = S − row0,
/// cols = S − col0 and diag = row0 + shift − col0 each clamped to ±128, which keeps every
/// comparison's outcome for such i and j. The backward makes one per masked step and tests each
/// score with three 32-bit comparisons (in the forward it cost registers: its masked tiles keep
/// visible()).
struct TileMask {
  int rows, cols, diag;
  static TPX_HD constexpr int clamp(I x) { return x < -128 ? -128 : x > 128 ? 128 : int(x); }
  TPX_HD constexpr TileMask(I row0, I col0, I s, I shift)
      : rows(clamp(s - row0)), cols(clamp(s - col0)), diag(clamp(row0 + shift - col0)) {}
  TPX_HD constexpr bool sees(int i, int j) const { return i < rows && j < cols && j - i <= diag; }
};
/// Every (query, key) of rows i0 .. i0 + ni − 1 and keys j0 .. j0 + nj − 1 is visible: the tile
/// needs no mask (the kernels skip it then).
TPX_HD constexpr bool all_visible(I i0, I ni, I j0, I nj, I s, I shift) {
  return i0 + ni <= s && j0 + nj <= s && j0 + nj - 1 <= i0 + shift;
}
/// Of those key tiles, how many at the start every row q0 .. q0 + rows − 1 sees whole
/// (all_visible() of the block's rows): the rows inside S, the tile's keys inside S and at or
/// below the first row's last visible key, t·64 + 63 <= q0 + shift. The kernel runs these tiles
/// without a mask and the rest (the diagonal, S's ragged end) with one.
TPX_HD constexpr I clear_key_tiles(I q0, I s, I shift, I rows) {
  if (q0 + rows > s || q0 + shift + 1 < kKeyTile) return 0;
  const I by_rows = (q0 + shift + 1) / kKeyTile, by_keys = s / kKeyTile;
  return by_rows < by_keys ? by_rows : by_keys;
}
/// Key tiles of kKeyTile the query rows q0 .. q0 + rows − 1 visit (forward): those up to the
/// last key the block's last row (inside S) sees; 0 when it sees none.
TPX_HD constexpr I key_tiles(I q0, I s, I shift, I rows) {
  const I last = (q0 + rows < s ? q0 + rows : s) - 1;
  const I end0 = last + shift + 1 < s ? last + shift + 1 : s;
  const I end = end0 > 0 ? end0 : 0;
  return (end + kKeyTile - 1) / kKeyTile;
}
/// The first query tile (of kQueryTile) that sees any of the keys k0 .. k0 + 63: the tile of the
/// first query that sees key k0, max(0, k0 − shift) (backward).
TPX_HD constexpr I first_query_tile(I k0, I shift) {
  return (k0 - shift > 0 ? k0 - shift : 0) / kQueryTile;
}
/// One past the last query tile: ceil(S / kQueryTile).
TPX_HD constexpr I query_tiles_end(I s) {
  return (s + kQueryTile - 1) / kQueryTile;
}

// ---- The backward's work, and dQ's turns ------------------------------------------------------
// One backward block per (bwd_rows() keys, KV head) runs the five products of a step (a query tile of 32
// and one query head of the group): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q in the
// warps' registers, and dQ = dS·K, the step's share of 32 query rows, added to an fp32
// accumulator in global memory that every key block adds into. Floating-point addition is not
// associative, so the order of those adds is fixed: key block j adds its share to query tile i of
// head h at turn j, waiting until the tile's counter reads j and setting it to j + 1 after. Every
// key block j' < j visits tile i too (first_query_tile() does not decrease with the key block),
// so the counter gets there; and a block waits only for blocks that started before it (the
// tickets below), so no wait can deadlock.

/// The blocks take their work in the order they start, from a ticket (a counter every block
/// increments once), not from blockIdx: ticket t is KV head t % kv_heads, key block
/// t / kv_heads. Every head's key block 0 (which meets every query tile: the longest) first, and
/// key block j of a head after key blocks 0 .. j − 1 of that head, whose turns it waits for.
struct BwdWork {
  I kv_head, key_block;
};
TPX_HD constexpr BwdWork bwd_work(I ticket, I kv_heads) {
  return {ticket % kv_heads, ticket / kv_heads};
}
/// The turn at which key block j adds its share to any query tile's dQ.
TPX_HD constexpr unsigned dq_turn(I key_block) {
  return static_cast<unsigned>(key_block);
}
/// The counters of dQ's turns: one per (query head, query tile of kQueryTile).
TPX_HD constexpr I dq_counters(I heads_total, I s) {
  return heads_total * query_tiles_end(s);
}
/// dQ's product, the step's 32 queries × D over the 4 warps: warp w takes query rows
/// dq_row(w) .. + 15 of the tile and columns dq_col(w, D) .. + D/2 − 1.
TPX_HD constexpr int dq_row(int warp) {
  return (warp & 1) * kWarpRows;
}
TPX_HD constexpr int dq_col(int warp, int d) {
  return (warp >> 1) * (d / 2);
}
static_assert(kWarps == 4 && kQueryTile == 2 * kWarpRows, "dQ's split: 2 × 2 warps");

// ---- The softmax on C fragments -----------------------------------------------------------------
// A warp's [16][N·8] score block is N C fragments: lane holds, of fragment n, the elements
// (row g, cols 8n + 2t, +1) in c0, c1 and (row g + 8, the same cols) in c2, c3 (g = groupID,
// t = threadID_in_group). Half h = 0 is row g, h = 1 row g + 8: the four lanes of a quad hold
// all of a row between them, so a row's max or sum is the lane's own, then two shuffles.

/// 2^x: on the GPU one MUFU instruction, ex2.approx.ftz.f32 (PTX ISA, "ex2": an approximation,
/// subnormal inputs and results flushed to zero; ex2(−inf) = +0), where exp2f adds a guard for
/// subnormals around it; on the host exp2f (the twin). The scores' exponents are one FFMA before
/// it: x = s·scale·log2(e) − offset.
TPX_HD inline float exp2_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

/// Forward, a tile that needs a mask (clear_key_tiles()): −inf where the key is not visible,
/// the raw score elsewhere (scaled in exp_row). Query row0 + c_row, key col0 + 8n + c_col.
template <int N>
TPX_HD inline void mask(float (&sc)[N][4], int lane, I row0, I col0, I s, I shift) {
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < 4; ++e)
      if (!visible(row0 + c_row(lane, e), col0 + 8 * n + c_col(lane, e), s, shift))
        sc[n][e] = -INFINITY;
}
/// The lane's maximum of row half h.
template <int N>
TPX_HD inline float lane_row_max(const float (&sc)[N][4], int h) {
  float mx = -INFINITY;
  for (int n = 0; n < N; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * h], sc[n][2 * h + 1]));
  return mx;
}
/// The online softmax's step for one row, given the tile's raw row maximum `tile_max` (over the
/// quad; the scale is positive, so it is the maximum of the scaled scores too): m ← max(m,
/// tile_max·scale_log2) in exp2 units; returns the exponent's offset (m, or 0 while the row has
/// seen no visible key, so that exp2(−inf − 0) = 0 and nothing becomes NaN) and sets alpha =
/// exp2(m_old − offset), the factor that rescales l and O summed against the old maximum.
TPX_HD inline float online_max(float& m, float tile_max, float scale_log2, float& alpha) {
  const float m_new = fmaxf(m, tile_max * scale_log2);
  const float use = m_new == -INFINITY ? 0.0f : m_new;
  alpha = exp2_fast(m - use);
  m = m_new;
  return use;
}
/// p = exp2(x·scale_log2 − offset) in place for row half h, one FFMA and one ex2 each; returns
/// the lane's sum of them (fp32, before the bf16 rounding P gets as an operand).
template <int N>
TPX_HD inline float exp_row(float (&sc)[N][4], int h, float scale_log2, float offset) {
  float sum = 0.0f;
  for (int n = 0; n < N; ++n)
    for (int e = 2 * h; e < 2 * h + 2; ++e) {
      sc[n][e] = exp2_fast(fmaf(sc[n][e], scale_log2, -offset));
      sum += sc[n][e];
    }
  return sum;
}
/// The end of a forward row, with l summed over the quad: O's divisor (0 for a row that saw no
/// key: its output is 0) and lse = m·ln 2 + log l (−inf for such a row).
TPX_HD inline float out_factor(float l) {
  return l > 0.0f ? 1.0f / l : 0.0f;
}
TPX_HD inline float row_lse(float m, float l) {
  return l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
}

/// Backward (the transposed block, key row0 + c_row, query col0 + c_col):
/// pt = Pᵀ and dpt becomes dSᵀ. lse2 and delta are per query column (the tile's, in shared
/// memory, indexed from col0).
template <bool kMasked, int N>
TPX_HD inline void ds_cols(float (&pt)[N][4], float (&dpt)[N][4], int lane, I row0, I col0, I s,
                           I shift, float scale_log2, const float* lse2, const float* delta) {
  const TileMask tile(col0, row0, s, shift);  // queries along the columns here
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * n + c_col(lane, e);
      float p = exp2_fast(fmaf(pt[n][e], scale_log2, -lse2[c]));
      if constexpr (kMasked)
        if (!tile.sees(c, c_row(lane, e))) p = 0.0f;
      pt[n][e] = p;
      dpt[n][e] = p * (dpt[n][e] - delta[c]);
    }
}

}  // namespace tpx::cuda::flash::tc
