// Fused causal attention on the CPU (FlashAttention-2: Dao 2023, arXiv:2307.08691, Algorithms 1
// and 2). Per (batch, query head), the S×S score matrix is never formed: query rows and keys go
// in blocks of kBlock, each block product is one CBLAS GEMM on the [S, D] matrices read in place
// (row stride ldq = B·heads·D for q, out, dout, dq; ldkv = B·kv_heads·D for k, v, dk, dv), and
// the softmax is computed online.
//
// Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): query head h reads KV head
// h / (heads / kv_heads). Forward only indexes K and V that way. Backward visits the query heads
// of a group one after another (they are consecutive): the group's first head zeroes the KV
// head's dK and dV, and every head of the group accumulates into them, in head order, so the
// result is the same from run to run. With kv_heads = heads every KV head has a group of one.
//
// Forward, for a block of query rows i and each key block j at or left of the diagonal:
//   S_ij = Q_i K_jᵀ / sqrt(D)               (masked to -inf where key > query)
//   m'   = max(m, rowmax(S_ij))             (running row maximum)
//   P    = exp(S_ij − m')                   (unnormalised probabilities)
//   l    = l·exp(m − m') + rowsum(P)        (running row sum, rescaled to the new maximum)
//   O_i  = O_i·exp(m − m') + P V_j
// and at the end O_i /= l, lse_i = m + log(l): the only statistic backward needs.
//
// Backward, for each key block j and the query blocks i at or below the diagonal, with
// Δ_i = rowsum(dO_i ∘ O_i) computed once:
//   P = exp(Q_i K_jᵀ / sqrt(D) − lse_i)      (the forward's probabilities, recomputed exactly)
//   dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − Δ_i)
//   dQ_i += dS K_j / sqrt(D);  dK_j += dSᵀ Q_i / sqrt(D)
// Blocks strictly above the diagonal (every key after every query of the block) are skipped.
//
// Context parallelism (stage 08) runs the same two loops on one pair of sequence chunks at a
// time: queries against a K/V chunk whose global positions are `shift` rows earlier (key j is
// visible to query i when j <= i + shift: shift 0 is a diagonal chunk, shift >= S a chunk wholly
// in the past). A query row that sees no key of the pair gets output 0 and lse = -inf, so that
// attention_merge() ignores it; backward accumulates into dq, dk, dv instead of overwriting, as
// the chunk pairs of one query chunk (or one K/V chunk) add up.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../check.h"
#include "../ops.h"
#include "ops.h"

namespace tpx::cpu {
namespace {

using I = std::int64_t;

/// Query rows and keys per block. Big enough that each block product is a real GEMM for
/// OpenBLAS, small enough that the block's scores (kBlock² floats, 64 KiB) stay in L2.
constexpr I kBlock = 128;

using FusedDims = ops::AttentionDims;

FusedDims fused_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads, const Tensor& out,
                     const Tensor& lse) {
  const FusedDims z = ops::attention_dims(q, k, v, heads, "fused attention");
  TPX_CHECK(q.shape() == out.shape(), "fused attention out {} must be q's shape {}", out.describe(),
            q.describe());
  for (const Tensor* t : {&q, &k, &v, &out, &lse})
    TPX_CHECK(t->dtype() == DType::f32 && t->device() == Device::cpu,
              "fused attention tensors must be f32 on cpu, got {}", t->describe());
  TPX_CHECK(lse.numel() == z.b * heads * z.s, "lse {} must hold [B, heads, S] = [{}, {}, {}]",
            lse.describe(), z.b, heads, z.s);
  TPX_CHECK(z.ldq <= std::numeric_limits<int>::max() && z.s <= std::numeric_limits<int>::max(),
            "fused attention sizes too large for CBLAS: {}", q.describe());
  return z;
}

int to_int(I v) {
  return static_cast<int>(v);  // fused_dims checked every size passed to CBLAS
}

/// Zeroes the [S, D] matrix of one head (row stride ld).
void zero_head(float* p, I s, I d, I ld) {
  for (I i = 0; i < s; ++i) std::fill(p + i * ld, p + i * ld + d, 0.0f);
}

}  // namespace

