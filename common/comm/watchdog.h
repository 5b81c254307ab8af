// Watchdog: turns a hung or failed communication op into a diagnosis and an abort instead of a
// silent hang.
//
// One per rank (CommMonitor): a thread watches the rank's one flight recorder, into which every
// communicator and symmetric memory of the rank records. When an op stays in flight longer than
// the timeout (or a backend reports it failed), the rank
//   1. asks every other rank for its recorder over a private communicator (non-blocking) and
//      waits for the answers at most a grace of a quarter of the timeout (at least 0.5 s, at
//      most 5 s: grace_seconds()); ranks that do not answer in it are reported as unresponsive.
//      A live rank answers within milliseconds (its watchdog thread polls every 5 ms), so the
//      grace is what a stopped rank costs: the verdict on it comes at most the timeout plus the
//      grace after its peers began to wait for it. A rank that is asked answers and prints
//      nothing,
//   2. lines the records up (diagnose), and the lowest-numbered reporting rank prints the job's
//      ONE verdict line, which depends only on the records, not on the rank that prints it, e.g.
//        tpx: comm watchdog: an op did not complete in 2.0 s; first difference at op #5
//        (all_reduce fp32[256] 1024 B): rank 1 skipped it (the others: all_reduce ...)
//      and after it, in the same flushed write, the last ops of every rank that answered
//      ("[rank r]" lines), so that the verdict is the first line a user reads,
//   3. MPI_Abort ends the job (after a pause that lets mpirun forward the text before its own
//      MPI_ABORT lines).
// The thread also answers other ranks' requests at any time, so a rank blocked elsewhere (in
// compute, in another MPI call) still contributes its records. Needs MPI_THREAD_MULTIPLE.
//
// defines: tpx::Watchdog, tpx::FaultTargets, tpx::CommMonitor
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "flight_recorder.h"
#include "group.h"

namespace tpx {

class Watchdog {
 public:
  /// Checks the backend for asynchronous progress and errors; called on the watchdog thread every
  /// few milliseconds. Returns a non-empty description if the backend has failed.
  using Poll = std::function<std::string()>;

  /// Starts watching. Collective over `group` (it duplicates the group's communicator for its
  /// own messages); a group's messages name it and its ranks' job ranks. The records' ranks are
  /// the group's; a monitor over the whole job (the stages') sees job ranks.
  Watchdog(const FlightRecorder& recorder, double timeout_s, Poll poll = {},
           const RankGroup& group = RankGroup());
  /// Stops the thread (no collective).
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Reports op `seq` as failed with `why`; the watchdog diagnoses and aborts the job. Never
  /// returns.
  [[noreturn]] void fail_op(std::uint64_t seq, const std::string& why);

  /// A barrier over every rank on the watchdog's own communicator (the caller records it in the
  /// flight recorder so that it is watched like any op). Used when a communicator shuts down, so
  /// that no rank leaves while another may still need its records.
  void barrier();

  /// Seconds an op may stay in flight.
  double timeout() const { return timeout_s_; }
  /// Seconds a reporting rank waits for the others' records under `timeout_s`: a quarter of it,
  /// at least 0.5 s (what a live rank on a loaded machine may need to answer) and at most 5 s.
  static double grace_seconds(double timeout_s);

  /// True if this MPI library allows a watchdog thread (MPI_THREAD_MULTIPLE).
  static bool supported();

 private:
  enum class Role : int { watching = 0, passive = 1, reporting = 2 };
  struct Failure {
    std::uint64_t seq;
    std::string why;
  };
  struct Reply;

  void run();
  void service_requests();
  void reply_to(int requester);
  [[noreturn]] void report(const OpRecord& op, const std::string& trigger);
  [[noreturn]] void wait_to_be_killed(double seconds, const std::string& line);
  void pause();

  const std::string prefix_;  // "tpx: comm watchdog", and the group's name when it is one
  const FlightRecorder& recorder_;
  const double timeout_s_;
  const double grace_s_;  // how long a reporter waits for the other ranks' records
  Poll poll_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;

  std::atomic<int> role_{static_cast<int>(Role::watching)};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Failure> failure_;  // guarded by mu_

