// Symmetric memory: one collective allocation over the ranks of a node, in which every rank owns
// a buffer of the same size and can read every peer's, plus a signal pad by which the ranks tell
// each other, in stream order, that a buffer is ready to be read or has been read.
//
//   rank r's pad     counter[signal][p] for every peer p and both signals (ready, done), each on a
//                    cache line of its own; only rank p ever writes counter[·][p] of rank r's pad.
//   signal(p, s)     on a stream, after the work issued before it: writes this rank's next
//                    generation g (1, 2, 3, …) into counter[s][this rank] of p's pad, with
//                    release ordering — whatever was written before it is visible to a reader
//                    that has seen g.
//   wait(p, s, g)    on a stream: the work issued after it waits until counter[s][p] of this
//                    rank's pad is ≥ g, with acquire ordering.
//   pull(p, off, t)  on a stream: t ← bytes [off, off + t.nbytes()) of p's buffer, by the copy
//                    engine (cuda) or the copy thread (cpu) — no compute-lane work.
//
// Generations are never reset: the k-th use of a buffer waits for generation k, so a wait can
// never be satisfied by a signal of an earlier use (a flag that is set and cleared can: the
// reader may see the previous step's "set" before the writer clears it).
//
//   cpu   MPI_Win_allocate_shared over the node's ranks (MPI_COMM_TYPE_SHARED); the counters are
//         std::atomic_ref<uint64_t> in the window; pulls are memcpy on a copy thread (a created
//         Stream) standing in for a DMA engine; a wait spins on the counter.
//   cuda  cudaMalloc'd buffer + pad per rank, cudaIpcGetMemHandle exchanged over MPI and opened
//         by every peer (this works between processes on one GPU); pulls are cudaMemcpyAsync
//         device to device on the copy stream; signal and wait are cuStreamWriteValue32 (which
//         fences the stream's earlier writes) and cuStreamWaitValue32 (GEQ) on the pad.
//
// Every signal, wait and pull is recorded, when it is issued, in the rank's one flight recorder
// (SymmetricOptions::monitor, shared with the rank's communicators: op `signal` / `signal_wait` /
// `pull`, naming the peer and the generation), and the rank's one watchdog reports a wait that
// does not complete within the timeout exactly as it reports a hung collective. All ranks issue
// the same sequence of collectives, signals, waits and pulls, so the records line up across
// ranks.
//
// Ranks on several nodes (common/comm/nodes.h), or GPUs that cannot map each other, get a
// ConfigError (the same line on every rank) and nothing is left allocated.
//
// defines: tpx::Signal, tpx::SymmetricOptions, tpx::SymmetricMemory, tpx::make_symmetric_memory()
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/comm/flight_recorder.h"
#include "common/comm/group.h"
#include "common/parallel.h"
#include "common/stream.h"
#include "common/tensor.h"
#include "common/trace.h"

