#include "05_copy_engine_async_tp/copy_engine.h"

#include <fmt/format.h>

#include "common/check.h"
#include "common/ops.h"

namespace tpx {
namespace {

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

std::size_t bytes_of(const Tensor::Shape& shape, DType dtype) {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

// --- the all-gather: publish, then pull from r+1, r+2, … -----------------------------------------

class PullGather final : public ChunkGather {
 public:
  PullGather(const RingContext& ctx, CopyEngineTransport::Buffer& buf, const Tensor& x_local,
             std::string_view role, int queued)
      : ChunkGather(ctx, x_local, role),
        mem_(*buf.memory),
        gen_(buf.uses),
        copy_(mem_.copy_stream()) {
    if (world_ == 1) return;
    // Publish on the copy lane, once x_local is complete and every peer has pulled the last use.
    own_.wait(copy_);
    for (int j = 1; j < world_; ++j)
      mem_.wait(peer(j), Signal::done, gen_ - 1, copy_, fmt::format("{} publish", role_));
    const Tensor slot = mem_.local(x_local.shape(), x_local.dtype(), 0);
    copy_.run([&trace = ctx.trace, x_local, slot, what = fmt::format("{} publish", role_)] {
      TraceScope span(trace, what, Lane::copy);
      ops::copy(x_local, slot);
    });
    for (int j = 1; j < world_; ++j)
      mem_.signal(peer(j), Signal::ready, copy_, fmt::format("{} publish", role_));
    for (int j = 0; (queued < 0 || j < queued) && advance(); ++j) {
    }
  }

  int chunk_at(int i) const override { return peer(i); }

  bool advance() override {
    const int j = static_cast<int>(arrived_.size()) + 1;  // the next pull: from r + j
    if (j >= world_) return false;
    const int p = peer(j);
    const std::string what = fmt::format("{} pull {}/{}", role_, j, world_ - 1);
    mem_.wait(p, Signal::ready, gen_, copy_, what);
    const Tensor dst = chunk(p);
    record_stream(dst, copy_);
    mem_.pull(p, 0, dst, copy_, what);
    mem_.signal(p, Signal::done, copy_, what);  // after the pull, in stream order
    Event landed(full_.device());
    landed.record(copy_);
    arrived_.push_back(std::move(landed));
    return true;
  }

  void wait_chunk(int c) override {
    if (c == rank_) return;
    const auto j = static_cast<std::size_t>(mod(c - rank_, world_));
    while (arrived_.size() < j) advance();
    arrived_[j - 1].wait(Stream(full_.device()));
  }

 private:
  int peer(int j) const { return mod(rank_ + j, world_); }

  SymmetricMemory& mem_;
  std::uint64_t gen_;  // this use's generation
  Stream copy_;
  std::vector<Event> arrived_;  // arrived_[j − 1]: the chunk of rank r + j has landed
};

// --- the library all-gather: NCCL's zero-CTA all-gather in a registered window -------------------

class ZeroCtaGather final : public ChunkGather {
 public:
  /// `full` is the window (ZeroCtaComm::window); `lane` the stream the collective is issued from.
  ZeroCtaGather(const RingContext& ctx, Communicator& comm, Tensor full, const Stream& lane,
                const Tensor& x_local, std::string_view role)
      : ChunkGather(ctx, x_local, role, std::move(full)), done_(x_local.device()) {
    TraceScope span(ctx.trace, fmt::format("{} all-gather (NCCL zero-CTA)", role_), Lane::copy);
    own_.wait(lane);  // the own chunk is in its rows
    comm.all_gather(chunk(rank_), full_, lane);
    done_.record(lane);
  }

  int chunk_at(int i) const override { return (rank_ + i) % world_; }
  bool advance() override { return false; }  // one collective, issued at once
  void wait_chunk(int c) override {
    if (c != rank_) done_.wait(Stream(full_.device()));
  }
  const Event& done() const { return done_; }

 private:
  Event done_;  // every chunk is here
};

// --- the reduce-scatter: GEMMs write peers' slots, each owner pulls and adds ---------------------

class PullReduceScatter final : public ChunkReduceScatter {
 public:
  PullReduceScatter(const RingContext& ctx, CopyEngineTransport::Buffer& buf,
                    const Tensor::Shape& shape, Device dev, std::string_view role)
      : mem_(*buf.memory),
        gen_(buf.uses),
        trace_(ctx.trace),
        compute_(dev),
        copy_(mem_.copy_stream()),
        rank_(mem_.rank()),
        world_(mem_.world()),
        role_(role),
        shape_(shape),
        dtype_(ctx.activations),
        slot_bytes_(bytes_of(shape, dtype_)),
        own_(Tensor::empty(shape, dtype_, dev)) {}

  int chunk_at(int i) const override { return mod(rank_ + i + 1, world_); }

  Tensor target(int i) override {
    const int c = chunk_at(i);
    if (c == rank_) return own_;
    // Slot c of this rank's buffer is free once its owner has pulled the last use.
    mem_.wait(c, Signal::done, gen_ - 1, compute_, fmt::format("{} slot {}", role_, c));
    return mem_.local(shape_, dtype_, slot(c, rank_) * slot_bytes_);
  }

  void computed(int i) override {
    const int c = chunk_at(i);
    mem_.signal(c, Signal::ready, compute_, fmt::format("{} slot {}", role_, c));
    // Peer r − 1 − i computes this rank's chunk in its step i: queue that pull now, behind the
    // transfers already on the copy lane.
    queue_pull(i + 1);
  }

  Tensor finish() override {
    for (int j = static_cast<int>(landed_.size()) + 1; j < world_; ++j) queue_pull(j);
    for (int j = 1; j < world_; ++j) {
      landed_[static_cast<std::size_t>(j - 1)].wait(compute_);
      TraceScope span(trace_, fmt::format("{} add {}/{}", role_, j, world_ - 1));
      ops::accumulate(landing_[static_cast<std::size_t>(j - 1)], own_);
    }
    return own_;
  }

 private:
  /// Where the partial sums for chunk c sit in rank p's buffer: slots (p+1 … p+N−1) mod N.
  std::size_t slot(int c, int p) const { return static_cast<std::size_t>(mod(c - p - 1, world_)); }

  void queue_pull(int j) {
    if (j >= world_ || static_cast<int>(landed_.size()) >= j) return;
    const int p = mod(rank_ - j, world_);
    const std::string what = fmt::format("{} pull {}/{}", role_, j, world_ - 1);
    Tensor dst = Tensor::empty(shape_, dtype_, compute_.device());
    record_stream(dst, copy_);
    mem_.wait(p, Signal::ready, gen_, copy_, what);
    mem_.pull(p, slot(rank_, p) * slot_bytes_, dst, copy_, what);
    mem_.signal(p, Signal::done, copy_, what);
    Event e(compute_.device());
    e.record(copy_);
    landing_.push_back(std::move(dst));
    landed_.push_back(std::move(e));
  }

  SymmetricMemory& mem_;
  std::uint64_t gen_;
  Trace& trace_;
  Stream compute_, copy_;
  int rank_, world_;
  std::string role_;
  Tensor::Shape shape_;
  DType dtype_;  // of the partial sums: the activations'
  std::size_t slot_bytes_;
  Tensor own_;
  std::vector<Tensor> landing_;  // landing_[j − 1]: the partial sums pulled from rank r − j
  std::vector<Event> landed_;
};

}  // namespace

// --- the transport -------------------------------------------------------------------------------

CopyEngineTransport::CopyEngineTransport(int rank, int world, Device device,
                                         const SymmetricOptions& options, Trace& trace)
    : rank_(rank), world_(world), device_(device), options_(options), trace_(trace) {
  symmetric::require_one_node(options.group);  // the one-line error comes before any training work
}

CopyEngineTransport::CopyEngineTransport(int rank, int world, Device device,
                                         const SymmetricOptions& options, Trace& trace,
                                         std::unique_ptr<ZeroCtaComm> library)
    : CopyEngineTransport(rank, world, device, options, trace) {
  library_ = std::move(library);
  if (library_) library_lane_ = Stream::create(device);
}

CopyEngineTransport::~CopyEngineTransport() = default;

CopyEngineTransport::Buffer& CopyEngineTransport::use(Buffer& b, std::size_t bytes) {
  if (!b.memory || b.memory->bytes() < bytes) {
    // Every rank asks for the same sizes in the same order, so they replace it together. The old
    // memory's destructor waits for every rank (no peer is still pulling from it).
    if (b.memory) {
      const CommStats s = b.memory->take_stats();
      retired_.payload_bytes += s.payload_bytes;
      retired_.bus_bytes += s.bus_bytes;
      retired_.calls += s.calls;
    }
    b.memory.reset();
    b.memory = make_symmetric_memory(device_, bytes, options_, trace_);
    b.uses = 0;
  }
  ++b.uses;
  return b;
}

std::unique_ptr<ChunkGather> CopyEngineTransport::gather(const RingContext& ctx,
                                                         const Tensor& x_local,
                                                         std::string_view role, int queued) {
  if (!library_)
    return std::make_unique<PullGather>(ctx, use(ag_, x_local.nbytes()), x_local, role, queued);
  // The window is reused: the compute lane first waits until the last gather into it is done
  // (its consumers were queued after that wait, so stream order covers the rest).
  if (library_done_) library_done_->wait(Stream(device_));
  auto shape = x_local.shape();
  shape[0] *= world_;
  auto g = std::make_unique<ZeroCtaGather>(ctx, library_->comm(),
                                           library_->window(shape, x_local.dtype()), library_lane_,
                                           x_local, role);
  library_done_ = g->done();
  return g;
}

std::unique_ptr<ChunkReduceScatter> CopyEngineTransport::reduce_scatter(const RingContext& ctx,
                                                                        const Tensor::Shape& shape,
                                                                        std::string_view role) {
  const std::size_t slots = static_cast<std::size_t>(world_ > 1 ? world_ - 1 : 1);
  return std::make_unique<PullReduceScatter>(
      ctx, use(rs_, slots * bytes_of(shape, ctx.activations)), shape, device_, role);
}

void CopyEngineTransport::synchronize() {
  for (Buffer* b : {&ag_, &rs_})
    if (b->memory) b->memory->copy_stream().synchronize();
  if (library_) library_lane_.synchronize();
}

CommStats CopyEngineTransport::take_stats() {
  CommStats s = std::exchange(retired_, {});
  auto add = [&s](const CommStats& m) {
    s.payload_bytes += m.payload_bytes;
    s.bus_bytes += m.bus_bytes;
    s.calls += m.calls;
  };
  for (Buffer* b : {&ag_, &rs_})
    if (b->memory) add(b->memory->take_stats());
  if (library_) add(library_->comm().take_stats());
  return s;
}

std::string CopyEngineTransport::name() const {
  if (library_)
    return "all-gathers: NCCL's zero-CTA (copy-engine) all-gather on a registered window; "
           "reduce-scatters: copy-engine pulls from symmetric memory (cuda IPC, stream-ordered "
           "signals)";
  return device_ == Device::cpu
             ? "copy-engine pulls from symmetric memory (cpu: shared MPI window, copy thread)"
             : "copy-engine pulls from symmetric memory (cuda IPC, cudaMemcpyAsync, stream-ordered "
               "signals)";
}

}  // namespace tpx
