// The cpu backend's mixture-of-experts ops (tpx::ops::moe_route and its neighbours, which check
// the arguments): a token or a row at a time, the per-token math shared with the CUDA kernels
// (moe_token.h).
#include <cstdint>

#include "../check.h"
#include "../moe_token.h"
#include "ops.h"

namespace tpx::cpu {
namespace {
using I = std::int64_t;
}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight) {
  const I n = logits.dim(0), E = logits.dim(1), k = expert.dim(1);
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  for (I t = 0; t < n; ++t)
    moe_token::route(logits.data<float>() + t * E, b, E, k, sigmoid, score.data<float>() + t * E,
                     expert.data<std::int32_t>() + t * k, weight.data<float>() + t * k);
}

void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out) {
  const I R = index.dim(0), H = x.dim(1), T = x.dim(0);
  for (I i = 0; i < R; ++i) {
    const I from = index.data<std::int32_t>()[i];
    TPX_CHECK(from >= 0 && from < T, "gather_rows: index {} of {} rows", from, T);
    const float a = scale.defined() ? scale.data<float>()[i] : 1.0f;
    const float* src = x.data<float>() + from * H;
    float* dst = out.data<float>() + i * H;
    for (I h = 0; h < H; ++h) dst[h] = scale.defined() ? a * src[h] : src[h];
  }
}

void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate) {
  const I n = slot.dim(0), k = slot.dim(1), H = out.dim(1), R = rows.dim(0);
  for (I t = 0; t < n; ++t) {
    float* y = out.data<float>() + t * H;
    if (!accumulate)
      for (I h = 0; h < H; ++h) y[h] = 0.0f;
    for (I j = 0; j < k; ++j) {
      const I r = slot.data<std::int32_t>()[t * k + j];
      if (r < 0) continue;
      TPX_CHECK(r < R, "combine_rows: slot {} of {} rows", r, R);
      const float* src = rows.data<float>() + r * H;
      if (weight.defined()) {
        const float w = weight.data<float>()[t * k + j];
        for (I h = 0; h < H; ++h) y[h] += w * src[h];
      } else {
        for (I h = 0; h < H; ++h) y[h] += src[h];
      }
    }
  }
}

void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out) {
  const I n = slot.dim(0), k = slot.dim(1), H = a.dim(1), R = rows.dim(0);
  for (I t = 0; t < n; ++t)
    for (I j = 0; j < k; ++j) {
      const I r = slot.data<std::int32_t>()[t * k + j];
      float d = 0.0f;
      if (r >= 0) {
        TPX_CHECK(r < R, "rows_dot: slot {} of {} rows", r, R);
        const float* x = a.data<float>() + t * H;
        const float* y = rows.data<float>() + r * H;
        for (I h = 0; h < H; ++h) d += x[h] * y[h];
      }
      out.data<float>()[t * k + j] = d;
    }
}

void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz) {
  const I n = score.dim(0), E = score.dim(1), k = expert.dim(1);
  const float* p = dP.defined() ? dP.data<float>() : nullptr;
  for (I t = 0; t < n; ++t)
    moe_token::router_dz(score.data<float>() + t * E, expert.data<std::int32_t>() + t * k,
                         weight.data<float>() + t * k, dweight.data<float>() + t * k, p, E, k,
                         sigmoid, tokens_all, dz.data<float>() + t * E);
}

}  // namespace tpx::cpu
