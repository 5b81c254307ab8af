// A CPU twin of the mma.sync attention kernels (common/cuda/flash_attention.cu): the same
// per-warp algorithm, run with the 32 lanes of a warp as arrays, through the functions the
// kernels call (common/cuda/flash_tc_math.h): ldmatrix's row addresses, the fragment layouts of
// mma.m16n8k16, the C-to-A register reuse, the tile loops' bounds, the visibility rule (causal,
// a chunk pair's shift, S not a multiple of a tile, S = 1), the online softmax on fragments
// with its quad reductions, the backward's P and dS on fragments. An emulated ldmatrix hands
// each lane the elements the PTX ISA says it receives (9.7.14.5.15), an emulated mma gathers
// each lane's a0..a7, b0..b3, c0..c3 into matrices through a_row/a_col, b_row/b_col,
// c_row/c_col (9.7.14.5.8) and scatters the result back the same way. The inputs are bf16
// tensors as stored (values rounded once, before anything runs); tiles are copied in 16-byte
// chunks as the kernels' cp.async copies them (tc::chunk_row, chunk_col: a chunk nobody copies
// stays NaN), into two buffers in the kernels' order (tile t + 1 into tc::buffer_of(t + 1)
// before tile t is multiplied from tc::buffer_of(t)); P and dS are rounded as the kernels pack
// them, and the outputs as the kernels store them: bf16 (rounded once) for the causal
// attention, fp32 added to what is there for a chunk pair.
//
// The backward's blocks (one per 64 keys and KV head, in ticket order) hand their shares of dQ to
// a scheduler that plays the GPU (add_dq_shares): a few blocks resident at a time, started in
// ticket order, each adding its next share at its turn, in a random interleaving; it checks that
// any interleaving gives the same bits and that no block waits for one that has not started.
//
// What this checks: that the algorithm and its tiling compute the attention (forward, dQ, dK,
// dV, grouped-query, chunk pairs with a shift that add into their gradients) to bf16 accuracy
// against a double-precision reference, and that the index functions are consistent with each
// other and with the fragment layouts as written in flash_tc_math.h. What it cannot check: that
// those layouts are what the hardware does (the PTX ISA's fragment tables as read there), the
// inline PTX itself (cp.async, its wait_group and the barriers around it: the twin's copies land
// at once, so a missing wait or __syncthreads shows only as a race on a GPU), and shared-memory
// addressing: only a run on a GPU checks those (FusedAttention.Cuda* in test_attention.cc,
// compute-sanitizer's racecheck).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda/flash_operands.h"
#include "common/cuda/flash_tc_math.h"

namespace {

namespace tc = tpx::cuda::flash::tc;
using tpx::cuda::flash::round_bf16;
using I = std::int64_t;
constexpr int kL = tc::kLanes;

// ---- The warp's primitives, emulated -----------------------------------------------------------

/// A shared-memory tile: rows of a head's [S][D] slice of a bf16 tensor, zero past S.
struct Tile {
  int rows = 0, d = 0;
  std::vector<float> v;
  float at(int r, int c) const { return v[static_cast<std::size_t>(r * d + c)]; }
};
/// A buffer nothing has been copied into yet.
Tile unwritten(int rows, int d) {
  return {rows, d, std::vector<float>(static_cast<std::size_t>(rows * d), NAN)};
}
/// The kernels' load_tile: thread x of the block copies 16-byte chunks x, x + kThreads, ...
/// (8 bf16 each; tc::chunk_row, chunk_col), a row past S as 16 zero bytes.
Tile load_tile(const std::vector<float>& x, I row0, int rows, I s, I ld, I off, int d) {
  Tile t = unwritten(rows, d);
  const int per_thread = rows * tc::row_chunks(d) / tc::kThreads;
  for (int u = 0; u < per_thread; ++u)
    for (int th = 0; th < tc::kThreads; ++th) {
      const int e = th + tc::kThreads * u;
      const int r = tc::chunk_row(e, d), c0 = tc::chunk_col(e, d);
      for (int c = c0; c < c0 + 8; ++c)
        t.v[static_cast<std::size_t>(r * d + c)] =
            row0 + r < s ? x[static_cast<std::size_t>((row0 + r) * ld + off + c)] : 0.0f;
    }
  return t;
}

/// ldmatrix.x4 (optionally .trans) from the 16×16 block at (row0, col0) of a tile, with lane l
/// pointing at the row `addr(l)` says: out[l][m][j], element j of lane l's register m.
using Regs = std::array<std::array<std::array<float, 2>, 4>, kL>;
template <class Addr>
Regs ldsm_x4(const Tile& t, int row0, int col0, bool trans, Addr addr) {
  float mat[4][8][8];
  for (int lane = 0; lane < kL; ++lane) {  // lanes 8m .. 8m + 7: rows of matrix m
    const tc::RowCol a = addr(lane);
    for (int c = 0; c < 8; ++c)
      mat[tc::ldsm_matrix(lane)][lane & 7][c] = t.at(row0 + a.row, col0 + a.col + c);
  }
  Regs out{};
  for (int lane = 0; lane < kL; ++lane)
    for (int m = 0; m < 4; ++m)
      for (int j = 0; j < 2; ++j) {
        const tc::RowCol e = tc::ldsm_element(lane, j, trans);
        out[static_cast<std::size_t>(lane)][static_cast<std::size_t>(m)]
           [static_cast<std::size_t>(j)] = mat[m][e.row][e.col];
      }
  return out;
}

using FragA = std::array<std::array<float, 8>, kL>;
using FragB = std::array<std::array<float, 4>, kL>;
/// A warp's N C fragments: [lane][n][c_i].
template <int N>
struct FragC {
  float v[kL][N][4];
  float (&operator[](int lane))[N][4] { return v[lane]; }
  const float (&operator[](int lane) const)[N][4] { return v[lane]; }
};

/// Registers m = 0..3 as a0a1, a2a3, a4a5, a6a7.
FragA as_a(const Regs& r) {
  FragA a{};
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 8; ++i) a[l][i] = r[l][i >> 1][i & 1];
  return a;
}
/// Registers 2h, 2h + 1 as b0b1, b2b3 of n block h.
FragB as_b(const Regs& r, int h) {
  FragB b{};
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 4; ++i) b[l][i] = r[l][2 * h + (i >> 1)][i & 1];
  return b;
}

