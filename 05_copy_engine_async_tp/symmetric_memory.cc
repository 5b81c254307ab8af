#include "05_copy_engine_async_tp/symmetric_memory.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "common/check.h"
#include "common/comm/nodes.h"
#include "common/comm/watchdog.h"

#if TPX_WITH_CUDA
#include "05_copy_engine_async_tp/cuda/symmetric_memory.h"
#endif

namespace tpx {

const char* to_string(Signal s) {
  return s == Signal::ready ? "ready" : "done";
}

// --- what every backend shares -------------------------------------------------------------------

SymmetricMemory::SymmetricMemory(int rank, int world, Device device, std::size_t bytes,
                                 const SymmetricOptions& o, Trace& trace)
    : monitor_(o.monitor ? o.monitor : own_monitor(o)),
      recorder_(monitor_->recorder()),
      trace_(trace),
      copy_(Stream::create(device)),
      options_(o),
      rank_(rank),
      world_(world),
      device_(device),
      bytes_(bytes),
      sent_(static_cast<std::size_t>(kSignals * world), 0),
      group_{options_.group.name(), rank, options_.group.job_ranks()},
      rng_(o.delay_seed + static_cast<std::uint64_t>(rank)) {}

SymmetricMemory::~SymmetricMemory() = default;

void SymmetricMemory::start_watchdog() {
  poll_ = monitor_->add_poll([this] { return poll_pending(); });
}

void SymmetricMemory::stop() {
  try {
    copy_.synchronize();  // its tasks use the buffers and the recorder
  } catch (...) {         // a failed pull or wait was reported where it was waited on
  }
  if (poll_ >= 0) monitor_->remove_poll(std::exchange(poll_, -1));
}

Tensor SymmetricMemory::local(const std::vector<std::int64_t>& shape, DType dtype,
                              std::size_t offset) const {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  TPX_CHECK(offset + n <= bytes_,
            "symmetric memory: a view of {} B at offset {} exceeds the {} B "
            "buffer",
            n, offset, bytes_);
  // The view keeps nothing alive but its shape: the buffer lives as long as this object, which
  // outlives the stage's tensors.
  return Tensor::borrow(peer_base(rank_) + offset, shape, dtype, device_,
                        std::shared_ptr<const void>(this, [](const void*) {}));
}

int SymmetricMemory::random_delay() {
  if (options_.delay_us <= 0) return 0;
  return static_cast<int>(rng_() % static_cast<std::uint64_t>(options_.delay_us + 1));
}

void SymmetricMemory::pull(int peer, std::size_t offset, const Tensor& dst, const Stream& s,
                           std::string_view what) {
  TPX_CHECK(peer >= 0 && peer < world_, "symmetric memory: pull from rank {} of {}", peer, world_);
  TPX_CHECK(dst.device() == device_, "symmetric memory: pull into a {} tensor on {} memory",
            to_string(dst.device()), to_string(device_));
  TPX_CHECK(offset + dst.nbytes() <= bytes_,
            "symmetric memory: pull of {} B at offset {} exceeds the {} B buffer", dst.nbytes(),
            offset, bytes_);
  {
    std::lock_guard lock(mu_);
    const std::uint64_t b = peer == rank_ ? 0 : dst.nbytes();
    stats_.payload_bytes += b;
    stats_.bus_bytes += b;
    stats_.calls += 1;
  }
  const std::uint64_t seq =
      recorder_.begin(CommOp::pull, dst.dtype(), dst.numel(), dst.nbytes(), -1, peer, what, group_);
  int delay_us = random_delay();
  if (monitor_->strikes(CommMonitor::Kind::pull, monitor_->next(CommMonitor::Kind::pull), seq,
                        /*peers=*/true))  // fault injection: this copy takes three timeouts
    delay_us = static_cast<int>(std::min(3e6 * std::max(options_.timeout_s, 1.0), 2e9));
  do_pull(peer, offset, dst, s, std::string(what), delay_us);
  Event landed(device_);
  landed.record(s);
  finish_when(seq, std::move(landed));
}

void SymmetricMemory::signal(int peer, Signal sig, const Stream& s, std::string_view what) {
  TPX_CHECK(peer >= 0 && peer < world_, "symmetric memory: signal to rank {} of {}", peer, world_);
  const std::uint64_t gen =
      ++sent_[static_cast<std::size_t>(static_cast<int>(sig) * world_ + peer)];
  const std::uint64_t seq =
      recorder_.begin(CommOp::signal, DType::f32, static_cast<std::int64_t>(gen), 0, peer, -1,
                      fmt::format("{} {}", what, to_string(sig)), group_);
  // Fault injection: the peer never hears of it (a signal to the rank itself is never skipped).
  if (monitor_->strikes(CommMonitor::Kind::signal, monitor_->next(CommMonitor::Kind::signal), seq,
                        peer != rank_)) {
    recorder_.finish(seq, OpState::skipped);
    return;
  }
  do_signal(peer, sig, gen, s, seq, random_delay());
}

void SymmetricMemory::wait(int peer, Signal sig, std::uint64_t generation, const Stream& s,
                           std::string_view what) {
  TPX_CHECK(peer >= 0 && peer < world_, "symmetric memory: wait for rank {} of {}", peer, world_);
  if (generation == 0) return;
  const std::uint64_t seq =
      recorder_.begin(CommOp::signal_wait, DType::f32, static_cast<std::int64_t>(generation), 0, -1,
                      peer, fmt::format("{} {}", what, to_string(sig)), group_);
  do_wait(peer, sig, generation, s, seq);
}

std::uint64_t SymmetricMemory::sent(int peer, Signal sig) const {
  return sent_[static_cast<std::size_t>(static_cast<int>(sig) * world_ + peer)];
}

void SymmetricMemory::barrier() {
  copy_.synchronize();
  const std::uint64_t seq = recorder_.begin(CommOp::barrier, DType::f32, 0, 0, -1, -1, {}, group_);
  recorder_.started(seq);
  do_barrier();
  recorder_.finish(seq, OpState::done);
}

CommStats SymmetricMemory::take_stats() {
  std::lock_guard lock(mu_);
  return std::exchange(stats_, {});
}

void SymmetricMemory::finish_when(std::uint64_t seq, Event e) {
  {
    std::lock_guard lock(mu_);
    pending_.emplace_back(seq, std::move(e));
  }
  poll_pending();  // also without a watchdog, finished ops leave the list
}

std::string SymmetricMemory::poll_pending() {
  std::lock_guard lock(mu_);
  // Ops on different streams finish in any order: each is checked on its own.
  std::erase_if(pending_, [this](const std::pair<std::uint64_t, Event>& p) {
    if (!p.second.ready()) return false;
    recorder_.finish(p.first, OpState::done);
    return true;
  });
  return {};
}

void SymmetricMemory::wait_failed(std::uint64_t seq, const std::string& why) {
  monitor_->fail_op(seq, why);
}

namespace symmetric {

void require_one_node(const RankGroup& group) {
  // Every rank decides on the same facts: each learns the node of every rank of the group.
  const NodeMap nodes = NodeMap::discover(group);
  if (nodes.nodes() > 1)
    throw ConfigError(fmt::format(
        "symmetric memory needs every rank{} on one node, but its {} ranks span {} nodes ({}); "
        "across nodes use stage 04, or stage 07 with --dp <number of nodes> so that each TP group "
        "is one node's ranks",
        group.is_world() ? "" : " of " + group.name(), group.size(), nodes.nodes(), nodes.where()));
}

bool all_ok(bool ok, const RankGroup& group) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, group.comm());
  return all == 1;
}

}  // namespace symmetric

