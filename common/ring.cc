#include "ring.h"

#include <fmt/format.h>

#include "check.h"
#include "ops.h"

namespace tpx {
namespace {

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

/// The step label both lanes use: the transfer "role AG step 2/4" runs beside "role GEMM step 2/4".
std::string step_name(std::string_view role, std::string_view what, int step, int world) {
  return fmt::format("{} {} step {}/{}", role, what, step + 1, world);
}

}  // namespace

// --- the point-to-point transport ----------------------------------------------------------------

P2PTransport::P2PTransport(Communicator& comm, Device device, Trace& trace)
    : comm_(comm), trace_(trace), stream_(Stream::create(device)) {}

P2PTransport::~P2PTransport() {
  try {
    stream_.synchronize();  // its tasks reference comm_ and trace_
  } catch (...) {           // a failed transfer was reported where it was waited on
  }
}

Event P2PTransport::shift(const Tensor& send, const Tensor& recv, const Event& after,
                          const std::string& what) {
  const int n = comm_.size(), r = comm_.rank();
  after.wait(stream_);
  record_stream(send, stream_);  // cuda: the blocks stay reserved until the comm lane is done
  record_stream(recv, stream_);
  // The task owns copies of the tensor handles: on the cpu they keep the memory alive until the
  // transfer has run on the comm thread.
  stream_.run([this, send, recv, what, next = mod(r + 1, n), prev = mod(r - 1, n)] {
    TraceScope span(trace_, what, Lane::comm);
    comm_.sendrecv(send, next, recv, prev, stream_, what);
  });
  Event done(send.device());
  done.record(stream_);
  return done;
}

// --- the all-gather ------------------------------------------------------------------------------

Tensor RingGather::chunk(int c) const {
  const std::int64_t n = full.dim(0) / world;
  return full.slice0(c * n, (c + 1) * n);
}

void RingGather::wait_chunk(int c) const {
  if (c == rank) return;
  const Stream compute(full.device());
  arrived[static_cast<std::size_t>(mod(rank - c - 1, world))].wait(compute);
}

void RingGather::wait_all() const {
  const Stream compute(full.device());
  for (const Event& e : arrived) e.wait(compute);
}

RingGather start_all_gather(const RingContext& ctx, const Tensor& x_local, std::string_view role) {
  const int n = ctx.transport.world(), r = ctx.transport.rank();
  auto shape = x_local.shape();
  shape[0] *= n;
  RingGather g{.full = Tensor::empty(shape, x_local.dtype(), x_local.device()),
               .rank = r,
               .world = n,
               .arrived = {}};
  const Stream compute(x_local.device());
  {
    TraceScope span(ctx.trace, fmt::format("{} copy own chunk", role));
    ops::copy(x_local, g.chunk(r));
  }
  Event own(x_local.device());
  own.record(compute);
  // Step i passes on the chunk that arrived in step i − 1 (own chunk at i = 0); the comm lane runs
  // its steps in order, so only the first needs to wait for the compute lane.
  for (int i = 0; i + 1 < n; ++i)
    g.arrived.push_back(ctx.transport.shift(g.chunk(mod(r - i, n)), g.chunk(mod(r - i - 1, n)), own,
                                            step_name(role, "AG", i, n)));
  return g;
}

Tensor all_gather_gemm(const RingContext& ctx, const Tensor& x_local, std::span<const Tensor> w,
                       bool trans_w, std::span<const Tensor> out, std::string_view role) {
  TPX_CHECK(w.size() == out.size() && !w.empty(), "all_gather_gemm: {} weights, {} outputs",
            w.size(), out.size());
  const int n = ctx.transport.world(), r = ctx.transport.rank();
  const RingGather g = start_all_gather(ctx, x_local, role);
  const std::int64_t rows = x_local.dim(0);
  for (int i = 0; i < n; ++i) {
    const int c = mod(r - i, n);  // own chunk first, then the one that arrived in step i − 1
    g.wait_chunk(c);
    TraceScope span(ctx.trace, step_name(role, "GEMM", i, n));
    const Tensor x = g.chunk(c);
    for (std::size_t j = 0; j < w.size(); ++j)
      ops::gemm(x, false, w[j], trans_w, out[j].slice0(c * rows, (c + 1) * rows), 1.0f, 0.0f,
                ctx.compute);
  }
  return g.full;
}

// --- the reduce-scatter --------------------------------------------------------------------------

Tensor gemm_reduce_scatter(const RingContext& ctx, std::span<const Tensor> a,
                           std::span<const Tensor> w, bool trans_w, std::string_view role,
                           const std::function<void()>& before_last_wait) {
  TPX_CHECK(a.size() == w.size() && !a.empty(), "gemm_reduce_scatter: {} inputs, {} weights",
            a.size(), w.size());
  const int n = ctx.transport.world(), r = ctx.transport.rank();
  TPX_CHECK(a[0].dim(0) % n == 0, "gemm_reduce_scatter: {} rows over {} ranks", a[0].dim(0), n);
  const std::int64_t rows = a[0].dim(0) / n;
  auto shape = a[0].shape();
  shape[0] = rows;
  shape.back() = trans_w ? w[0].dim(0) : w[0].dim(1);
  const Device dev = a[0].device();
  const Stream compute(dev);

  // Double buffers: the partial sum of step i is sent while step i + 1's GEMM writes the other
  // one; the running sum from r − 1 arrives in recv[i % 2] while step i + 1 reads recv[(i−1) % 2].
  const int nbuf = n > 1 ? 2 : 1;
  std::vector<Tensor> part, recv;
  for (int b = 0; b < nbuf; ++b) {
    part.push_back(Tensor::empty(shape, DType::f32, dev));
    if (n > 1) recv.push_back(Tensor::empty(shape, DType::f32, dev));
  }
  std::vector<Event> arrived;  // arrived[i]: step i's transfer is done (sent and received)
  for (int i = 0; i < n; ++i) {
    const int c = mod(r - i - 1, n);  // at i = N − 1 this is r: the sum completes at its owner
    const Tensor& p = part[static_cast<std::size_t>(i % nbuf)];
    if (i >= 2) arrived[static_cast<std::size_t>(i - 2)].wait(compute);  // p has been sent
    {
      TraceScope span(ctx.trace, step_name(role, "GEMM", i, n));
      for (std::size_t j = 0; j < a.size(); ++j)
        ops::gemm(a[j].slice0(c * rows, (c + 1) * rows), false, w[j], trans_w, p, 1.0f,
                  j == 0 ? 0.0f : 1.0f, ctx.compute);
    }
    if (i == n - 1 && before_last_wait) before_last_wait();
    if (i > 0) {
      arrived[static_cast<std::size_t>(i - 1)].wait(compute);
      TraceScope span(ctx.trace, step_name(role, "add", i, n));
      ops::accumulate(recv[static_cast<std::size_t>((i - 1) % 2)], p);
    }
    if (i + 1 < n) {
      Event ready(dev);
      ready.record(compute);
      arrived.push_back(ctx.transport.shift(p, recv[static_cast<std::size_t>(i % 2)], ready,
                                            step_name(role, "RS", i, n)));
    }
  }
  return part[static_cast<std::size_t>((n - 1) % nbuf)];
}

}  // namespace tpx