  // Watchdog-thread state: the posted receive for requests and replies still being sent.
  MPI_Request request_ = MPI_REQUEST_NULL;
  int request_buf_ = 0;
  std::vector<std::pair<MPI_Request, std::vector<char>>> outgoing_;
  std::thread thread_;
};

/// Test-only fault injection (the hidden --fault-* flags, CommOptions): which of one rank's ops
/// each flag names, by the number CommMonitor::next() gives it; -1: no flag names this rank.
struct FaultTargets {
  int job_rank = -1;             ///< the rank the flags name (for fault_report()'s words)
  std::int64_t collective = -1;  ///< --fault-skip-collective: this collective is skipped
  std::int64_t signal = -1;      ///< --fault-skip-signal: this signal is never sent
  std::int64_t pull = -1;        ///< --fault-delay-copy: this pull takes three comm timeouts
};

/// A rank's one record of its communication and the one watchdog over it. Every communicator and
/// symmetric memory of a stage records into the monitor they are given (CommOptions::monitor), so
/// the rank's collectives, ring steps, pulls and signals, in every group, form one sequence that
/// lines up across ranks, and a stall gets one verdict. One made without a shared monitor makes a
/// private one.
class CommMonitor {
 public:
  /// Collective over `group` (the whole job for the stages): starts the watchdog when
  /// `timeout_s` > 0 and MPI allows a watchdog thread. `faults`: the ops the fault flags name.
  explicit CommMonitor(double timeout_s, const RankGroup& group = RankGroup(),
                       const FaultTargets& faults = {});
  ~CommMonitor();
  CommMonitor(const CommMonitor&) = delete;
  CommMonitor& operator=(const CommMonitor&) = delete;

  FlightRecorder& recorder() { return recorder_; }
  const FlightRecorder& recorder() const { return recorder_; }
  /// Seconds an op may stay in flight (0: no watchdog).
  double timeout() const { return watchdog_ ? timeout_s_ : 0.0; }

  /// Adds a check of asynchronous progress run on the watchdog thread (Watchdog::Poll); returns
  /// its id for remove_poll(), which returns once the poll is not running.
  int add_poll(Watchdog::Poll poll);
  void remove_poll(int id);

  /// Reports op `seq` as failed: with a watchdog the job is diagnosed and aborted (never
  /// returns); without one this throws tpx::Error.
  [[noreturn]] void fail_op(std::uint64_t seq, const std::string& why);
  /// A barrier over the monitor's group, recorded and watched like any op: call it before a rank
  /// may leave, so that no rank leaves while another may still need its records.
  void barrier();

  /// Numbers of the rank's collectives, signals and pulls, 0, 1, 2, ... in issue order: what the
  /// test-only fault flags count.
  enum class Kind { collective, signal, pull };
  std::int64_t next(Kind k) { return counters_[static_cast<std::size_t>(k)]++; }

  /// Whether the fault flag of kind `k` strikes op `nth` of that kind (a number next() gave;
  /// `seq`: its record, which must hold the op's size and peers): true for the op the flag
  /// names, if another rank takes part in it (`peers`). An op without peers (a collective of a
  /// one-rank group, a transfer to the rank itself) is never struck: no rank could notice it
  /// missing, and its output (a one-rank all-gather's is its input) must still be made.
  bool strikes(Kind k, std::int64_t nth, std::uint64_t seq, bool peers);
  /// For a run that got to its end (the watchdog never stopped it): one line that says, for each
  /// fault flag naming this rank, that it never fired (the rank issued fewer ops of its kind),
  /// that the op it names has no peers (so it ran), or that it struck and no rank noticed; ""
  /// when no flag names this rank. A run with a fault flag is meant to be stopped by the
  /// watchdog: whatever this says, the run did not test what it was asked to.
  std::string fault_report() const;

 private:
  std::string poll_all();

  /// What became of a fault flag's op (strikes()).
  struct FaultOutcome {
    enum class State { pending, struck, no_peers } state = State::pending;
    std::uint64_t seq = 0;  ///< the op's record
    std::string op;         ///< describe_op() of it
  };

  FlightRecorder recorder_;
  double timeout_s_;
  FaultTargets faults_;
  std::array<std::atomic<std::int64_t>, 3> counters_{};
  mutable std::mutex faults_mu_;
  std::array<FaultOutcome, 3> outcomes_{};  // by Kind; guarded by faults_mu_
  std::mutex polls_mu_;
  std::map<int, Watchdog::Poll> polls_;
  int next_poll_ = 0;
  std::unique_ptr<Watchdog> watchdog_;  // last: its thread stops before the polls go
};

}  // namespace tpx
