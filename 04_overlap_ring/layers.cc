#include "04_overlap_ring/layers.h"

#include <array>
#include <vector>

#include <fmt/format.h>

#include "common/ops.h"

namespace tpx::ring {

std::unique_ptr<ChunkTransport> send_recv_ring(const RunContext& ctx, TpGroup& group) {
  return std::make_unique<P2PTransport>(group.communicator(), ctx.options.config.device,
                                        group.trace());
}

OverlapRing::OverlapRing(const RunContext& ctx, const MakeTransport& make)
    : SequenceParallel(ctx),
      ring_{.transport = group_.adopt_transport(make(ctx, group_)),
            .trace = group_.trace(),
            .compute = high_precision(ctx.options.config.dtype),
            .activations = ctx.options.config.activations()} {}

std::string OverlapRing::comm_name() const {
  return group_.name() + ", " + ring_.transport.name();
}

// --- column-parallel: the input is gathered chunk by chunk ---------------------------------------

ColumnResult OverlapRing::column_forward(const Tensor& h, std::span<const Tensor> w,
                                         std::string_view role) {
  // h is this rank's [S/N, B, H]; each output [S, B, out/N] fills a chunk of rows per ring step.
  ColumnResult r;
  r.saved = h;  // as in stage 03: backward gathers h again instead of keeping [S, B, H]
  for (const Tensor& wi : w) {
    auto shape = h.shape();
    shape[0] *= group_.world();
    shape.back() = wi.dim(1);
    // h may be FP8 (stage 06): the outputs are activations, in the activations' dtype
    r.y.push_back(Tensor::empty(shape, ring_.activations, h.device()));
  }
  all_gather_gemm(ring_, h, w, /*trans_w=*/false, r.y, role);
  return r;
}

Tensor OverlapRing::column_backward(const Tensor& saved, std::span<const Tensor> w,
                                    std::span<const Tensor> dy, std::span<const Tensor> dw,
                                    std::string_view role) {
  // The re-gather of h and the dX ring share the comm lane step by step: one re-gather transfer
  // is queued now, and one more after each dX transfer. The dX GEMMs need no gathered input, so
  // they start at once and cover both rings' transfers. The dW GEMMs need all of h: they run
  // after the dX ring's last GEMM, while its last transfer is in flight.
  const auto h = ring_.transport.gather(ring_, saved, fmt::format("{} re-gather", role),
                                        /*queued=*/1);
  const AlongTheRing along{
      .gather = h.get(), .before_last_wait = [&] {
        h->wait_all();
        weight_grads([this, full = h->full(), dy = std::vector(dy.begin(), dy.end()),
                      dw = std::vector(dw.begin(), dw.end()),
                      name = fmt::format("{} dW GEMMs", role)] {
          TraceScope span(ring_.trace, name);
          for (std::size_t j = 0; j < dy.size(); ++j)  // dW = AG(h)ᵀ·dy
            ops::gemm(full, true, dy[j], false, dw[j], 1.0f, 0.0f, ring_.compute);
        });
      }};
  return gemm_reduce_scatter(ring_, dy, w, /*trans_w=*/true, fmt::format("{} dX", role), along);
}

// --- row-parallel: the partial sums are reduced around the ring ----------------------------------

Tensor OverlapRing::row_forward(const Tensor& a, const Tensor& w, std::string_view role) {
  const std::array a1{a}, w1{w};
  return gemm_reduce_scatter(ring_, a1, w1, /*trans_w=*/false, role);  // [S/N, B, H]
}

Tensor OverlapRing::row_backward(const Tensor& a, const Tensor& w, const Tensor& dy,
                                 const Tensor& dw, std::string_view role) {
  Tensor da = Tensor::empty(a.shape(), ring_.activations, a.device());  // a may be FP8
  const std::array w1{w}, da1{da};
  const Tensor d = all_gather_gemm(ring_, dy, w1, /*trans_w=*/true, da1,
                                   fmt::format("{} bwd", role));  // da = AG(dy)·Wᵀ
  weight_grads([this, a, d, dw, name = fmt::format("{} dW GEMM", role)] {
    TraceScope span(ring_.trace, name);
    ops::gemm(a, true, d, false, dw, 1.0f, 0.0f, ring_.compute);  // dW = aᵀ·AG(dy)
  });
  return da;
}

void OverlapRing::weight_grads(std::function<void()> gemm) {
  if (deferred_)
    deferred_->defer(std::move(gemm));
  else
    gemm();
}

std::unique_ptr<Parallelism> make_overlap_ring(const RunContext& ctx) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/true);
  return std::make_unique<OverlapRing>(ctx);
}

}  // namespace tpx::ring