/// mma.m16n8k16: D = A·B + C, every lane's registers placed by the fragment layouts. Counts how
/// often each position is written, which must be once.
template <int N>
void mma(FragC<N>& c, int n, const FragA& a, const FragB& b) {
  float am[16][16], bm[16][8], cm[16][8];
  int hits_a[16][16] = {}, hits_b[16][8] = {}, hits_c[16][8] = {};
  for (int l = 0; l < kL; ++l) {
    for (int i = 0; i < 8; ++i) {
      am[tc::a_row(l, i)][tc::a_col(l, i)] = a[l][i];
      ++hits_a[tc::a_row(l, i)][tc::a_col(l, i)];
    }
    for (int i = 0; i < 4; ++i) {
      bm[tc::b_row(l, i)][tc::b_col(l, i)] = b[l][i];
      ++hits_b[tc::b_row(l, i)][tc::b_col(l, i)];
      cm[tc::c_row(l, i)][tc::c_col(l, i)] = c[l][n][i];
      ++hits_c[tc::c_row(l, i)][tc::c_col(l, i)];
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) {
      ASSERT_EQ(hits_a[r][k], 1) << "A fragment (" << r << ", " << k << ")";
      if (k < 8) {
        ASSERT_EQ(hits_b[r][k], 1) << "B fragment (" << r << ", " << k << ")";
        ASSERT_EQ(hits_c[r][k], 1) << "C fragment (" << r << ", " << k << ")";
      }
    }
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 8; ++col) {
      float acc = cm[r][col];
      for (int k = 0; k < 16; ++k) acc += am[r][k] * bm[k][col];
      cm[r][col] = acc;
    }
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 4; ++i) c[l][n][i] = cm[tc::c_row(l, i)][tc::c_col(l, i)];
}

/// __shfl_xor_sync over 1 and 2: the reduction among the four lanes of a quad.
template <class Op>
std::array<float, kL> quad(std::array<float, kL> x, Op op) {
  for (int o = 1; o <= 2; o *= 2) {
    std::array<float, kL> y = x;
    for (int l = 0; l < kL; ++l) y[l] = op(x[l], x[l ^ o]);
    x = y;
  }
  return x;
}

template <int N>
void zero(FragC<N>& c) {
  for (auto& lane : c.v)
    for (auto& f : lane) f[0] = f[1] = f[2] = f[3] = 0.0f;
}

/// The warp's per-lane fragment arrays as the kernels' `float (&)[N][4]`.
template <int N>
float (&lane_frag(FragC<N>& c, int l))[N][4] {
  return c[l];
}

/// acc (16 × 16·NB as 2·NB C fragments) += rows row0.. of a (16 of them) · rows n0.. of bᵀ, over
/// all of D: the kernels' mma_abt for every k step.
template <int NC>
void mma_abt(FragC<NC>& acc, const Tile& a, int arow0, const Tile& b, int d) {
  for (int kk = 0; kk < d / 16; ++kk) {
    const FragA fa = as_a(ldsm_x4(a, arow0, 16 * kk, false, tc::ldsm_a));
    for (int nb = 0; nb < NC / 2; ++nb) {
      const Regs r = ldsm_x4(b, 16 * nb, 16 * kk, false, tc::ldsm_b);
      mma(acc, 2 * nb, fa, as_b(r, 0));
      mma(acc, 2 * nb + 1, fa, as_b(r, 1));
    }
  }
}
/// The kernels' a_from_c: the A fragment of columns 16kk.. of a C-fragment block, bf16.
template <int NC>
FragA a_from_c(const FragC<NC>& c, int kk) {
  FragA a{};
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 8; ++i)
      a[l][i] = round_bf16(c[l][2 * kk + tc::a_from_c_half(i)][tc::a_from_c_index(i)]);
  return a;
}
/// acc (16 × D) += A · rows 16kk.. of a [k][D] tile, read with .trans (the kernels' mma_av).
template <int ND>
void mma_av(FragC<ND>& acc, const FragA& a, const Tile& b, int kk) {
  for (int nb = 0; nb < ND / 2; ++nb) {
    const Regs r = ldsm_x4(b, 16 * kk, 16 * nb, true, tc::ldsm_a);
    mma(acc, 2 * nb, a, as_b(r, 0));
    mma(acc, 2 * nb + 1, a, as_b(r, 1));
  }
}

// ---- The kernels, one warp at a time -----------------------------------------------------------

struct Problem {
  I s, d, heads, group, shift;
  bool accumulate;
  bool bf16_out = false;  // outputs stored bf16 (the causal attention) or fp32 (chunk pairs)
  I kv() const { return heads / group; }
  I ldq() const { return heads * d; }
  I ldkv() const { return kv() * d; }
};

/// An output value as the kernels store it: bf16 rounded once (store_pair), or fp32.
float stored(float x, bool bf16_out) {
  return bf16_out ? round_bf16(x) : x;
}

