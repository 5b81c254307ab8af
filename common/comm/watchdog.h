// Watchdog: turns a hung or failed communicator op into a diagnosis and an abort instead of a
// silent hang.
//
// A thread per rank watches the rank's flight recorder. When an op stays in flight longer than
// the timeout (or the backend reports it failed), the rank
//   1. prints its last ops to stderr,
//   2. asks every other rank for its recorder over a private communicator (non-blocking, with its
//      own deadline; ranks that do not answer are reported as unresponsive), and every rank that
//      is asked prints its own last ops,
//   3. lines the records up (find_disagreement) and the lowest-numbered reporting rank prints ONE
//      line, e.g.
//        tpx: comm watchdog: op #7 (all_reduce fp32[1024] 4096 B) on rank 0 did not complete in
//        2.0 s; ranks disagree first at seq 5: rank 1 skipped it (the others: all_reduce ...)
//   4. MPI_Abort ends the job.
// The thread also answers other ranks' requests at any time, so a rank blocked elsewhere (in
// compute, in another MPI call) still contributes its records. Needs MPI_THREAD_MULTIPLE.
//
// defines: tpx::Watchdog
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
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
  /// own messages); a group's messages name it and its ranks' job ranks.
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
  [[noreturn]] void report(const OpRecord& op, const std::string& what);
  [[noreturn]] void wait_to_be_killed(double seconds, const std::string& line);
  void print_own_ops(const std::string& headline);
  void pause();

  const std::string prefix_;  // "tpx: comm watchdog", and the group's name when it is one
  const FlightRecorder& recorder_;
  const double timeout_s_;
  const double grace_s_;  // how long a reporter waits for the other ranks' records
  Poll poll_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;

  std::atomic<int> role_{static_cast<int>(Role::watching)};
  std::atomic<bool> printed_{false};
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

}  // namespace tpx
