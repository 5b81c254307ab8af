#include "ring.h"

#include <fmt/format.h>

#include "check.h"
#include "ops.h"

namespace tpx {
namespace {

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

/// The step label both lanes use, e.g. "qkv AG step 2/4" (see ring.h for what runs beside what).
std::string step_name(std::string_view role, std::string_view what, int step, int world) {
  return fmt::format("{} {} step {}/{}", role, what, step + 1, world);
}

/// [N·n, ...] for a chunk [n, ...].
Tensor::Shape gathered_shape(const Tensor& x_local, int world) {
  auto shape = x_local.shape();
  shape[0] *= world;
  return shape;
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
  // Booked now, in the program's order; run when the comm lane gets to it.
  const std::uint64_t booked = comm_.book(CommOp::sendrecv, what);
  stream_.run([this, send, recv, what, booked, next = mod(r + 1, n), prev = mod(r - 1, n)] {
    TraceScope span(trace_, what, Lane::comm);
    comm_.sendrecv(send, next, recv, prev, stream_, what, booked);
  });
  Event done(send.device());
  done.record(stream_);
  return done;
}

// --- what every transport's gather shares --------------------------------------------------------

ChunkGather::ChunkGather(const RingContext& ctx, const Tensor& x_local, std::string_view role)
    : ChunkGather(ctx, x_local, role,
                  Tensor::empty(gathered_shape(x_local, ctx.transport.world()), x_local.dtype(),
                                x_local.device())) {}

ChunkGather::ChunkGather(const RingContext& ctx, const Tensor& x_local, std::string_view role,
                         Tensor full)
    : full_(std::move(full)),
      rank_(ctx.transport.rank()),
      world_(ctx.transport.world()),
      role_(role),
      own_(x_local.device()) {
  TPX_CHECK(full_.shape() == gathered_shape(x_local, world_) && full_.dtype() == x_local.dtype(),
            "{}: gathering {} into {}", role_, x_local.describe(), full_.describe());
  // An FP8 chunk's scale was agreed by every rank (stage 06): the gathered tensor shares it.
  if (x_local.scale().defined()) full_ = full_.with_scale(x_local.scale());
  {
    TraceScope span(ctx.trace, fmt::format("{} copy own chunk", role));
    ops::copy(x_local, chunk(rank_));
  }
  own_.record(Stream(x_local.device()));
}

Tensor ChunkGather::chunk(int c) const {
  const std::int64_t n = full_.dim(0) / world_;
  return full_.slice0(c * n, (c + 1) * n);
}

void ChunkGather::wait_all() {
  while (advance()) {
  }
  for (int i = 0; i < world_; ++i) wait_chunk(chunk_at(i));
}

// --- the ring all-gather -------------------------------------------------------------------------

namespace {

class RingGather final : public ChunkGather {
 public:
  RingGather(const RingContext& ctx, P2PTransport& transport, const Tensor& x_local,
             std::string_view role, int queued)
      : ChunkGather(ctx, x_local, role), transport_(transport) {
    for (int i = 0; (queued < 0 || i < queued) && advance(); ++i) {
    }
  }

  int chunk_at(int i) const override { return mod(rank_ - i, world_); }

  bool advance() override {
    const int i = static_cast<int>(arrived_.size());
    if (i + 1 >= world_) return false;
    // Step i passes on the chunk that arrived in step i − 1 (the own chunk at i = 0); the comm
    // lane runs its steps in order, so only the own chunk needs the compute lane's event.
    arrived_.push_back(transport_.shift(chunk(mod(rank_ - i, world_)),
                                        chunk(mod(rank_ - i - 1, world_)), own_,
                                        step_name(role_, "AG", i, world_)));
    return true;
  }

  void wait_chunk(int c) override {
    if (c == rank_) return;
    const auto step = static_cast<std::size_t>(mod(rank_ - c - 1, world_));
    while (arrived_.size() <= step) advance();
    arrived_[step].wait(Stream(full_.device()));
  }

 private:
  P2PTransport& transport_;
  std::vector<Event> arrived_;  // arrived_[i]: step i's chunk, (rank − i − 1) mod N, is here
};

// --- the ring reduce-scatter ---------------------------------------------------------------------

/// Step i computes the partial rows of chunk (r − i − 1) mod N, adds the running sum received from
/// r − 1 and sends the sum on to r + 1; at i = N − 1 the chunk is r's own and the sum complete.
/// Double buffers: the partial sum of step i is sent while step i + 1's GEMM writes the other
/// one; the running sum from r − 1 arrives in recv[i % 2] while step i + 1 reads recv[(i−1) % 2].
class RingReduceScatter final : public ChunkReduceScatter {
 public:
  RingReduceScatter(const RingContext& ctx, P2PTransport& transport, const Tensor::Shape& shape,
                    Device dev, std::string_view role)
      : transport_(transport),
        trace_(ctx.trace),
        compute_(dev),
        rank_(transport.rank()),
        world_(transport.world()),
        role_(role) {
    const int nbuf = world_ > 1 ? 2 : 1;
    for (int b = 0; b < nbuf; ++b) {
      part_.push_back(Tensor::empty(shape, ctx.activations, dev));
      if (world_ > 1) recv_.push_back(Tensor::empty(shape, ctx.activations, dev));
    }
  }