/// flash_forward_mma<D>: out [S][heads·D], lse [heads][S]. Each warp's tc::forward_row_tiles(D)
/// row tiles of 16 are run one after the other (the kernel shares their K and V fragments, which
/// changes no value).
template <int D>
void twin_forward(const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, std::vector<float>& out, std::vector<float>& lse) {
  constexpr int ND = D / 8, NS = tc::kKeyTile / 8, M = tc::forward_row_tiles(D);
  constexpr int kRows = tc::forward_rows(D);
  const I s = p.s;
  const float scale_log2 = 1.0f / std::sqrt(float(D)) * tc::kLog2e;
  for (I bh = 0; bh < p.heads; ++bh) {
    const I kvh = bh / p.group;
    for (I q0 = 0; q0 < s; q0 += kRows) {
      const Tile qt = load_tile(q, q0, kRows, s, p.ldq(), bh * D, D);
      const I tiles = tc::key_tiles(q0, s, p.shift, kRows);
      for (int wt = 0; wt < tc::kWarps * M; ++wt) {  // warp wt / M, its row tile wt % M
        const I row0 = q0 + wt * tc::kWarpRows;
        FragC<ND> o;
        zero(o);
        std::array<std::array<float, 2>, kL> m, l;
        for (auto& x : m) x = {-INFINITY, -INFINITY};
        for (auto& x : l) x = {0.0f, 0.0f};
        Tile kb[2] = {unwritten(tc::kKeyTile, D), unwritten(tc::kKeyTile, D)};
        Tile vb[2] = {kb[0], kb[1]};
        if (tiles > 0) {  // the prologue: tile 0 into buffer 0
          kb[0] = load_tile(k, 0, tc::kKeyTile, s, p.ldkv(), kvh * D, D);
          vb[0] = load_tile(v, 0, tc::kKeyTile, s, p.ldkv(), kvh * D, D);
        }
        for (I t = 0; t < tiles; ++t) {
          const I j0 = t * tc::kKeyTile;
          if (t + 1 < tiles) {  // the next tile into the other buffer, before this one's products
            kb[tc::buffer_of(t + 1)] =
                load_tile(k, j0 + tc::kKeyTile, tc::kKeyTile, s, p.ldkv(), kvh * D, D);
            vb[tc::buffer_of(t + 1)] =
                load_tile(v, j0 + tc::kKeyTile, tc::kKeyTile, s, p.ldkv(), kvh * D, D);
          }
          const Tile& kt = kb[tc::buffer_of(t)];
          const Tile& vt = vb[tc::buffer_of(t)];
          FragC<NS> sc;
          zero(sc);
          mma_abt(sc, qt, wt * tc::kWarpRows, kt, D);
          // The kernel masks every tile after the block's clear ones.
          if (t >= tc::clear_key_tiles(q0, s, p.shift, kRows))
            for (int ln = 0; ln < kL; ++ln) tc::mask(lane_frag(sc, ln), ln, row0, j0, s, p.shift);
          for (int h = 0; h < 2; ++h) {
            std::array<float, kL> mx{};
            for (int ln = 0; ln < kL; ++ln) mx[ln] = tc::lane_row_max(lane_frag(sc, ln), h);
            mx = quad(mx, [](float a, float b) { return std::fmax(a, b); });
            for (int ln = 0; ln < kL; ++ln) {
              float alpha;
              const float offset = tc::online_max(m[ln][h], mx[ln], scale_log2, alpha);
              l[ln][h] = l[ln][h] * alpha + tc::exp_row(lane_frag(sc, ln), h, scale_log2, offset);
              for (int n = 0; n < ND; ++n) o[ln][n][2 * h] *= alpha, o[ln][n][2 * h + 1] *= alpha;
            }
          }
          for (int kk = 0; kk < tc::kKeyTile / 16; ++kk) mma_av(o, a_from_c(sc, kk), vt, kk);
        }
        for (int h = 0; h < 2; ++h) {
          std::array<float, kL> lh{};
          for (int ln = 0; ln < kL; ++ln) lh[ln] = l[ln][h];
          lh = quad(lh, [](float a, float b) { return a + b; });
          for (int ln = 0; ln < kL; ++ln) {
            const I row = row0 + tc::c_row(ln, 2 * h);
            if (row >= s) continue;
            const float f = tc::out_factor(lh[ln]);
            for (int n = 0; n < ND; ++n)
              for (int e = 0; e < 2; ++e)
                out[static_cast<std::size_t>(row * p.ldq() + bh * D + 8 * n + tc::c_col(ln, e))] =
                    stored(o[ln][n][2 * h + e] * f, p.bf16_out);
            if (tc::thread_in_group(ln) == 0)
              lse[static_cast<std::size_t>(bh * s + row)] = tc::row_lse(m[ln][h], lh[ln]);
          }
        }
      }
    }
  }
}

/// Writes (or adds) a warp's accumulators × scale to rows row0.. of x (head offset off), as
/// bf16 or fp32.
template <int ND>
void store(const FragC<ND>& acc, float scale, std::vector<float>& x, I row0, I s, I ld, I off,
           bool accumulate, bool bf16_out) {
  for (int ln = 0; ln < kL; ++ln)
    for (int i = 0; i < 4; ++i) {
      const I row = row0 + tc::c_row(ln, i);
      if (row >= s) continue;
      for (int n = 0; n < ND; ++n) {
        float& dst = x[static_cast<std::size_t>(row * ld + off + 8 * n + tc::c_col(ln, i))];
        dst = stored(accumulate ? dst + acc[ln][n][i] * scale : acc[ln][n][i] * scale, bf16_out);
      }
    }
}

/// One block's share of a query tile's dQ, added at its turn: the query head and tile, the
/// block's turn and ticket, and the tile's 32 rows × D (before the scale), rows past S included
/// (the add skips them).
struct DqShare {
  I head = 0, tile = 0;
  unsigned turn = 0;
  I ticket = 0;
  std::vector<float> v;
};

