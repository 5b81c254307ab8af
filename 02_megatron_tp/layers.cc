#include "02_megatron_tp/layers.h"

#include <fmt/format.h>

#include "common/ops.h"

namespace tpx::megatron {
// --- f and g -------------------------------------------------------------------------------------

Tensor AllReduceConjugates::f_backward(const Tensor& dh_partial) {
  group_.all_reduce(dh_partial, "f bwd: all-reduce");
  return dh_partial;
}

Tensor AllReduceConjugates::g_forward(const Tensor& y_partial) {
  group_.all_reduce(y_partial, "g fwd: all-reduce");
  return y_partial;
}

// --- the linear layers ---------------------------------------------------------------------------

ColumnResult ColumnParallelLinear::forward(const Tensor& h, std::span<const Tensor> w,
                                           std::string_view role) {
  ColumnResult r;
  r.saved = h;
  const Tensor x = fg_.f_forward(h);
  for (const Tensor& wi : w) {
    r.y.push_back(linear_output(x, wi));
    // y = f(h)·W: this rank's columns of the output, complete.
    TraceScope span(trace_, fmt::format("{} GEMM", role));
    ops::gemm(x, false, wi, false, r.y.back(), 1.0f, 0.0f, compute_);
  }
  return r;
}

Tensor ColumnParallelLinear::backward(const Tensor& h, std::span<const Tensor> w,
                                      std::span<const Tensor> dy, std::span<const Tensor> dw,
                                      std::string_view role) {
  const Tensor x = fg_.f_regather(h);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  for (std::size_t i = 0; i < w.size(); ++i) {
    TraceScope span(trace_, fmt::format("{} dW, dX GEMMs", role));
    // dW = f(h)ᵀ·dy: this rank's columns of the gradient, complete.
    ops::gemm(x, true, dy[i], false, dw[i], 1.0f, 0.0f, compute_);
    // dx += dy·Wᵀ: this rank's heads' (or F-columns') share of the input gradient, a partial sum.
    ops::gemm(dy[i], false, w[i], true, dx, 1.0f, i == 0 ? 0.0f : 1.0f, compute_);
  }
  return fg_.f_backward(dx);
}

Tensor RowParallelLinear::forward(const Tensor& a, const Tensor& w, std::string_view role) {
  Tensor y = linear_output(a, w);
  {
    TraceScope span(trace_, fmt::format("{} GEMM", role));
    // This rank's rows of W times its columns of a: a partial sum of the whole output.
    ops::gemm(a, false, w, false, y, 1.0f, 0.0f, compute_);
  }
  return fg_.g_forward(y);
}

Tensor RowParallelLinear::backward(const Tensor& a, const Tensor& w, const Tensor& dy,
                                   const Tensor& dw, std::string_view role) {
  const Tensor d = fg_.g_backward(dy);
  Tensor da = Tensor::empty(a.shape(), a.dtype(), a.device());
  TraceScope span(trace_, fmt::format("{} dW, dA GEMMs", role));
  ops::gemm(a, true, d, false, dw, 1.0f, 0.0f, compute_);  // dW = aᵀ·dy: this rank's rows
  ops::gemm(d, false, w, true, da, 1.0f, 0.0f, compute_);  // da = dy·Wᵀ: this rank's columns of a
  return da;
}

// --- the stage -----------------------------------------------------------------------------------

Sharding MegatronParallel::sharding() const {
  return {.rank = group_.rank(), .world = group_.world(), .weights = true, .sequence = false};
}

std::unique_ptr<Parallelism> make_megatron(const RunContext& ctx) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/false);
  return std::make_unique<MegatronParallel>(ctx);
}

}  // namespace tpx::megatron
