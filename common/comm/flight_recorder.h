// Flight recorder: each rank's ONE ring buffer of its most recent communication events — every
// communicator's collectives and point-to-point ring steps, every symmetric memory's signals,
// signal waits and copy-engine pulls, of every group a rank belongs to — numbered in the order the
// rank's program issues them (sequence number, op, size, peers, group, enqueue/start/end times,
// outcome). Each op is also numbered in its lane: the ops of one group (its members issue the
// same sequence), or of one link of a group (a point-to-point op that only sends to, or only
// receives from, one peer: the k-th send from a to b meets b's k-th receive from a). Ranks need
// not run the same program (a pipeline's stages do not), so the analysis (diagnose) lines up
// each lane's members, never the whole job, to name the op, the rank and the group that stopped
// the job. The watchdog (watchdog.h) prints both when an op hangs.
//
// An op run later on another thread (a comm lane's task) is booked when it is queued (reserve), so
// that it takes its place in the order of the program, not of the threads.
//
// defines: tpx::CommOp, tpx::OpState, tpx::OpRecord, tpx::OpGroup, tpx::FlightRecorder,
//          tpx::RankOps, tpx::Verdict, tpx::diagnose(), tpx::describe_op(), tpx::format_ops()
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
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
  signal,       ///< a symmetric-memory signal to `peer`; `count` is its generation
  signal_wait,  ///< a wait for `src`'s signal of generation `count` (stage 05's symmetric memory)
  pull,         ///< a copy-engine pull of `bytes` from `src`'s symmetric buffer
  all_to_all    ///< a ragged all-to-all (expert dispatch/combine, or its exchange of row counts)
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
  std::int32_t src = -1;   ///< sendrecv, signal_wait, pull: source rank; otherwise -1
  /// The job rank of `src` (peer and src are numbers in the op's group); -1 when there is none.
  std::int32_t src_job = -1;
  /// This rank's number in the op's group (-1: the whole job, where it is the job rank).
  std::int32_t group_rank = -1;
  CommOp op = CommOp::barrier;
  DType dtype = DType::f32;
  OpState state = OpState::in_flight;
  /// False while a booked op waits for its lane to run it: its dtype, count, bytes and peers
  /// are not known yet, so it cannot differ from another rank's in them.
  bool sized = false;
  /// What the op is for in the caller's words (e.g. "qkv AG step 2/4"), NUL-terminated and cut
  /// to fit; empty when the caller gave none.
  char what[48] = {};
  /// The group the op ran in (e.g. "tp group 1", or "pp group 0.0.0 act even": one of stage 09's
  /// communicators over a group), NUL-terminated; empty for the whole job.
  char group[32] = {};
  /// The job rank of `peer` (-1 when there is none).
  std::int32_t peer_job = -1;
  /// The op's number in its lane on this rank (0, 1, 2, ...): among the ops of its group, or of
  /// its link (group, sender, receiver) for a send-only or receive-only op. kNoLane in a record
  /// made by hand: then the whole job is its lane and `seq` its number.
  std::uint64_t lane_seq = kNoLane;
  static constexpr std::uint64_t kNoLane = ~std::uint64_t{0};
};

/// The group an op runs in, as the recorder stores it: empty name for the whole job.
struct OpGroup {
  std::string_view name;
  int rank = -1;          ///< this rank's number in the group
  std::vector<int> jobs;  ///< jobs[r]: the job rank of the group's rank r (empty: the whole job)
  int job_of(int r) const { return r < 0 || jobs.empty() ? r : jobs[static_cast<std::size_t>(r)]; }
};

/// The last `capacity` ops of one rank. Thread-safe: the op's thread appends and updates, the
/// watchdog thread reads (and, for asynchronous backends, marks ops done).
class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 256;

  explicit FlightRecorder(std::size_t capacity = kCapacity);

  /// Appends an in-flight op enqueued now; returns its sequence number.
  std::uint64_t begin(CommOp op, DType dtype, std::int64_t count, std::uint64_t bytes,
                      int peer = -1, int src = -1, std::string_view what = {},
                      const OpGroup& group = {});
  /// Books the next sequence number for an op of kind `op` that will be issued later, from
  /// another thread: recorded now (in flight, enqueued now); fill() completes it.
  /// A point-to-point op names its peer (`peer`, to send to) or source (`src`) here, numbers in
  /// `group`, so that it is numbered in the lane of that link.
  std::uint64_t reserve(CommOp op, std::string_view what = {}, const OpGroup& group = {},
                        int peer = -1, int src = -1);
  /// Completes a reserve()d op's size and peers (ignored once it has left the ring).
  void fill(std::uint64_t seq, DType dtype, std::int64_t count, std::uint64_t bytes, int peer = -1,
            int src = -1);
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
  std::map<std::string, std::uint64_t, std::less<>> lanes_;  // lane → ops numbered in it
};

/// One rank's recorder as the analysis sees it.
struct RankOps {
  int rank = 0;                ///< the job rank
  bool responded = false;      ///< false: the rank did not answer; `ops` is empty
  std::uint64_t next_seq = 0;  ///< ops the rank had begun
  std::vector<OpRecord> ops;   ///< its retained ops, oldest first
};

/// The job's one diagnosis of a stall, from every rank's record.
struct Verdict {
  /// The op the verdict is about (its sequence number; empty when the records hold none).
  std::optional<std::uint64_t> seq;
  /// The job ranks it blames: that skipped the op, issued another, never answered, or hold it
  /// in flight while the others are done with it. Empty when no rank can be blamed.
  std::vector<int> ranks;
  /// One sentence, e.g. "first difference at op #50 (all_reduce fp32[96] 384 B): rank 1 skipped
  /// it (the others: all_reduce fp32[96] 384 B)".
  std::string text;
};

/// The job's diagnosis from the records of every rank. Only the ranks that must agree are
/// compared: each lane's (a group's members; a link's sender and receiver). In this order of
/// evidence:
///   1. the first op (earliest enqueued) some responding rank skipped or issued differently from
///      the rest of its lane (for collectives also a different dtype, size or root): those ranks;
///   2. else ranks that did not answer: they, and the op the others wait in;
///   3. else the oldest op still in flight anywhere, followed to what it waits for: a peer's
///      signal, or a member of its lane that waits in another op; then the rank(s) holding it,
///      when the rest of its lane is done with it, or a member with nothing in flight that has
///      not issued it yet.
/// A rank waiting in an op (in flight) is never blamed for not having issued a later one. Ops
/// evicted from a rank's ring count as issued with unknown contents. The verdict names each
/// op by the sequence number of the rank it is about.
Verdict diagnose(std::span<const RankOps> ranks);

/// One op in a few words, e.g. "all_reduce fp32[1024] 4096 B", "sendrecv fp32[64] 256 B to 1 from
/// 3 (qkv AG step 2/4)", "signal_wait from 1 gen 7 (qkv ready)" or "pull 4096 B from 2 (qkv pull
/// 1/2) in tp group 0".
std::string describe_op(const OpRecord& r);
/// A multi-line dump of a rank's ops, times relative to `now`, each line prefixed by `prefix`.
std::string format_ops(std::span<const OpRecord> ops, double now, const std::string& prefix);

}  // namespace tpx