/// flash_bwd_mma<D>: every block (by ticket, tc::bwd_work) in the kernel's step order, its dK
/// and dV stored (or added) as the kernel stores them; returns each block's dQ shares in the
/// order it adds them, for add_dq_shares() to add as the turns allow.
template <int D>
std::vector<std::vector<DqShare>> twin_bwd(const Problem& p, const std::vector<float>& dout,
                                           const std::vector<float>& q, const std::vector<float>& k,
                                           const std::vector<float>& v,
                                           const std::vector<float>& lse,
                                           const std::vector<float>& delta, std::vector<float>& dk,
                                           std::vector<float>& dv) {
  constexpr int ND = D / 8, NS = tc::kQueryTile / 8, NQ = D / 16;
  constexpr int kRows = tc::bwd_rows(D), kTiles = kRows / tc::kWarpRows;  // row tiles of 16
  const I s = p.s;
  const float scale = 1.0f / std::sqrt(float(D)), scale_log2 = scale * tc::kLog2e;
  const I key_blocks = (s + kRows - 1) / kRows;
  std::vector<std::vector<DqShare>> shares;
  for (I ticket = 0; ticket < p.kv() * key_blocks; ++ticket) {
    const tc::BwdWork work = tc::bwd_work(ticket, p.kv());
    const I kvh = work.kv_head, k0 = work.key_block * kRows;
    const Tile kt = load_tile(k, k0, kRows, s, p.ldkv(), kvh * D, D);
    const Tile vt = load_tile(v, k0, kRows, s, p.ldkv(), kvh * D, D);
    const I first = tc::first_query_tile(k0, p.shift), end = tc::query_tiles_end(s);
    const I total = end > first ? p.group * (end - first) : 0;
    // Each warp's tc::bwd_row_tiles(D) row tiles of 16 keys, run one after the other (the kernel
    // shares their Q and dO fragments, which changes no value): row tile w of the block.
    FragC<ND> dka[kTiles], dva[kTiles];
    for (int w = 0; w < kTiles; ++w) zero(dka[w]), zero(dva[w]);
    // Step it: query tile first + it / group, head kvh·group + it % group (tile-major).
    auto tile_of = [&](I it) { return first + it / p.group; };
    auto head_of = [&](I it) { return kvh * p.group + it % p.group; };
    Tile qb[2] = {unwritten(tc::kQueryTile, D), unwritten(tc::kQueryTile, D)};
    Tile db[2] = {qb[0], qb[1]};
    float lse_s[2][tc::kQueryTile], dl_s[2][tc::kQueryTile];
    auto load_step = [&](I it, int b) {
      const I bh = head_of(it), i0 = tile_of(it) * tc::kQueryTile;
      qb[b] = load_tile(q, i0, tc::kQueryTile, s, p.ldq(), bh * D, D);
      db[b] = load_tile(dout, i0, tc::kQueryTile, s, p.ldq(), bh * D, D);
      for (int t = 0; t < tc::kQueryTile; ++t) {
        const bool in = i0 + t < s;
        lse_s[b][t] = in ? lse[static_cast<std::size_t>(bh * s + i0 + t)] * tc::kLog2e : 0.0f;
        dl_s[b][t] = in ? delta[static_cast<std::size_t>(bh * s + i0 + t)] : 0.0f;
      }
    };
    std::vector<DqShare>& mine = shares.emplace_back();
    if (total > 0) load_step(0, 0);
    for (I it = 0; it < total; ++it) {
      if (it + 1 < total) load_step(it + 1, tc::buffer_of(it + 1));
      const int b = tc::buffer_of(it);
      const I i0 = tile_of(it) * tc::kQueryTile;
      const Tile& qt = qb[b];
      const Tile& dot = db[b];
      Tile dst = unwritten(kRows, tc::kQueryTile);  // dSᵀ, as store_ds writes it
      for (int w = 0; w < kTiles; ++w) {
        const I row0 = k0 + w * tc::kWarpRows;
        FragC<NS> pt, dpt;
        zero(pt);
        zero(dpt);
        mma_abt(pt, kt, w * tc::kWarpRows, qt, D);
        mma_abt(dpt, vt, w * tc::kWarpRows, dot, D);
        const bool masked = !tc::all_visible(i0, tc::kQueryTile, row0, tc::kWarpRows, s, p.shift);
        for (int ln = 0; ln < kL; ++ln)
          if (masked)
            tc::ds_cols<true>(lane_frag(pt, ln), lane_frag(dpt, ln), ln, row0, i0, s, p.shift,
                              scale_log2, lse_s[b], dl_s[b]);
          else
            tc::ds_cols<false>(lane_frag(pt, ln), lane_frag(dpt, ln), ln, row0, i0, s, p.shift,
                               scale_log2, lse_s[b], dl_s[b]);
        for (int kk = 0; kk < tc::kQueryTile / 16; ++kk) {
          mma_av(dva[w], a_from_c(pt, kk), dot, kk);
          mma_av(dka[w], a_from_c(dpt, kk), qt, kk);
        }
        for (int ln = 0; ln < kL; ++ln)
          for (int n = 0; n < NS; ++n)
            for (int h = 0; h < 2; ++h) {
              const int r = w * tc::kWarpRows + tc::c_row(ln, 2 * h), c = 8 * n + tc::c_col(ln, 0);
              for (int e = 0; e < 2; ++e)
                dst.v[static_cast<std::size_t>(r * tc::kQueryTile + c + e)] =
                    round_bf16(dpt[ln][n][2 * h + e]);
            }
      }
      // dQ = dS·K: each warp its quarter, A from dSᵀ by ldmatrix.trans, B from the block's K.
      DqShare share{head_of(it), tile_of(it), tc::dq_turn(work.key_block), ticket,
                    std::vector<float>(static_cast<std::size_t>(tc::kQueryTile * D), NAN)};
      for (int w = 0; w < tc::kWarps; ++w) {
        FragC<NQ> dqa;
        zero(dqa);
        for (int kk = 0; kk < kRows / 16; ++kk) {
          const FragA a = as_a(ldsm_x4(dst, 16 * kk, tc::dq_row(w), true, tc::ldsm_at));
          for (int nb = 0; nb < NQ / 2; ++nb) {
            const Regs r = ldsm_x4(kt, 16 * kk, tc::dq_col(w, D) + 16 * nb, true, tc::ldsm_a);
            mma(dqa, 2 * nb, a, as_b(r, 0));
            mma(dqa, 2 * nb + 1, a, as_b(r, 1));
          }
        }
        for (int ln = 0; ln < kL; ++ln)
          for (int n = 0; n < NQ; ++n)
            for (int e = 0; e < 4; ++e)
              share.v[static_cast<std::size_t>((tc::dq_row(w) + tc::c_row(ln, e)) * D +
                                               tc::dq_col(w, D) + 8 * n + tc::c_col(ln, e))] =
                  dqa[ln][n][e];
      }
      mine.push_back(std::move(share));
    }
    for (int w = 0; w < kTiles; ++w) {
      const I row0 = k0 + w * tc::kWarpRows;
      store(dka[w], scale, dk, row0, s, p.ldkv(), kvh * D, p.accumulate, p.bf16_out);
      store(dva[w], 1.0f, dv, row0, s, p.ldkv(), kvh * D, p.accumulate, p.bf16_out);
    }
  }
  return shares;
}

