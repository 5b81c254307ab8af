// Fused causal attention on the CPU (FlashAttention-2: Dao 2023, arXiv:2307.08691, Algorithms 1
// and 2). Per (batch, head), the S×S score matrix is never formed: query rows and keys go in
// blocks of kBlock, each block product is one CBLAS GEMM on the [S, D] matrices read in place
// (row stride B·heads·D), and the softmax is computed online.
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
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../check.h"
#include "ops.h"

namespace tpx::cpu {
namespace {

using I = std::int64_t;

/// Query rows and keys per block. Big enough that each block product is a real GEMM for
/// OpenBLAS, small enough that the block's scores (kBlock² floats, 64 KiB) stay in L2.
constexpr I kBlock = 128;

struct FusedDims {
  I s, b, heads, d, ld;  // ld = B·heads·D, the row stride of one sequence position
};

FusedDims fused_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads, const Tensor& out,
                     const Tensor& lse) {
  TPX_CHECK(
      q.ndim() == 3 && q.shape() == k.shape() && q.shape() == v.shape() && q.shape() == out.shape(),
      "fused attention q, k, v, out must be equal [S, B, X]: {} {} {} {}", q.describe(),
      k.describe(), v.describe(), out.describe());
  for (const Tensor* t : {&q, &k, &v, &out, &lse})
    TPX_CHECK(t->dtype() == DType::f32 && t->device() == Device::cpu,
              "fused attention tensors must be f32 on cpu, got {}", t->describe());
  const I s = q.dim(0), b = q.dim(1), x = q.dim(2);
  TPX_CHECK(heads > 0 && x % heads == 0, "{} columns do not split into {} heads", x, heads);
  TPX_CHECK(lse.numel() == b * heads * s, "lse {} must hold [B, heads, S] = [{}, {}, {}]",
            lse.describe(), b, heads, s);
  TPX_CHECK(b * x <= std::numeric_limits<int>::max() && s <= std::numeric_limits<int>::max(),
            "fused attention sizes too large for CBLAS: {}", q.describe());
  return {s, b, heads, x / heads, b * x};
}

int to_int(I v) {
  return static_cast<int>(v);  // fused_dims checked every size passed to CBLAS
}

/// Zeroes the [S, D] matrix of one head (row stride ld).
void zero_head(float* p, I s, I d, I ld) {
  for (I i = 0; i < s; ++i) std::fill(p + i * ld, p + i * ld + d, 0.0f);
}

}  // namespace

void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                             const Tensor& out, const Tensor& lse) {
  const auto [s, b, nh, d, ld] = fused_dims(q, k, v, heads, out, lse);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> sc(static_cast<std::size_t>(kBlock * kBlock));  // scores, then P
  std::vector<float> m(static_cast<std::size_t>(kBlock)), l(m.size());
  for (I bi = 0; bi < b; ++bi) {
    for (I h = 0; h < nh; ++h) {
      const I off = (bi * nh + h) * d;
      const float *qh = q.data<float>() + off, *kh = k.data<float>() + off,
                  *vh = v.data<float>() + off;
      float* oh = out.data<float>() + off;
      float* lh = lse.data<float>() + (bi * nh + h) * s;
      zero_head(oh, s, d, ld);
      for (I i0 = 0; i0 < s; i0 += kBlock) {
        const I nr = std::min(kBlock, s - i0);
        std::fill(m.begin(), m.end(), -inf);
        std::fill(l.begin(), l.end(), 0.0f);
        // Key blocks j0 <= i0: the last one is the diagonal block; none lies above it.
        for (I j0 = 0; j0 <= i0; j0 += kBlock) {
          const I nc = std::min(kBlock, s - j0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      scale, qh + i0 * ld, to_int(ld), kh + j0 * ld, to_int(ld), 0.0f, sc.data(),
                      to_int(nc));
          for (I r = 0; r < nr; ++r) {
            float* row = sc.data() + r * nc;
            const I n = std::min(nc, i0 + r - j0 + 1);  // keys j <= i; at least key j0
            const float m_new = std::max(m[r], *std::max_element(row, row + n));
            const float alpha = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
            float sum = 0.0f;
            for (I c = 0; c < n; ++c) sum += (row[c] = std::exp(row[c] - m_new));
            std::fill(row + n, row + nc, 0.0f);  // masked: probability 0
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
            float* orow = oh + (i0 + r) * ld;
            for (I c = 0; c < d; ++c) orow[c] *= alpha;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(nr), to_int(d), to_int(nc),
                      1.0f, sc.data(), to_int(nc), vh + j0 * ld, to_int(ld), 1.0f, oh + i0 * ld,
                      to_int(ld));
        }
        for (I r = 0; r < nr; ++r) {
          const float inv = 1.0f / l[r];
          float* orow = oh + (i0 + r) * ld;
          for (I c = 0; c < d; ++c) orow[c] *= inv;
          lh[i0 + r] = m[r] + std::log(l[r]);
        }
      }
    }
  }
}