namespace {

/// Keys of a block visible to query row i: j0 .. j0 + n − 1, n clamped to [0, nc].
I visible(I i, I shift, I j0, I nc) {
  return std::clamp<I>(i + shift - j0 + 1, 0, nc);
}

void fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads, const Tensor& out,
                   const Tensor& lse, I shift) {
  const FusedDims z = fused_dims(q, k, v, heads, out, lse);
  const I s = z.s, nh = z.heads, d = z.d, ldq = z.ldq, ldkv = z.ldkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> sc(static_cast<std::size_t>(kBlock * kBlock));  // scores, then P
  std::vector<float> m(static_cast<std::size_t>(kBlock)), l(m.size());
  for (I bi = 0; bi < z.b; ++bi) {
    for (I h = 0; h < nh; ++h) {
      const I off = (bi * nh + h) * d;                         // q, out
      const I kv_off = (bi * z.kv_heads + h / z.group()) * d;  // k, v: the group's KV head
      const float *qh = q.data<float>() + off, *kh = k.data<float>() + kv_off,
                  *vh = v.data<float>() + kv_off;
      float* oh = out.data<float>() + off;
      float* lh = lse.data<float>() + (bi * nh + h) * s;
      zero_head(oh, s, d, ldq);
      for (I i0 = 0; i0 < s; i0 += kBlock) {
        const I nr = std::min(kBlock, s - i0);
        std::fill(m.begin(), m.end(), -inf);
        std::fill(l.begin(), l.end(), 0.0f);
        // Key blocks with a key visible to the block's last query: for shift 0, j0 <= i0, the
        // last one being the diagonal block; none lies above it.
        for (I j0 = 0; j0 < s && j0 <= i0 + nr - 1 + shift; j0 += kBlock) {
          const I nc = std::min(kBlock, s - j0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      scale, qh + i0 * ldq, to_int(ldq), kh + j0 * ldkv, to_int(ldkv), 0.0f,
                      sc.data(), to_int(nc));
          for (I r = 0; r < nr; ++r) {
            float* row = sc.data() + r * nc;
            const I n = visible(i0 + r, shift, j0, nc);  // keys j <= i + shift
            if (n == 0) {  // nothing visible in this block: the row's state stays as it is
              std::fill(row, row + nc, 0.0f);
              continue;
            }
            const float m_new = std::max(m[r], *std::max_element(row, row + n));
            const float alpha = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
            float sum = 0.0f;
            for (I c = 0; c < n; ++c) sum += (row[c] = std::exp(row[c] - m_new));
            std::fill(row + n, row + nc, 0.0f);  // masked: probability 0
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
            float* orow = oh + (i0 + r) * ldq;
            for (I c = 0; c < d; ++c) orow[c] *= alpha;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(nr), to_int(d), to_int(nc),
                      1.0f, sc.data(), to_int(nc), vh + j0 * ldkv, to_int(ldkv), 1.0f,
                      oh + i0 * ldq, to_int(ldq));
        }
        for (I r = 0; r < nr; ++r) {
          const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // 0: the row saw no key
          float* orow = oh + (i0 + r) * ldq;
          for (I c = 0; c < d; ++c) orow[c] *= inv;
          lh[i0 + r] = l[r] > 0.0f ? m[r] + std::log(l[r]) : -inf;
        }
      }
    }
  }
}

void fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv, I shift, bool accumulate) {
  const FusedDims z = fused_dims(q, k, v, heads, out, lse);
  const I s = z.s, nh = z.heads, d = z.d, ldq = z.ldq, ldkv = z.ldkv;
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) {
    const Tensor& like = t == &dk || t == &dv ? k : q;
    TPX_CHECK(t->shape() == like.shape() && t->dtype() == DType::f32 && t->device() == Device::cpu,
              "fused attention backward: {} must be f32 on cpu shaped like {}", t->describe(),
              like.describe());
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(static_cast<std::size_t>(kBlock * kBlock)), dp(p.size());
  std::vector<float> delta(static_cast<std::size_t>(s));
  for (I bi = 0; bi < z.b; ++bi) {
    // Query head h of the group of KV head h / group: the group's heads are consecutive, so
    // its KV head's dK and dV are zeroed at its first head and accumulate the whole group.
    for (I h = 0; h < nh; ++h) {
      const I off = (bi * nh + h) * d;
      const I kv_off = (bi * z.kv_heads + h / z.group()) * d;
      const float *qh = q.data<float>() + off, *kh = k.data<float>() + kv_off,
                  *vh = v.data<float>() + kv_off, *oh = out.data<float>() + off,
                  *doh = dout.data<float>() + off;
      const float* lh = lse.data<float>() + (bi * nh + h) * s;
      float *dqh = dq.data<float>() + off, *dkh = dk.data<float>() + kv_off,
            *dvh = dv.data<float>() + kv_off;
      for (I i = 0; i < s; ++i) {  // Δ_i = rowsum(dO_i ∘ O_i)
        float acc = 0.0f;
        for (I c = 0; c < d; ++c) acc += doh[i * ldq + c] * oh[i * ldq + c];
        delta[static_cast<std::size_t>(i)] = acc;
      }
      if (!accumulate) zero_head(dqh, s, d, ldq);
      if (!accumulate && h % z.group() == 0) {
        zero_head(dkh, s, d, ldkv);
        zero_head(dvh, s, d, ldkv);
      }
      for (I j0 = 0; j0 < s; j0 += kBlock) {
        const I nc = std::min(kBlock, s - j0);
        // Query blocks that see a key of the block: for shift 0, i0 >= j0, the first one being
        // the diagonal block.
        for (I i0 = 0; i0 < s; i0 += kBlock) {
          const I nr = std::min(kBlock, s - i0);
          if (i0 + nr - 1 + shift < j0) continue;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      scale, qh + i0 * ldq, to_int(ldq), kh + j0 * ldkv, to_int(ldkv), 0.0f,
                      p.data(), to_int(nc));
          for (I r = 0; r < nr; ++r) {
            float* row = p.data() + r * nc;
            const I n = visible(i0 + r, shift, j0, nc);
            const float lse_i = lh[i0 + r];
            for (I c = 0; c < n; ++c) row[c] = std::exp(row[c] - lse_i);
            std::fill(row + n, row + nc, 0.0f);
          }
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(nc), to_int(d), to_int(nr),
                      1.0f, p.data(), to_int(nc), doh + i0 * ldq, to_int(ldq), 1.0f,
                      dvh + j0 * ldkv, to_int(ldkv));
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      1.0f, doh + i0 * ldq, to_int(ldq), vh + j0 * ldkv, to_int(ldkv), 0.0f,
                      dp.data(), to_int(nc));
          for (I r = 0; r < nr; ++r) {
            const float dl = delta[static_cast<std::size_t>(i0 + r)];
            const float* prow = p.data() + r * nc;
            float* row = dp.data() + r * nc;
            for (I c = 0; c < nc; ++c) row[c] = prow[c] * (row[c] - dl);  // masked: P = 0
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(nr), to_int(d), to_int(nc),
                      scale, dp.data(), to_int(nc), kh + j0 * ldkv, to_int(ldkv), 1.0f,
                      dqh + i0 * ldq, to_int(ldq));
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(nc), to_int(d), to_int(nr),
                      scale, dp.data(), to_int(nc), qh + i0 * ldq, to_int(ldq), 1.0f,
                      dkh + j0 * ldkv, to_int(ldkv));
        }
      }
    }
  }
}

}  // namespace

void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                             const Tensor& out, const Tensor& lse) {
  fused_forward(q, k, v, heads, out, lse, 0);
}

void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv) {
  fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, 0, false);
}

void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                             const Tensor& out, const Tensor& lse, I shift) {
  fused_forward(q, k, v, heads, out, lse, shift);
}

void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, I shift) {
  fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, shift, true);
}

// The log-sum-exp merge of two attentions of the same queries over disjoint key sets: with
// m = max(lse, lse'), the weights e^(lse − m) and e^(lse' − m) are each part's share of the
// softmax denominator, so out = (w·out + w'·out') / (w + w') and lse = m + log(w + w').
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, I heads) {
  for (const Tensor* t : {&out, &lse, &part_out, &part_lse})
    TPX_CHECK(t->dtype() == DType::f32 && t->device() == Device::cpu,
              "attention merge tensors must be f32 on cpu, got {}", t->describe());
  const FusedDims z = ops::attention_merge_dims(out, lse, part_out, part_lse, heads);
  const I s = z.s, b = z.b, d = z.d;
  const float inf = std::numeric_limits<float>::infinity();
  float *o = out.data<float>(), *l = lse.data<float>();
  const float *po = part_out.data<float>(), *pl = part_lse.data<float>();
  for (I bi = 0; bi < b; ++bi)
    for (I h = 0; h < heads; ++h)
      for (I i = 0; i < s; ++i) {
        const I li = (bi * heads + h) * s + i;  // lse [B, heads, S]
        const float l1 = l[li], l2 = pl[li];
        if (l2 == -inf) continue;  // the part saw no key: nothing to add
        const float m = std::max(l1, l2);
        const float w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);  // w1 = 0 when l1 = -inf
        const float inv = 1.0f / (w1 + w2);
        float* orow = o + (i * b + bi) * heads * d + h * d;
        const float* prow = po + (i * b + bi) * heads * d + h * d;
        for (I c = 0; c < d; ++c) orow[c] = (w1 * orow[c] + w2 * prow[c]) * inv;
        l[li] = m + std::log(w1 + w2);
      }
}

}  // namespace tpx::cpu