/// The blocks' dQ adds as the GPU may interleave them: at most `resident` blocks at a time,
/// started in ticket order (a block leaves when its last share is added); at each step one of the
/// resident blocks, picked at random, adds its next share, unless it waits for its turn (the
/// tile's counter below the share's turn). `turns` false adds on arrival instead: what the
/// kernel would do without its counters. Each share adds fma(x, scale, acc) into the fp32
/// accumulator acc ([S][heads·D]) as add_dq does. Returns false when every resident block waits:
/// a deadlock on the GPU.
bool add_dq_shares(const std::vector<std::vector<DqShare>>& blocks, const Problem& p, int resident,
                   std::uint32_t seed, bool turns, std::vector<float>& acc) {
  const I tiles = tc::query_tiles_end(p.s), d = p.d;
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<unsigned> counter(static_cast<std::size_t>(tc::dq_counters(p.heads, p.s)), 0u);
  std::vector<std::size_t> next(blocks.size(), 0);
  std::vector<std::size_t> running;
  std::size_t started = 0;
  std::mt19937 gen(seed);
  for (;;) {
    std::erase_if(running, [&](std::size_t b) { return next[b] == blocks[b].size(); });
    for (; running.size() < static_cast<std::size_t>(resident) && started < blocks.size();
         ++started)
      if (!blocks[started].empty()) running.push_back(started);  // (a block with no step ends)
    if (running.empty()) return true;
    std::vector<std::size_t> ready;
    for (std::size_t b : running) {
      const DqShare& sh = blocks[b][next[b]];
      if (!turns || counter[static_cast<std::size_t>(sh.head * tiles + sh.tile)] == sh.turn)
        ready.push_back(b);
    }
    if (ready.empty()) return false;
    const std::size_t b =
        ready[std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(gen)];
    const DqShare& sh = blocks[b][next[b]++];
    for (I r = 0; r < tc::kQueryTile; ++r) {
      const I row = sh.tile * tc::kQueryTile + r;
      if (row >= p.s) continue;
      for (I c = 0; c < d; ++c) {
        float& x = acc[static_cast<std::size_t>(row * p.ldq() + sh.head * d + c)];
        x = std::fma(sh.v[static_cast<std::size_t>(r * d + c)], scale, x);
      }
    }
    ++counter[static_cast<std::size_t>(sh.head * tiles + sh.tile)];
  }
}

/// dq as the launcher leaves it: the accumulator starts at 0 (a bf16 dq, rounded from it after
/// the kernel) or is the fp32 dq itself (a chunk pair's share added to what is there).
std::vector<float> dq_of(const std::vector<std::vector<DqShare>>& blocks, const Problem& p,
                         const std::vector<float>& dq0, int resident, std::uint32_t seed) {
  std::vector<float> acc = p.accumulate ? dq0 : std::vector<float>(dq0.size(), 0.0f);
  EXPECT_TRUE(add_dq_shares(blocks, p, resident, seed, true, acc))
      << "every resident block waits for a turn: a deadlock";
  if (p.bf16_out)
    for (float& x : acc) x = round_bf16(x);
  return acc;
}

// ---- The reference -----------------------------------------------------------------------------

struct Ref {
  std::vector<double> out, lse, dq, dk, dv;
};
/// Attention in double on the bf16-rounded inputs: key j visible to query i when j <= i + shift;
/// a row that sees no key has output 0 and lse −inf.
Ref reference(const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, const std::vector<float>& dout) {
  const I s = p.s, d = p.d;
  const double scale = 1.0 / std::sqrt(double(d));
  Ref r;
  r.out.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.heads * s), -INFINITY);
  auto Q = [&](const std::vector<float>& x, I i, I h, I c) {
    return double(round_bf16(x[static_cast<std::size_t>(i * p.ldq() + h * d + c)]));
  };
  auto K = [&](const std::vector<float>& x, I j, I h, I c) {
    return double(round_bf16(x[static_cast<std::size_t>(j * p.ldkv() + h / p.group * d + c)]));
  };
  std::vector<double> pr(static_cast<std::size_t>(s)), dp(static_cast<std::size_t>(s));
  for (I h = 0; h < p.heads; ++h)
    for (I i = 0; i < s; ++i) {
      const I n = std::clamp<I>(i + p.shift + 1, 0, s);  // keys 0 .. n − 1
      if (n == 0) continue;
      double mx = -INFINITY;
      for (I j = 0; j < n; ++j) {
        double x = 0.0;
        for (I c = 0; c < d; ++c) x += Q(q, i, h, c) * K(k, j, h, c);
        pr[j] = x * scale;
        mx = std::max(mx, pr[j]);
      }
      double sum = 0.0;
      for (I j = 0; j < n; ++j) sum += (pr[j] = std::exp(pr[j] - mx));
      for (I j = 0; j < n; ++j) pr[j] /= sum;
      r.lse[static_cast<std::size_t>(h * s + i)] = mx + std::log(sum);
      double dsum = 0.0;
      for (I j = 0; j < n; ++j) {
        double x = 0.0;
        for (I c = 0; c < d; ++c) x += Q(dout, i, h, c) * K(v, j, h, c);
        dp[j] = x;
        dsum += pr[j] * x;
      }
      for (I j = 0; j < n; ++j) {
        const double ds = pr[j] * (dp[j] - dsum);
        for (I c = 0; c < d; ++c) {
          const auto qi = static_cast<std::size_t>(i * p.ldq() + h * d + c);
          const auto kj = static_cast<std::size_t>(j * p.ldkv() + h / p.group * d + c);
          r.out[qi] += pr[j] * K(v, j, h, c);
          r.dq[qi] += ds * K(k, j, h, c) * scale;
          r.dk[kj] += ds * Q(q, i, h, c) * scale;
          r.dv[kj] += pr[j] * Q(dout, i, h, c);
        }
      }
    }
  return r;
}

/// max |got − (base + want)| / max(1, max |want|).
double rel_error(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<float>& base) {
  double err = 0.0, size = 1.0;
  for (std::size_t e = 0; e < got.size(); ++e) {
    const double b = base.empty() ? 0.0 : base[e];
    if (!std::isfinite(got[e])) return INFINITY;  // (std::max would pass a NaN over)
    err = std::max(err, std::abs(double(got[e]) - (b + want[e])));
    size = std::max(size, std::abs(want[e]));
  }
  return err / size;
}

std::vector<float> randoms(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = dist(gen);
  return x;
}

/// shift 0; S/2 + 1; −S/3 − 1 (some rows see no key); 46, where a tile is one key short of
/// needing no mask (46 = 64 − 16 − 2: the last key of tile 0 is one past what row 16 sees); and
/// the two pairs stage 08 runs under --dtype bf16, fp32 outputs added into: its diagonal pair
/// (shift 0, the causal mask) and a key chunk wholly in the past (shift S: every key visible).
enum class Pair { causal, later_keys, earlier_keys, boundary, diagonal, past };