void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv) {
  const auto [s, b, nh, d, ld] = fused_dims(q, k, v, heads, out, lse);
  for (const Tensor* t : {&dout, &dq, &dk, &dv})
    TPX_CHECK(t->shape() == q.shape() && t->dtype() == DType::f32 && t->device() == Device::cpu,
              "fused attention backward: {} must be f32 on cpu like q {}", t->describe(),
              q.describe());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(static_cast<std::size_t>(kBlock * kBlock)), dp(p.size());
  std::vector<float> delta(static_cast<std::size_t>(s));
  for (I bi = 0; bi < b; ++bi) {
    for (I h = 0; h < nh; ++h) {
      const I off = (bi * nh + h) * d;
      const float *qh = q.data<float>() + off, *kh = k.data<float>() + off,
                  *vh = v.data<float>() + off, *oh = out.data<float>() + off,
                  *doh = dout.data<float>() + off;
      const float* lh = lse.data<float>() + (bi * nh + h) * s;
      float *dqh = dq.data<float>() + off, *dkh = dk.data<float>() + off,
            *dvh = dv.data<float>() + off;
      for (I i = 0; i < s; ++i) {  // Δ_i = rowsum(dO_i ∘ O_i)
        float acc = 0.0f;
        for (I c = 0; c < d; ++c) acc += doh[i * ld + c] * oh[i * ld + c];
        delta[static_cast<std::size_t>(i)] = acc;
      }
      zero_head(dqh, s, d, ld);
      zero_head(dkh, s, d, ld);
      zero_head(dvh, s, d, ld);
      for (I j0 = 0; j0 < s; j0 += kBlock) {
        const I nc = std::min(kBlock, s - j0);
        // Query blocks i0 >= j0: the first one is the diagonal block.
        for (I i0 = j0; i0 < s; i0 += kBlock) {
          const I nr = std::min(kBlock, s - i0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      scale, qh + i0 * ld, to_int(ld), kh + j0 * ld, to_int(ld), 0.0f, p.data(),
                      to_int(nc));
          for (I r = 0; r < nr; ++r) {
            float* row = p.data() + r * nc;
            const I n = std::min(nc, i0 + r - j0 + 1);
            const float lse_i = lh[i0 + r];
            for (I c = 0; c < n; ++c) row[c] = std::exp(row[c] - lse_i);
            std::fill(row + n, row + nc, 0.0f);
          }
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(nc), to_int(d), to_int(nr),
                      1.0f, p.data(), to_int(nc), doh + i0 * ld, to_int(ld), 1.0f, dvh + j0 * ld,
                      to_int(ld));
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nr), to_int(nc), to_int(d),
                      1.0f, doh + i0 * ld, to_int(ld), vh + j0 * ld, to_int(ld), 0.0f, dp.data(),
                      to_int(nc));
          for (I r = 0; r < nr; ++r) {
            const float dl = delta[static_cast<std::size_t>(i0 + r)];
            const float* prow = p.data() + r * nc;
            float* row = dp.data() + r * nc;
            for (I c = 0; c < nc; ++c) row[c] = prow[c] * (row[c] - dl);  // masked: P = 0
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(nr), to_int(d), to_int(nc),
                      scale, dp.data(), to_int(nc), kh + j0 * ld, to_int(ld), 1.0f, dqh + i0 * ld,
                      to_int(ld));
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(nc), to_int(d), to_int(nr),
                      scale, dp.data(), to_int(nc), qh + i0 * ld, to_int(ld), 1.0f, dkh + j0 * ld,
                      to_int(ld));
        }
      }
    }
  }
}

}  // namespace tpx::cpu