namespace tpx {

class CommMonitor;

/// The two counters a rank keeps per peer in its pad.
enum class Signal : int {
  ready = 0,  ///< "my buffer holds what you are to pull" (producer → consumer)
  done = 1,   ///< "I have pulled it; you may overwrite it" (consumer → producer)
};
inline constexpr int kSignals = 2;
const char* to_string(Signal s);

struct SymmetricOptions {
  /// Seconds a wait may take before the watchdog reports it and aborts the job (0: no watchdog;
  /// the cpu spin still gives up, with an error, after an hour).
  double timeout_s = 60.0;
  /// Test-only fault: job rank `fault_rank` silently skips the signal it would send as its
  /// `fault_signal`-th (0-based, counting every signal it sends through the monitor's memories).
  /// -1: none.
  int fault_rank = -1;
  std::int64_t fault_signal = -1;
  /// Test-only jitter: each pull and signal first sleeps a random 0 … `delay_us` µs on its
  /// stream (cpu), so that the protocol, not lucky timing, keeps reads consistent.
  int delay_us = 0;
  std::uint64_t delay_seed = 1;
  /// The ranks that share the memory (the whole job, or a mesh's TP group); all on one node.
  RankGroup group;
  /// Test-only fault: job rank `copy_fault_rank`'s pull number `copy_fault` (0-based, over the
  /// monitor's memories) takes three timeouts (cpu: the copy thread sleeps first). -1: none.
  int copy_fault_rank = -1;
  std::int64_t copy_fault = -1;
  /// The rank's one flight recorder and watchdog (CommOptions::monitor); null: a private one.
  /// The fault options above act through the monitor: a shared one has them from its maker
  /// (make_comm_monitor), a private one from these.
  std::shared_ptr<CommMonitor> monitor = nullptr;
};

/// Byte layout of the pad that follows each rank's buffer: one counter per (signal, peer), each
/// on its own 64-byte line.
inline constexpr std::size_t kPadLine = 64;
inline std::size_t pad_bytes(int world) {
  return static_cast<std::size_t>(kSignals) * static_cast<std::size_t>(world) * kPadLine;
}
inline std::size_t pad_offset(Signal s, int peer, int world) {
  return (static_cast<std::size_t>(s) * static_cast<std::size_t>(world) +
          static_cast<std::size_t>(peer)) *
         kPadLine;
}

class SymmetricMemory {
 public:
  virtual ~SymmetricMemory();
  SymmetricMemory(const SymmetricMemory&) = delete;
  SymmetricMemory& operator=(const SymmetricMemory&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  Device device() const { return device_; }
  /// Size of every rank's buffer (the pad comes on top).
  std::size_t bytes() const { return bytes_; }
  /// Words for the stage header, e.g. "cpu shared window over 2 ranks".
  virtual std::string name() const = 0;

  /// A view [shape] of `dtype` at byte `offset` of this rank's buffer (the bytes peers pull).
  Tensor local(const std::vector<std::int64_t>& shape, DType dtype, std::size_t offset) const;
  /// This rank's copy lane: the stream the transports issue pulls on.
  const Stream& copy_stream() const { return copy_; }

  /// On `s`: dst ← bytes [offset, offset + dst.nbytes()) of `peer`'s buffer; counted in
  /// take_stats() (payload = bus = dst.nbytes(), 0 from this rank itself), traced on the copy
  /// lane as `what` and recorded in the flight recorder (done once `s` has passed it).
  void pull(int peer, std::size_t offset, const Tensor& dst, const Stream& s,
            std::string_view what);
  /// On `s`: sends `peer` this rank's next generation of `sig` (see the top of this file).
  void signal(int peer, Signal sig, const Stream& s, std::string_view what);
  /// On `s`: work issued after it waits until `peer` has sent generation `generation` of `sig`.
  /// Generation 0 is always reached.
  void wait(int peer, Signal sig, std::uint64_t generation, const Stream& s, std::string_view what);
  /// Signals sent to `peer` so far (the generation of the last one).
  std::uint64_t sent(int peer, Signal sig) const;
  /// Host: drains this rank's copy stream, then returns once every rank has called it. No wait
  /// may be pending then whose signal a peer sends only after the barrier.
  void barrier();

  /// Pull traffic since the last call; resets the counters.
  CommStats take_stats();
  const FlightRecorder& recorder() const { return recorder_; }

 protected:
  SymmetricMemory(int rank, int world, Device device, std::size_t bytes, const SymmetricOptions& o,
                  Trace& trace);

  // What a backend implements. Each issues its work in order on `s`; the seq is the op's number
  // in recorder_, whose start and finish the backend reports (directly, or through
  // finish_when()).
  /// Address of `peer`'s buffer as this process sees it (this rank's own for peer == rank()).
  virtual std::byte* peer_base(int peer) const = 0;
  virtual void do_pull(int peer, std::size_t offset, const Tensor& dst, const Stream& s,
                       const std::string& what, int delay_us) = 0;
  virtual void do_signal(int peer, Signal sig, std::uint64_t generation, const Stream& s,
                         std::uint64_t seq, int delay_us) = 0;
  virtual void do_wait(int peer, Signal sig, std::uint64_t generation, const Stream& s,
                       std::uint64_t seq) = 0;
  virtual void do_barrier() = 0;

  /// Marks op `seq` done once `e` has completed (polled on the watchdog thread; for backends
  /// whose streams the host cannot watch directly).
  void finish_when(std::uint64_t seq, Event e);
  /// Starts watching the memory's pending ops (the monitor polls them); call at the end of the
  /// derived constructor, once the memory is usable.
  void start_watchdog();
  /// Stops watching and drains the copy stream; call first in the derived destructor.
  void stop();
  /// Reports a failed wait: through the watchdog when there is one; otherwise throws.
  [[noreturn]] void wait_failed(std::uint64_t seq, const std::string& why);

  std::shared_ptr<CommMonitor> monitor_;
  FlightRecorder& recorder_;  // the monitor's
  Trace& trace_;
  Stream copy_;
  const SymmetricOptions options_;

 private:
  /// A monitor of the memory's own (no shared one given), with the ops its fault options name.
  static std::shared_ptr<CommMonitor> own_monitor(const SymmetricOptions& o);
  int random_delay();
  std::string poll_pending();

  int rank_, world_;
  Device device_;
  std::size_t bytes_;
  std::vector<std::uint64_t> sent_;  // [signal][peer]
  OpGroup group_;                    // how the records name the memory's group
  std::mt19937_64 rng_;
  std::mutex mu_;  // guards stats_ and pending_
  CommStats stats_;
  std::vector<std::pair<std::uint64_t, Event>> pending_;
  int poll_ = -1;  // poll_pending, registered with the monitor
};

/// The symmetric memory of every rank of MPI_COMM_WORLD on `device`, `bytes` per rank (collective:
/// every rank calls it with the same arguments). Throws ConfigError, the same line on every rank,
/// when the ranks span several nodes or their devices cannot map each other's memory.
std::unique_ptr<SymmetricMemory> make_symmetric_memory(Device device, std::size_t bytes,
                                                       const SymmetricOptions& o, Trace& trace);

// Helpers the backends share (collective over `group`).
namespace symmetric {
/// Throws ConfigError (same line on every rank, naming each node's ranks) unless every rank of
/// `group` runs on one node (common/comm/nodes.h: MPI's shared-memory split, or TPX_NODE_ID).
void require_one_node(const RankGroup& group = RankGroup());
/// True on every rank of `group` iff `ok` is true on every one of them.
bool all_ok(bool ok, const RankGroup& group = RankGroup());
}  // namespace symmetric

}  // namespace tpx