using Param = std::tuple<I, int, I, Pair>;  // S, D, group, pair

class FlashTcTwin : public testing::TestWithParam<Param> {};

/// A problem's bf16 inputs (rounded once, as stored), the twin's forward (out, lse), Δ as
/// flash_delta_kernel computes it, and the gradients a chunk pair adds its share to.
struct Case {
  std::vector<float> q, k, v, dout, out, lse, delta, dq0, dk0, dv0;
};
template <int D>
Case prepare(const Problem& p) {
  const I s = p.s;
  const auto nq = static_cast<std::size_t>(s * p.ldq()),
             nk = static_cast<std::size_t>(s * p.ldkv());
  const std::uint32_t seed = static_cast<std::uint32_t>(s * 1000 + D + p.group * 7);
  auto bf16 = [](std::vector<float> x) {
    for (float& e : x) e = round_bf16(e);
    return x;
  };
  Case c;
  c.q = bf16(randoms(nq, seed)), c.k = bf16(randoms(nk, seed + 1));
  c.v = bf16(randoms(nk, seed + 2)), c.dout = bf16(randoms(nq, seed + 3));
  c.out.assign(nq, 0.0f);
  c.lse.assign(static_cast<std::size_t>(p.heads * s), 0.0f);
  twin_forward<D>(p, c.q, c.k, c.v, c.out, c.lse);
  // Δ: dO as the products read it, O as the forward stored it (bf16 for the causal attention).
  c.delta.assign(c.lse.size(), 0.0f);
  for (I h = 0; h < p.heads; ++h)
    for (I i = 0; i < s; ++i) {
      float sum = 0.0f;
      for (I col = 0; col < D; ++col) {
        const auto e = static_cast<std::size_t>(i * p.ldq() + h * D + col);
        sum += tpx::cuda::flash::delta_term<true>(c.dout[e], c.out[e]);
      }
      c.delta[static_cast<std::size_t>(h * s + i)] = sum;
    }
  // A chunk pair adds its share to what earlier pairs left in the gradients.
  c.dq0 = p.accumulate ? randoms(nq, seed + 4) : std::vector<float>(nq);
  c.dk0 = p.accumulate ? randoms(nk, seed + 5) : std::vector<float>(nk);
  c.dv0 = p.accumulate ? randoms(nk, seed + 6) : std::vector<float>(nk);
  return c;
}

template <int D>
void run(const Problem& p) {
  const Case c = prepare<D>(p);
  const Ref ref = reference(p, c.q, c.k, c.v, c.dout);
  const double e_out = rel_error(c.out, ref.out, {});
  EXPECT_LT(e_out, 1e-2) << "out";
  for (std::size_t e = 0; e < c.lse.size(); ++e) {
    if (std::isinf(ref.lse[e])) {
      EXPECT_EQ(c.lse[e], -INFINITY) << "lse of a row that sees no key, " << e;
    } else {
      ASSERT_NEAR(c.lse[e], ref.lse[e], 1e-4 * std::max(1.0, std::abs(ref.lse[e]))) << "lse " << e;
    }
  }
  std::vector<float> dk = c.dk0, dv = c.dv0;
  const auto shares = twin_bwd<D>(p, c.dout, c.q, c.k, c.v, c.lse, c.delta, dk, dv);
  const std::vector<float> dq = dq_of(shares, p, c.dq0, 3, 1);
  const double e_dq = rel_error(dq, ref.dq, c.dq0), e_dk = rel_error(dk, ref.dk, c.dk0),
               e_dv = rel_error(dv, ref.dv, c.dv0);
  EXPECT_LT(e_dq, 2e-2) << "dq";
  EXPECT_LT(e_dk, 2e-2) << "dk";
  EXPECT_LT(e_dv, 2e-2) << "dv";
  std::printf("relative error: out %.2e dq %.2e dk %.2e dv %.2e\n", e_out, e_dq, e_dk, e_dv);
}

TEST_P(FlashTcTwin, MatchesDoubleReference) {
  const auto [s, d, group, pair] = GetParam();
  Problem p{s, d, group * (group == 1 ? 2 : 1), group, 0, false};
  if (pair == Pair::later_keys) p = {s, d, p.heads, group, s / 2 + 1, true};
  if (pair == Pair::earlier_keys) p = {s, d, p.heads, group, -(s / 3) - 1, true};
  if (pair == Pair::boundary) p = {s, d, p.heads, group, 46, true};
  if (pair == Pair::diagonal) p = {s, d, p.heads, group, 0, true};
  if (pair == Pair::past) p = {s, d, p.heads, group, s, true};
  p.bf16_out = !p.accumulate;  // the causal attention's outputs are bf16, a pair's fp32
  if (d == 32)
    run<32>(p);
  else if (d == 64)
    run<64>(p);
  else
    run<128>(p);
}

std::string name_of(const testing::TestParamInfo<Param>& param) {
  const char* names[] = {"causal", "shifted", "earlier", "boundary", "diagonal", "past"};
  std::ostringstream os;
  os << "S" << std::get<0>(param.param) << "_D" << std::get<1>(param.param) << "_G"
     << std::get<2>(param.param) << "_" << names[static_cast<int>(std::get<3>(param.param))];
  return os.str();
}

INSTANTIATE_TEST_SUITE_P(Sizes, FlashTcTwin,
                         testing::Combine(testing::Values<I>(1, 15, 16, 17, 63, 64, 65, 200),
                                          testing::Values(64, 128), testing::Values<I>(1, 4),
                                          testing::Values(Pair::causal, Pair::later_keys,
                                                          Pair::earlier_keys, Pair::boundary,
                                                          Pair::diagonal, Pair::past)),
                         name_of);

// D = 32, where the forward and the backward both give a warp 32 rows (two row tiles).
INSTANTIATE_TEST_SUITE_P(HeadDim32, FlashTcTwin,
                         testing::Combine(testing::Values<I>(1, 65, 200, 300), testing::Values(32),
                                          testing::Values<I>(1, 4),
                                          testing::Values(Pair::causal, Pair::later_keys,
                                                          Pair::earlier_keys, Pair::boundary)),
                         name_of);