// --- the cpu backend: a shared MPI window, a copy thread, atomic counters ------------------------

namespace {

class CpuSymmetricMemory final : public SymmetricMemory {
 public:
  CpuSymmetricMemory(int rank, int world, std::size_t bytes, const SymmetricOptions& o,
                     Trace& trace)
      : SymmetricMemory(rank, world, Device::cpu, bytes, o, trace),
        stride_((bytes + kPadLine - 1) / kPadLine * kPadLine) {
    MPI_Comm_split_type(o.group.comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node_);
    // Every rank's segment is contiguous with the others' by default; each is buffer + pad. The
    // window's memory starts zeroed here, so every counter starts at generation 0.
    const auto mine = static_cast<MPI_Aint>(stride_ + pad_bytes(world));
    void* base = nullptr;
    const int rc = MPI_Win_allocate_shared(mine, 1, MPI_INFO_NULL, node_, &base, &win_);
    if (!symmetric::all_ok(rc == MPI_SUCCESS, o.group)) {
      if (rc == MPI_SUCCESS) MPI_Win_free(&win_);
      MPI_Comm_free(&node_);
      throw ConfigError(fmt::format(
          "symmetric memory: MPI_Win_allocate_shared of {} B per rank failed on some rank", mine));
    }
    peers_.resize(static_cast<std::size_t>(world));
    for (int p = 0; p < world; ++p) {
      MPI_Aint size = 0;
      int disp = 0;
      void* ptr = nullptr;
      MPI_Win_shared_query(win_, p, &size, &disp, &ptr);
      peers_[static_cast<std::size_t>(p)] = static_cast<std::byte*>(ptr);
    }
    std::memset(base, 0, static_cast<std::size_t>(mine));
    MPI_Barrier(node_);  // nobody signals into a pad before its owner has zeroed it
    start_watchdog();
  }

