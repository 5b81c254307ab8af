// Device dispatch: the only place that routes an op to a backend.
#include "ops.h"

#include <cstring>

#include "check.h"
#include "cpu/ops.h"
#if TPX_WITH_CUDA
#include "cuda/ops.h"
#endif

namespace tpx::ops {
namespace {

[[noreturn]] void no_cuda() {
  fail("this build has no CUDA backend (configure with a CUDA compiler or -DTPX_CUDA=ON)");
}

}  // namespace

std::string device_problem(Device device) {
  if (device == Device::cpu) return {};
#if TPX_WITH_CUDA
  return cuda::device_problem();
#else
  return "--device cuda: this build has no CUDA backend (configure where nvcc is found)";
#endif
}

// Routes fn to the backend of `device`. Without CUDA, a cuda tensor fails with a clear message
// (the comma expression keeps the cpu call's return type for the compiler; it never runs).
#if TPX_WITH_CUDA
#define TPX_DISPATCH(device, fn, ...)                                     \
  if ((device) == Device::cuda) return ::tpx::cuda::fn(__VA_ARGS__); \
  return ::tpx::cpu::fn(__VA_ARGS__)
#else
#define TPX_DISPATCH(device, fn, ...)                                          \
  if ((device) == Device::cuda) return (no_cuda(), ::tpx::cpu::fn(__VA_ARGS__)); \
  return ::tpx::cpu::fn(__VA_ARGS__)
#endif

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta) {
  TPX_DISPATCH(c.device(), gemm, a, trans_a, b, trans_b, c, alpha, beta);
}
void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd) {
  TPX_DISPATCH(x.device(), rmsnorm_forward, x, g, y, rstd);
}
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg) {
  TPX_DISPATCH(x.device(), rmsnorm_backward, dy, x, g, rstd, dx, dg);
}
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& probs) {
  TPX_DISPATCH(q.device(), attention_forward, q, k, v, heads, out, probs);
}
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, std::int64_t heads, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv) {
  TPX_DISPATCH(q.device(), attention_backward, dout, q, k, v, probs, heads, dq, dk, dv);
}
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  TPX_DISPATCH(gate.device(), swiglu_forward, gate, up, out);
}
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup) {
  TPX_DISPATCH(gate.device(), swiglu_backward, dout, gate, up, dgate, dup);
}
void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  TPX_DISPATCH(out.device(), add, a, b, out);
}
void accumulate(const Tensor& x, const Tensor& into) {
  TPX_DISPATCH(into.device(), accumulate, x, into);
}
double mse_loss_sum(const Tensor& y, const Tensor& t) {
  TPX_DISPATCH(y.device(), mse_loss_sum, y, t);
}
void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy) {
  TPX_DISPATCH(y.device(), mse_loss_backward, y, t, scale, dy);
}
void sgd_update(const Tensor& w, const Tensor& grad, float lr) {
  TPX_DISPATCH(w.device(), sgd_update, w, grad, lr);
}
double sum_squares(const Tensor& x) { TPX_DISPATCH(x.device(), sum_squares, x); }
void fill(const Tensor& t, float value) { TPX_DISPATCH(t.device(), fill, t, value); }

void copy(const Tensor& src, const Tensor& dst) {
  TPX_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype(), "copy {} -> {}",
            src.describe(), dst.describe());
  if (src.device() == Device::cpu && dst.device() == Device::cpu) {
    std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
#if TPX_WITH_CUDA
  cuda::copy(src, dst);
#else
  no_cuda();
#endif
}

Tensor to_device(const Tensor& t, Device device) {
#if TPX_WITH_CUDA
  if (device == Device::cpu && t.dtype() != DType::f32) return cuda::to_host_f32(t);
#endif
  Tensor out = Tensor::empty(t.shape(), t.dtype(), device);
  copy(t, out);
  return out;
}

#undef TPX_DISPATCH

}  // namespace tpx::ops