/// The ldmatrix addresses deliver the fragment layouts: an A block read with tc::ldsm_a puts
/// element (a_row, a_col) of every lane's a_i where the mma reads it; a [n][k] block read with
/// tc::ldsm_b and a [k][n] block read with .trans and tc::ldsm_a give B's (b_row, b_col).
TEST(FlashTcTwinFragments, LdmatrixDeliversTheMmaLayouts) {
  Tile t{16, 16, std::vector<float>(256)};
  for (int e = 0; e < 256; ++e)
    t.v[static_cast<std::size_t>(e)] = float(e);  // value = 16·row + col
  const FragA a = as_a(ldsm_x4(t, 0, 0, false, tc::ldsm_a));
  const Regs rb = ldsm_x4(t, 0, 0, false, tc::ldsm_b);  // t as [n][k]
  const Regs rbt = ldsm_x4(t, 0, 0, true, tc::ldsm_a);  // t as [k][n]
  for (int l = 0; l < kL; ++l) {
    for (int i = 0; i < 8; ++i) EXPECT_EQ(a[l][i], float(16 * tc::a_row(l, i) + tc::a_col(l, i)));
    for (int h = 0; h < 2; ++h) {
      const FragB b = as_b(rb, h), bt = as_b(rbt, h);
      for (int i = 0; i < 4; ++i) {
        const int kr = tc::b_row(l, i), n = 8 * h + tc::b_col(l, i);
        EXPECT_EQ(b[l][i], float(16 * n + kr)) << "lane " << l << " b" << i;
        EXPECT_EQ(bt[l][i], float(16 * kr + n)) << "lane " << l << " b" << i << " (.trans)";
      }
    }
  }
}

/// The C-to-A reuse: the A fragment built from two C fragments holds, at every (a_row, a_col),
/// the element the C fragments hold at that position.
TEST(FlashTcTwinFragments, AccumulatorBecomesOperandInPlace) {
  FragC<2> c{};
  for (int l = 0; l < kL; ++l)
    for (int n = 0; n < 2; ++n)
      for (int i = 0; i < 4; ++i)
        c[l][n][i] = float(16 * tc::c_row(l, i) + 8 * n + tc::c_col(l, i));
  const FragA a = a_from_c(c, 0);
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 8; ++i) EXPECT_EQ(a[l][i], float(16 * tc::a_row(l, i) + tc::a_col(l, i)));
}

/// The cp.async copies of every tile the kernels load: the block's threads, u rounds of one
/// 16-byte chunk each, write every element of the tile exactly once; and consecutive tiles of a
/// loop go to different buffers.
TEST(FlashTcTwinFragments, TileCopiesWriteEveryElementOnce) {
  for (int d : {32, 64, 128})
    for (int rows :
         {tc::kBlockRows, tc::kKeyTile, tc::kQueryTile, tc::forward_rows(d), tc::bwd_rows(d)}) {
      const int chunks = rows * tc::row_chunks(d);
      ASSERT_EQ(chunks % tc::kThreads, 0) << "rows " << rows << " D " << d;
      std::vector<int> writes(static_cast<std::size_t>(rows * d), 0);
      for (int u = 0; u < chunks / tc::kThreads; ++u)
        for (int th = 0; th < tc::kThreads; ++th) {
          const int e = th + tc::kThreads * u;
          const int r = tc::chunk_row(e, d), c = tc::chunk_col(e, d);
          ASSERT_TRUE(r < rows && c % 8 == 0 && c + 8 <= d) << "chunk " << e;
          for (int x = c; x < c + 8; ++x) ++writes[static_cast<std::size_t>(r * d + x)];
        }
      for (std::size_t e = 0; e < writes.size(); ++e)
        EXPECT_EQ(writes[e], 1) << "rows " << rows << " D " << d << " element " << e;
    }
  for (I t = 0; t < 5; ++t) EXPECT_NE(tc::buffer_of(t), tc::buffer_of(t + 1)) << t;
}

/// The loops' bounds against the visibility rule, by brute force.
TEST(FlashTcTwinFragments, TileBoundsCoverExactlyTheVisibleKeys) {
  for (I s : {1, 15, 64, 65, 200})
    for (I shift : {I(-70), I(-5), I(0), I(3), I(64), I(300)}) {
      for (I rows : {I(tc::forward_rows(128)), I(tc::forward_rows(64))})
        for (I q0 = 0; q0 < s; q0 += rows) {
          I last = -1;  // the last key any row of the block sees
          for (I i = q0; i < std::min(s, q0 + rows); ++i)
            for (I j = 0; j < s; ++j)
              if (tc::visible(i, j, s, shift)) last = std::max(last, j);
          EXPECT_EQ(tc::key_tiles(q0, s, shift, rows), (last + tc::kKeyTile) / tc::kKeyTile)
              << "S " << s << " shift " << shift << " q0 " << q0 << " rows " << rows;
        }
      for (I k0 = 0; k0 < s; k0 += tc::kBlockRows) {
        I first = s;  // the first query that sees a key of the block
        for (I i = 0; i < s; ++i)
          for (I j = k0; j < std::min(s, k0 + tc::kBlockRows); ++j)
            if (tc::visible(i, j, s, shift)) first = std::min(first, i);
        if (first < s) {
          EXPECT_LE(tc::first_query_tile(k0, shift) * tc::kQueryTile, first)
              << "S " << s << " shift " << shift << " k0 " << k0;
        }
      }
    }
}

// The tiles the forward runs without a mask are exactly the leading ones that every row of
// the block sees whole: for each, no (row, key) is hidden, and the first masked tile (if any
// tile is left) hides one.
TEST(FlashTcTwinFragments, ClearTilesAreTheLeadingWholeVisibleOnes) {
  for (I s : {1, 63, 64, 65, 128, 200, 256})
    for (I shift : {I(-70), I(-5), I(0), I(3), I(63), I(64), I(300)})
      for (I rows : {I(tc::forward_rows(128)), I(tc::forward_rows(64))})
        for (I q0 = 0; q0 < s; q0 += rows) {
          const I tiles = tc::key_tiles(q0, s, shift, rows),
                  clear = tc::clear_key_tiles(q0, s, shift, rows);
          ASSERT_LE(clear, tiles) << "S " << s << " shift " << shift << " q0 " << q0;
          auto whole = [&](I t) {
            for (I i = q0; i < q0 + rows; ++i)
              for (I j = t * tc::kKeyTile; j < (t + 1) * tc::kKeyTile; ++j)
                if (!tc::visible(i, j, s, shift)) return false;
            return true;
          };
          for (I t = 0; t < clear; ++t)
            EXPECT_TRUE(whole(t)) << "S " << s << " shift " << shift << " q0 " << q0 << " t " << t;
          if (clear < tiles) {
            EXPECT_FALSE(whole(clear)) << "S " << s << " shift " << shift << " q0 " << q0;
          }
        }
}

