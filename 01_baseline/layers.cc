#include "01_baseline/layers.h"

#include "common/ops.h"
#include "common/trainer.h"

namespace tpx::baseline {
ColumnResult SerialLinears::column_forward(const Tensor& h, std::span<const Tensor> w,
                                           std::string_view /*role*/) {
  ColumnResult r;
  r.saved = h;
  for (const Tensor& wi : w) {
    r.y.push_back(linear_output(h, wi));
    ops::gemm(h, false, wi, false, r.y.back(), 1.0f, 0.0f, compute_);  // y = h·W
  }
  return r;
}

Tensor SerialLinears::column_backward(const Tensor& h, std::span<const Tensor> w,
                                      std::span<const Tensor> dy, std::span<const Tensor> dw,
                                      std::string_view /*role*/) {
  Tensor dh = Tensor::empty(h.shape(), h.dtype(), h.device());
  for (std::size_t i = 0; i < w.size(); ++i) {
    ops::gemm(h, true, dy[i], false, dw[i], 1.0f, 0.0f, compute_);                  // dW = hᵀ·dy
    ops::gemm(dy[i], false, w[i], true, dh, 1.0f, i == 0 ? 0.0f : 1.0f, compute_);  // dh += dy·Wᵀ
  }
  return dh;
}

Tensor SerialLinears::row_forward(const Tensor& a, const Tensor& w, std::string_view /*role*/) {
  Tensor y = linear_output(a, w);
  ops::gemm(a, false, w, false, y, 1.0f, 0.0f, compute_);
  return y;
}

Tensor SerialLinears::row_backward(const Tensor& a, const Tensor& w, const Tensor& dy,
                                   const Tensor& dw, std::string_view /*role*/) {
  Tensor da = Tensor::empty(a.shape(), a.dtype(), a.device());
  ops::gemm(a, true, dy, false, dw, 1.0f, 0.0f, compute_);
  ops::gemm(dy, false, w, true, da, 1.0f, 0.0f, compute_);
  return da;
}

ReferenceRun run_reference(const BlockConfig& c, int steps) {
  BlockConfig one = c;
  one.steps = steps;
  SerialLinears serial(c.dtype);
  Trace off;
  return to_reference(train(one, serial, /*snapshot=*/true, off));
}

}  // namespace tpx::baseline