  ~CpuSymmetricMemory() override {
    stop();
    // MPI_Win_free is collective and waits for every rank, so no peer can still be reading this
    // rank's buffer. While an exception unwinds on this rank alone the others may never get
    // there: the job is being aborted, and the window goes with the process.
    if (std::uncaught_exceptions() == 0) MPI_Win_free(&win_);
    MPI_Comm_free(&node_);
  }

  std::string name() const override {
    return fmt::format("cpu shared window (MPI_Win_allocate_shared) over {} ranks, copy thread",
                       world());
  }

 protected:
  std::byte* peer_base(int peer) const override { return peers_[static_cast<std::size_t>(peer)]; }

  std::atomic_ref<std::uint64_t> counter(int owner, Signal sig, int from) const {
    auto* p = peer_base(owner) + stride_ + pad_offset(sig, from, world());
    return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(p));
  }

  void do_pull(int peer, std::size_t offset, const Tensor& dst, const Stream& s,
               const std::string& what, int delay_us) override {
    const std::byte* src = peer_base(peer) + offset;
    s.run([this, src, dst, what, delay_us] {
      sleep_us(delay_us);
      TraceScope span(trace_, what, Lane::copy);
      std::memcpy(dst.raw(), src, dst.nbytes());
    });
  }

  void do_signal(int peer, Signal sig, std::uint64_t generation, const Stream& s, std::uint64_t seq,
                 int delay_us) override {
    s.run([this, peer, sig, generation, seq, delay_us] {
      sleep_us(delay_us);
      recorder_.started(seq);
      // Release: the buffer writes this stream made before (a publish copy, a pull) happen
      // before the store, so a peer whose acquire load sees `generation` sees them too.
      counter(peer, sig, rank()).store(generation, std::memory_order_release);
      recorder_.finish(seq, OpState::done);
    });
  }

  void do_wait(int peer, Signal sig, std::uint64_t generation, const Stream& s,
               std::uint64_t seq) override {
    s.run([this, peer, sig, generation, seq] {
      recorder_.started(seq);
      const auto c = counter(rank(), sig, peer);
      const auto start = std::chrono::steady_clock::now();
      // The watchdog reports a wait past the timeout (and aborts the job); without one, the spin
      // still ends, so a lost signal can never hang a rank forever.
      const double limit = options_.timeout_s > 0 ? 2 * options_.timeout_s + 10 : 3600;
      for (int spins = 0; c.load(std::memory_order_acquire) < generation; ++spins) {
        if (spins < 64) continue;
        std::this_thread::yield();
        if (spins % 1024 == 0 &&
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit)
          wait_failed(seq, fmt::format("rank {}: signal {} of generation {} from rank {} did "
                                       "not arrive in {:.0f} s (it is at {})",
                                       rank(), to_string(sig), generation, peer, limit, c.load()));
      }
      recorder_.finish(seq, OpState::done);
    });
  }

  void do_barrier() override { MPI_Barrier(node_); }

 private:
  static void sleep_us(int us) {
    if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

  std::size_t stride_;  // the buffer, rounded up to whole pad lines; the pad follows
  MPI_Comm node_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  std::vector<std::byte*> peers_;
};

}  // namespace

std::unique_ptr<SymmetricMemory> make_symmetric_memory(Device device, std::size_t bytes,
                                                       const SymmetricOptions& o, Trace& trace) {
  const int rank = o.group.rank(), world = o.group.size();
  symmetric::require_one_node(o.group);
  if (device == Device::cpu)
    return std::make_unique<CpuSymmetricMemory>(rank, world, bytes, o, trace);
#if TPX_WITH_CUDA
  return cuda::make_symmetric_memory(rank, world, bytes, o, trace);
#else
  throw ConfigError("symmetric memory on cuda needs a build with the CUDA backend");
#endif
}

std::shared_ptr<CommMonitor> SymmetricMemory::own_monitor(const SymmetricOptions& o) {
  const int me = o.group.world_rank_of(o.group.rank());
  return std::make_shared<CommMonitor>(
      o.timeout_s, o.group,
      FaultTargets{.job_rank = me,
                   .signal = o.fault_rank == me ? o.fault_signal : -1,
                   .pull = o.copy_fault_rank == me ? o.copy_fault : -1});
}

}  // namespace tpx