  int chunk_at(int i) const override { return mod(rank_ - i - 1, world_); }

  Tensor target(int i) override {
    if (i >= 2) arrived_[static_cast<std::size_t>(i - 2)].wait(compute_);  // it has been sent
    return part(i);
  }

  void computed(int i) override {
    add_received(i);
    Event ready(compute_.device());
    ready.record(compute_);
    arrived_.push_back(transport_.shift(part(i), recv_[static_cast<std::size_t>(i % 2)], ready,
                                        step_name(role_, "RS", i, world_)));
  }

  Tensor finish() override {
    add_received(world_ - 1);
    return part(world_ - 1);
  }

 private:
  const Tensor& part(int i) const { return part_[static_cast<std::size_t>(i) % part_.size()]; }

  /// The running sum of step i − 1, received from r − 1, joins step i's partial sums.
  void add_received(int i) {
    if (i == 0) return;
    arrived_[static_cast<std::size_t>(i - 1)].wait(compute_);
    TraceScope span(trace_, step_name(role_, "add", i, world_));
    ops::accumulate(recv_[static_cast<std::size_t>((i - 1) % 2)], part(i));
  }

  P2PTransport& transport_;
  Trace& trace_;
  Stream compute_;
  int rank_, world_;
  std::string role_;
  std::vector<Tensor> part_, recv_;
  std::vector<Event> arrived_;  // arrived_[i]: step i's transfer is done (sent and received)
};

}  // namespace

std::unique_ptr<ChunkGather> P2PTransport::gather(const RingContext& ctx, const Tensor& x_local,
                                                  std::string_view role, int queued) {
  return std::make_unique<RingGather>(ctx, *this, x_local, role, queued);
}

std::unique_ptr<ChunkReduceScatter> P2PTransport::reduce_scatter(const RingContext& ctx,
                                                                 const Tensor::Shape& shape,
                                                                 std::string_view role) {
  return std::make_unique<RingReduceScatter>(ctx, *this, shape, stream_.device(), role);
}

// --- the primitives, over any transport ----------------------------------------------------------

Tensor all_gather_gemm(const RingContext& ctx, const Tensor& x_local, std::span<const Tensor> w,
                       bool trans_w, std::span<const Tensor> out, std::string_view role) {
  TPX_CHECK(w.size() == out.size() && !w.empty(), "all_gather_gemm: {} weights, {} outputs",
            w.size(), out.size());
  const int n = ctx.transport.world();
  const auto g = ctx.transport.gather(ctx, x_local, role);
  const std::int64_t rows = x_local.dim(0);
  for (int i = 0; i < n; ++i) {
    const int c = g->chunk_at(i);  // own chunk first, then the others as they arrive
    g->wait_chunk(c);
    TraceScope span(ctx.trace, step_name(role, "GEMM", i, n));
    const Tensor x = g->chunk(c);
    for (std::size_t j = 0; j < w.size(); ++j)
      ops::gemm(x, false, w[j], trans_w, out[j].slice0(c * rows, (c + 1) * rows), 1.0f, 0.0f,
                ctx.compute);
  }
  return g->full();
}

Tensor gemm_reduce_scatter(const RingContext& ctx, std::span<const Tensor> a,
                           std::span<const Tensor> w, bool trans_w, std::string_view role,
                           const AlongTheRing& along) {
  TPX_CHECK(a.size() == w.size() && !a.empty(), "gemm_reduce_scatter: {} inputs, {} weights",
            a.size(), w.size());
  const int n = ctx.transport.world();
  TPX_CHECK(a[0].dim(0) % n == 0, "gemm_reduce_scatter: {} rows over {} ranks", a[0].dim(0), n);
  const std::int64_t rows = a[0].dim(0) / n;
  auto shape = a[0].shape();
  shape[0] = rows;
  shape.back() = trans_w ? w[0].dim(0) : w[0].dim(1);
  const auto rs = ctx.transport.reduce_scatter(ctx, shape, role);
  for (int i = 0; i < n; ++i) {
    const int c = rs->chunk_at(i);  // at i = N − 1 this is r: the sum completes at its owner
    const Tensor p = rs->target(i);
    {
      TraceScope span(ctx.trace, step_name(role, "GEMM", i, n));
      for (std::size_t j = 0; j < a.size(); ++j)
        ops::gemm(a[j].slice0(c * rows, (c + 1) * rows), false, w[j], trans_w, p, 1.0f,
                  j == 0 ? 0.0f : 1.0f, ctx.compute);
    }
    if (i + 1 < n) {
      rs->computed(i);
      if (along.gather) along.gather->advance();
    }
  }
  if (along.before_last_wait) along.before_last_wait();
  return rs->finish();
}

}  // namespace tpx
