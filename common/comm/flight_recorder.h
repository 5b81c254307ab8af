// Flight recorder: each rank's ring buffer of its most recent communicator ops (sequence number,
// op, size, peers, enqueue/start/end times, outcome), and the analysis that lines up the rings of
// all ranks to find the first op they disagree on. The watchdog (watchdog.h) prints both when an
// op hangs.
//
// defines: tpx::CommOp, tpx::OpState, tpx::OpRecord, tpx::FlightRecorder, tpx::RankOps,
//          tpx::Disagreement, tpx::find_disagreement(), tpx::describe_op(), tpx::format_ops()
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor.h"

namespace tpx {

enum class CommOp : std::uint8_t {
  all_gather,
  reduce_scatter,
  all_reduce,
  all_reduce_max,  ///< element-wise maximum (the FP8 stage's amax agreement)
  broadcast,
  send,
  recv,
  sendrecv,
  barrier,
  signal,      ///< a symmetric-memory signal to `peer`; `count` is its generation
  signal_wait  ///< a wait for `src`'s signal of generation `count` (common/symmetric_memory.h)
};
const char* to_string(CommOp op);

/// What became of an op. in_flight: issued, not known to be complete yet.
enum class OpState : std::uint8_t { in_flight, done, skipped, failed };
const char* to_string(OpState s);

/// One op as the recorder keeps it. Trivially copyable: the watchdog sends records between ranks
/// as bytes (all ranks run the same binary).
struct OpRecord {
  std::uint64_t seq = 0;    ///< 0, 1, 2, ... per communicator, in call order
  std::uint64_t bytes = 0;  ///< payload bytes, as defined for CommStats (communicator.h)
  std::int64_t count = 0;   ///< elements of the payload
  double enqueue_s = 0;     ///< when the call was made (steady clock of this rank, seconds)
  double start_s = -1;      ///< when the transfer was handed to the backend; < 0: not yet
  /// When it was seen complete; < 0: not yet. MPI: when the call returned; NCCL: when the
  /// watchdog thread saw the op's end event (polled every few milliseconds).
  double end_s = -1;
  std::int32_t peer = -1;  ///< sendrecv, signal: destination rank; broadcast: root; otherwise -1
  std::int32_t src = -1;   ///< sendrecv, signal_wait: source rank; otherwise -1
  CommOp op = CommOp::barrier;
  DType dtype = DType::f32;
  OpState state = OpState::in_flight;
  /// What the op is for in the caller's words (e.g. "qkv AG step 2/4"), NUL-terminated and cut
  /// to fit; empty when the caller gave none.
  char what[48] = {};
};

/// The last `capacity` ops of one communicator. Thread-safe: the op's thread appends and updates,
/// the watchdog thread reads (and, for asynchronous backends, marks ops done).
class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 64;

  explicit FlightRecorder(std::size_t capacity = kCapacity);

  /// Appends an in-flight op enqueued now; returns its sequence number.
  std::uint64_t begin(CommOp op, DType dtype, std::int64_t count, std::uint64_t bytes,
                      int peer = -1, int src = -1, std::string_view what = {});
  /// Stamps the start time of op `seq` (ignored once it has left the ring).
  void started(std::uint64_t seq);
  /// Sets the final state of op `seq` and stamps its end time (ignored once it has left the ring).
  void finish(std::uint64_t seq, OpState state);

  /// The retained ops, oldest first.
  std::vector<OpRecord> snapshot() const;
  /// Ops begun so far (the next sequence number).
  std::uint64_t next_seq() const;
  /// The oldest retained op that is still in flight.
  std::optional<OpRecord> oldest_in_flight() const;
  std::size_t capacity() const { return ring_.size(); }

  /// Seconds on the steady clock the records use.
  static double now();

 private:
  OpRecord* find(std::uint64_t seq);  // caller holds mu_

  mutable std::mutex mu_;
  std::vector<OpRecord> ring_;  // slot = seq % capacity
  std::uint64_t next_ = 0;
};

/// One rank's recorder as the disagreement analysis sees it.
struct RankOps {
  int rank = 0;
  bool responded = false;      ///< false: the rank did not answer; `ops` is empty
  std::uint64_t next_seq = 0;  ///< ops the rank had begun
  std::vector<OpRecord> ops;   ///< its retained ops, oldest first
};

/// Where the ranks' op sequences first differ.
struct Disagreement {
  /// The first sequence number at which the responding ranks' records differ: some rank skipped
  /// the op, has not issued it yet, or issued a different op (for collectives also a different
  /// dtype, size or root). Empty if the retained records agree.
  std::optional<std::uint64_t> seq;
  /// What differs, e.g. "rank 1 skipped it" or "rank 2 has not issued it (its last op is #4)".
  std::string detail;
  /// The highest sequence number every responding rank has issued (valid when seq is empty).
  std::uint64_t agreed_through = 0;
};

/// Compares the records of the ranks that responded. Ops evicted from a rank's ring count as
/// issued with unknown contents.
Disagreement find_disagreement(std::span<const RankOps> ranks);

/// One op in a few words, e.g. "all_reduce fp32[1024] 4096 B", "sendrecv fp32[64] 256 B to 1 from
/// 3 (qkv AG step 2/4)" or "signal_wait from 1 gen 7 (qkv ready)".
std::string describe_op(const OpRecord& r);
/// A multi-line dump of a rank's ops, times relative to `now`, each line prefixed by `prefix`.
std::string format_ops(std::span<const OpRecord> ops, double now, const std::string& prefix);

}  // namespace tpx