// The kernels' 32-bit per-tile mask says what visible() says for every element of a tile,
// at offsets far from the diagonal and S's end too (where the clamp matters).
TEST(FlashTcTwinFragments, TileMaskAgreesWithVisible) {
  for (I s : {I(1), I(70), I(200), I(1) << 40})
    for (I shift : {I(-300), I(-70), I(-5), I(0), I(3), I(64), I(300), I(1) << 41})
      for (I row0 : {I(0), I(16), I(64), I(128), I(190), s - 1, s + 5})
        for (I col0 : {I(0), I(32), I(64), I(150), s - 20, s + 100}) {
          const tc::TileMask tile(row0, col0, s, shift);
          for (int i = 0; i < 64; ++i)
            for (int j = 0; j < 64; ++j)
              ASSERT_EQ(tile.sees(i, j), tc::visible(row0 + i, col0 + j, s, shift))
                  << "S " << s << " shift " << shift << " row0 " << row0 << " col0 " << col0
                  << " i " << i << " j " << j;
        }
}

// ---- dQ's fixed order -------------------------------------------------------------------------

/// dQ's adds in the kernel's order give the same bits however the blocks interleave (one to
/// five resident at a time, any pick among those ready), for the causal attention (bf16 dq
/// rounded from the accumulator) and a chunk pair (added into an fp32 dq). Without the turns
/// (adds on arrival) the bits do depend on the interleaving: the check can fail. (Two adds onto
/// zero commute, so a tile needs three key blocks' shares for the order to show.)
TEST(FlashTcTwinOrder, DqIsTheSameBitsWhateverTheInterleaving) {
  for (const bool pair : {false, true}) {
    Problem p{450, 64, 4, 2, pair ? 70 : 0, pair};  // 4 key blocks of 128: up to 4 adds a tile
    p.bf16_out = !pair;
    const Case c = prepare<64>(p);
    std::vector<float> dk = c.dk0, dv = c.dv0;
    const auto shares = twin_bwd<64>(p, c.dout, c.q, c.k, c.v, c.lse, c.delta, dk, dv);
    const std::vector<float> first = dq_of(shares, p, c.dq0, 1, 0);
    for (int resident : {1, 2, 5})
      for (std::uint32_t seed = 1; seed <= 4; ++seed)
        EXPECT_EQ(dq_of(shares, p, c.dq0, resident, seed), first)
            << (pair ? "pair" : "causal") << ": resident " << resident << ", seed " << seed;
    // The control, on the fp32 accumulators (a bf16 dq rounds most last-bit differences away).
    auto accumulated = [&](std::uint32_t seed, bool turns) {
      std::vector<float> acc = pair ? c.dq0 : std::vector<float>(c.dq0.size(), 0.0f);
      EXPECT_TRUE(add_dq_shares(shares, p, 5, seed, turns, acc));
      return acc;
    };
    const std::vector<float> in_turn = accumulated(1, true);
    bool differs = false;
    for (std::uint32_t seed = 1; seed <= 8 && !differs; ++seed)
      differs = accumulated(seed, false) != in_turn;
    EXPECT_TRUE(differs) << (pair ? "pair" : "causal")
                         << ": adds on arrival gave the turns' bits under every interleaving";
  }
}

/// The turns follow the tickets: with one block resident at a time, each started when the one
/// before it has finished (in ticket order), no block ever waits; so on the GPU a block waits only
/// for blocks that started before it, and the blocks cannot deadlock. Each (head, tile) counter
/// reaches the number of key blocks that visit the tile, each of them once.
TEST(FlashTcTwinOrder, ABlockWaitsOnlyForBlocksStartedBeforeIt) {
  for (I shift : {I(0), I(-40), I(70), I(400)})
    for (I group : {I(1), I(2)}) {
      Problem p{200, 64, 4, group, shift, shift != 0};
      p.bf16_out = shift == 0;
      const Case c = prepare<64>(p);
      std::vector<float> dk = c.dk0, dv = c.dv0;
      const auto shares = twin_bwd<64>(p, c.dout, c.q, c.k, c.v, c.lse, c.delta, dk, dv);
      std::vector<float> acc(c.dq0.size(), 0.0f);
      EXPECT_TRUE(add_dq_shares(shares, p, 1, 0, true, acc)) << "shift " << shift;
      std::vector<std::vector<unsigned>> turns(
          static_cast<std::size_t>(tc::dq_counters(p.heads, p.s)));
      for (const auto& block : shares)
        for (const DqShare& sh : block) {
          ASSERT_EQ(sh.head / group, tc::bwd_work(sh.ticket, p.kv()).kv_head);
          turns[static_cast<std::size_t>(sh.head * tc::query_tiles_end(p.s) + sh.tile)].push_back(
              sh.turn);
        }
      for (std::size_t t = 0; t < turns.size(); ++t)
        for (std::size_t j = 0; j < turns[t].size(); ++j)
          ASSERT_EQ(turns[t][j], j) << "shift " << shift << " counter " << t;
    }
}

/// ldmatrix.trans with tc::ldsm_at reads the A fragment of a matrix stored transposed ([k][m]).
TEST(FlashTcTwinFragments, LdmatrixTransDeliversATransposedA) {
  Tile t{16, 16, std::vector<float>(256)};
  for (int e = 0; e < 256; ++e) t.v[static_cast<std::size_t>(e)] = float(e);  // 16·k + m
  const FragA a = as_a(ldsm_x4(t, 0, 0, true, tc::ldsm_at));
  for (int l = 0; l < kL; ++l)
    for (int i = 0; i < 8; ++i)
      EXPECT_EQ(a[l][i], float(16 * tc::a_col(l, i) + tc::a_row(l, i)))
          << "lane " << l << " a" << i;
}

}  // namespace
