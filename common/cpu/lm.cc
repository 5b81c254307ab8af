// The CPU backend's language-model ops: the embedding lookup and its scatter-add, and the
// vocabulary-parallel cross-entropy's passes (common/ops.h says what each computes). Plain loops
// in fp32 (sums of exponentials and the loss in double where a row's sum could lose digits).
//
// defines: tpx::cpu::embedding_forward, embedding_backward, cross_entropy_partial,
//          cross_entropy_rescale, cross_entropy_loss, cross_entropy_backward

#include <cmath>
#include <cstdint>
#include <limits>

#include "ops.h"

namespace tpx::cpu {

namespace {

/// The local column of vocabulary id `id`, or −1 when this rank does not hold it.
std::int64_t local_column(std::int32_t id, std::int64_t begin, std::int64_t cols) {
  const std::int64_t j = std::int64_t(id) - begin;
  return j >= 0 && j < cols ? j : -1;
}

/// The real (unpadded) columns of a shard starting at vocabulary id `begin`.
std::int64_t real_columns(std::int64_t begin, std::int64_t cols, std::int64_t vocab) {
  return std::max<std::int64_t>(0, std::min(cols, vocab - begin));
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out) {
  const std::int32_t* id = ids.data<std::int32_t>();
  const float* e = table.data<float>();
  float* y = out.data<float>();
  const std::int64_t n = ids.numel(), h = table.dim(1), rows = table.dim(0);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t j = local_column(id[t], begin, rows);
    float* yt = y + t * h;
    if (j < 0)
      std::fill(yt, yt + h, 0.0f);
    else
      std::copy(e + j * h, e + (j + 1) * h, yt);
  }
}

void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable) {
  const std::int32_t* id = ids.data<std::int32_t>();
  const float* dy = dout.data<float>();
  float* de = dtable.data<float>();
  const std::int64_t n = ids.numel(), h = dtable.dim(1), rows = dtable.dim(0);
  for (std::int64_t t = 0; t < n; ++t) {  // position order: each row's sum is deterministic
    const std::int64_t j = local_column(id[t], begin, rows);
    if (j < 0) continue;
    for (std::int64_t i = 0; i < h; ++i) de[j * h + i] += dy[t * h + i];
  }
}

void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit) {
  const float* z = logits.data<float>();
  const std::int32_t* t = targets.data<std::int32_t>();
  float *pm = max.data<float>(), *ps = sumexp.data<float>(), *pt = target_logit.data<float>();
  const std::int64_t n = targets.numel(), cols = logits.cols();
  const std::int64_t real = real_columns(begin, cols, vocab);
  for (std::int64_t r = 0; r < n; ++r) {
    const float* zr = z + r * cols;
    // One pass: the running maximum, and the sum of exponentials rescaled whenever it moves
    // (the online softmax of FlashAttention, here over the vocabulary). The exponentials are
    // fp32, their sum double: an fp32 running sum over a row of 64k columns would drift by ~1e-4.
    float m = -std::numeric_limits<float>::infinity();
    double s = 0.0;
    for (std::int64_t j = 0; j < real; ++j) {
      if (zr[j] > m) {
        s = s * double(std::exp(m - zr[j]));
        m = zr[j];
      }
      s += double(std::exp(zr[j] - m));
    }
    pm[r] = m;
    ps[r] = static_cast<float>(s);
    const std::int64_t j = local_column(t[r], begin, real);
    pt[r] = j < 0 ? 0.0f : zr[j];
  }
}

void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp) {
  const float *lm = local_max.data<float>(), *m = max.data<float>();
  float* s = sumexp.data<float>();
  for (std::int64_t r = 0; r < sumexp.numel(); ++r)
    s[r] = std::isinf(lm[r]) && lm[r] < 0 ? 0.0f : s[r] * std::exp(lm[r] - m[r]);
}

double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse) {
  const float *m = max.data<float>(), *s = sumexp.data<float>(), *t = target_logit.data<float>();
  float* l = lse.data<float>();
  double sum = 0.0;
  for (std::int64_t r = 0; r < lse.numel(); ++r) {
    l[r] = m[r] + std::log(s[r]);
    sum += double(l[r]) - double(t[r]);
  }
  return sum;
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits) {
  const float *z = logits.data<float>(), *l = lse.data<float>();
  const std::int32_t* t = targets.data<std::int32_t>();
  float* dz = dlogits.data<float>();
  const std::int64_t n = targets.numel(), cols = logits.cols();
  const std::int64_t real = real_columns(begin, cols, vocab);
  const auto sc = static_cast<float>(scale);
  for (std::int64_t r = 0; r < n; ++r) {
    const float *zr = z + r * cols, lr = l[r];
    float* dr = dz + r * cols;
    for (std::int64_t j = 0; j < real; ++j) dr[j] = sc * std::exp(zr[j] - lr);
    for (std::int64_t j = real; j < cols; ++j) dr[j] = 0.0f;
    if (const std::int64_t j = local_column(t[r], begin, real); j >= 0) dr[j] -= sc;
  }
}

}  // namespace tpx::cpu
