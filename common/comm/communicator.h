// Communicator: the collectives and point-to-point transfers the stages use, on a stream, with
// accounting (payload and bus bytes, nccl-tests convention), a flight recorder of recent ops and
// a watchdog that turns a hang into a diagnosis.
//
// Implementations: MPI on host memory (the cpu backend, and the host-staged path for cuda tensors
// when ranks share a GPU), NCCL on device memory (one GPU per rank).
//
// Dim-0 convention: all_gather concatenates the ranks' inputs along dim 0 in rank order;
// reduce_scatter sums the inputs and gives rank r the r-th dim-0 slice. With activations
// [S, B, H] that is exactly the sequence split of sequence parallelism.
//
// Accounting (CommStats, per rank, summed over the calls since the last take_stats()):
//   N = size(), E = element size of the call's dtype.
//   all_gather     payload = out.nbytes()  = N·in.numel()·E (the gathered buffer)
//                  bus     = payload·(N−1)/N
//   reduce_scatter payload = in.nbytes()   = N·out.numel()·E (the buffer before reduction)
//                  bus     = payload·(N−1)/N
//   all_reduce     payload = t.nbytes() (all_reduce_max alike)
//                  bus     = payload·2(N−1)/N, rounded down to whole bytes per call
//   broadcast      payload = t.nbytes(); bus = payload (0 when N = 1)
//   sendrecv       payload = send.nbytes() (0 without a send); bus = payload, except 0 when the
//                  destination is this rank itself (a local copy)
//   all_to_all_v   payload = send.nbytes() (every row this rank sends, its own rows included)
//                  bus     = the bytes of the rows sent to other ranks: Σ_{d≠r} send_rows[d]·R,
//                            R the bytes of one row (what leaves the rank; its own rows stay)
//   all_to_all_counts  payload = 4·N (one i32 count per rank); bus = 4·(N−1)
//   barrier        payload = bus = 0
//   calls          one per public call (barrier included)
// The (N−1)/N factors are nccl-tests' "bus bandwidth" convention: the bytes each rank sends over
// its links in a ring algorithm. An op skipped by fault injection is not counted.
//
// Every op is checked before it is issued (shapes, dtypes, devices, ranks) with a tpx::Error on
// every rank alike; sums (all_reduce, reduce_scatter) accept f32 only.
//
// defines: tpx::CommKind, tpx::parse_comm_kind(), tpx::CommOptions, tpx::Communicator,
//          tpx::make_comm_monitor(), tpx::make_communicator(), tpx::find_shared_device()
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/comm/flight_recorder.h"
#include "common/comm/group.h"
#include "common/parallel.h"
#include "common/stream.h"
#include "common/tensor.h"

namespace tpx {

class CommMonitor;

enum class CommKind { automatic, mpi, nccl };
CommKind parse_comm_kind(const std::string& s);  ///< "auto" | "mpi" | "nccl"
const char* to_string(CommKind k);

/// The shortest --comm-timeout a stage accepts, in seconds: below it, a healthy job's ordinary
/// waits (a peer still in its GEMM, the oversubscribed cpu's scheduling) would read as a stall.
inline constexpr double kMinCommTimeout = 0.1;

/// Options every multi-rank stage takes (--comm, --comm-timeout, and the hidden
/// --fault-skip-collective RANK:N, --fault-skip-signal RANK:N, --fault-delay-copy RANK:N,
/// --fault-copy-delay-us US and --fault-comm-delay-us US).
struct CommOptions {
  CommKind kind = CommKind::automatic;
  /// The ranks the communicator spans (the whole job unless a mesh splits it); every message
  /// about a peer names it in the group's terms (RankGroup::describe_rank).
  RankGroup group;
  /// What the flight recorder calls the group, when not the group's own name: two
  /// communicators over one group whose ops are ordered apart (stage 09's activation and
  /// gradient channels) are two lanes of it, "pp group 0.0.0 act" and "... grad".
  std::string group_label;
  /// Seconds an op may take before the watchdog dumps every rank's recent ops and aborts.
  double timeout_s = 60.0;
  /// Fault injection for tests: job rank `fault_rank` silently skips its collective (or ring
  /// step) number `fault_seq`, counting from 0 over every communicator of the rank, and records
  /// it as skipped. -1: no fault. An op that no other rank takes part in (a collective of a
  /// one-rank group, a transfer to the rank itself) is counted but never skipped, since no rank
  /// could notice it missing: it runs. A stage that gets to its end with a RANK:N fault flag
  /// (this one, or the signal and copy faults below) says in one line what became of it (it
  /// never fired, its op had no peers, or its skip went unnoticed: CommMonitor::fault_report)
  /// and exits 1 without writing its outputs. These faults act through the rank's monitor,
  /// which make_comm_monitor() gives them.
  int fault_rank = -1;
  std::int64_t fault_seq = -1;
  /// Fault injection for symmetric memory (stages 05-07; hidden --fault-skip-signal RANK:N,
  /// --fault-delay-copy RANK:N and --fault-copy-delay-us US): job rank `signal_fault_rank` never
  /// sends its signal number `signal_fault` (0-based, over all its symmetric memories), job rank
  /// `copy_fault_rank`'s pull number `copy_fault` takes three comm timeouts, and every pull and
  /// signal waits a random 0 … `copy_delay_us` µs.
  int signal_fault_rank = -1;
  std::int64_t signal_fault = -1;
  int copy_fault_rank = -1;
  std::int64_t copy_fault = -1;
  int copy_delay_us = 0;
  /// Fault injection for the stream order (hidden --fault-comm-delay-us US): every op of every
  /// communicator of the rank waits 0 … `comm_delay_us` µs, a hash of the rank and the op's
  /// sequence number (random-looking, but the same for an op on every run), before it moves bytes, on the thread that runs it. On the cpu a comm lane is a thread
  /// of its own, so its transfers then finish late: compute that reads a received buffer, or
  /// writes over one being sent, without first waiting for the lane's event reads or sends
  /// the wrong bytes, as it would on a GPU whose lane runs behind. 0: no delay.
  int comm_delay_us = 0;
  /// The rank's one flight recorder and watchdog, shared by every communicator and symmetric
  /// memory made with these options (the stages make one per job). Null: each makes its own.
  std::shared_ptr<CommMonitor> monitor = nullptr;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// Words for the stage header, e.g. "mpi (host memory)" or "nccl (device memory)".
  virtual std::string name() const = 0;
  /// True when an op returns only once its transfer is done, so the calling thread waits (MPI,
  /// which stages cuda tensors through the host); false when it only queues the transfer on the
  /// stream (NCCL). A lane whose transfers block belongs on a host lane of its own
  /// (Stream::create_host_lane), or the thread that issues compute would wait in them.
  virtual bool blocks_caller() const { return true; }

  /// Books the record of an op of kind `op` that a task queued now will issue later on another
  /// thread (a comm lane's): pass the result as `booked` to that call. So an op takes its place
  /// in the flight recorder in the order the program queues it, the same on every rank, whichever
  /// thread runs first. A point-to-point op names its peer (`peer` to send to, `src` to receive
  /// from, numbers in the group) here already, so that its record joins the lane of that link.
  std::uint64_t book(CommOp op, std::string_view what = {}, int peer = -1, int src = -1);

  /// A report's number from every rank of the group, in rank order (a step's loss sum, a
  /// timing): a host-side MPI all-gather of one double each. It is recorded in the flight
  /// recorder as an op of the group's "report" lane, so a rank that never joins it is diagnosed
  /// by the watchdog as in any other op instead of leaving its peers in a bare MPI call forever;
  /// it is not counted in take_stats() (the report's traffic, not the step's).
  std::vector<double> all_gather_report(double mine, std::string_view what);
  /// The same for bytes (a tensor gathered for --check or --dump): `all` = every rank's `mine`
  /// (all of one size) concatenated in rank order; `all` holds size() · mine.size() bytes.
  /// Recorded in the "report" lane and not counted, as above.
  void all_gather_report(std::span<const std::byte> mine, std::span<std::byte> all,
                         std::string_view what);

  /// out [N·n, ...] = concatenation over ranks of in [n, ...].
  void all_gather(const Tensor& in, const Tensor& out, const Stream& s,
                  std::optional<std::uint64_t> booked = {});
  /// out [n, ...] = this rank's slice of Σ_ranks in [N·n, ...] (f32).
  void reduce_scatter(const Tensor& in, const Tensor& out, const Stream& s,
                      std::optional<std::uint64_t> booked = {});
  /// t = Σ_ranks t, in place (f32).
  void all_reduce(const Tensor& t, const Stream& s);
  /// t = max over ranks of t, element-wise, in place (f32): how FP8 shards agree on an amax.
  void all_reduce_max(const Tensor& t, const Stream& s);
  void broadcast(const Tensor& t, int root, const Stream& s);
  /// Sends `send` to rank dst while receiving `recv` from rank src (either may be undefined).
  /// `what` names the transfer in the flight recorder (and so in a watchdog report), e.g.
  /// "qkv AG step 2/4".
  void sendrecv(const Tensor& send, int dst, const Tensor& recv, int src, const Stream& s,
                std::string_view what = {}, std::optional<std::uint64_t> booked = {});
  /// Ragged all-to-all along dim 0 (expert parallelism's dispatch and combine): `send` holds, in
  /// rank order, send_rows[d] rows for each rank d; `recv` receives, in rank order, recv_rows[s]
  /// rows from each rank s, which must be what rank s's send_rows names for this rank (exchange
  /// them first with all_to_all_counts, or know them, as a combine that reverses a dispatch
  /// does). A row is everything after dim 0; send and recv have the same row shape, dtype and
  /// device; any count may be 0. Recorded as CommOp::all_to_all with send's dtype and numel.
  /// MPI (host memory, cuda tensors staged through it) and NCCL (one group of sends and receives).
  void all_to_all_v(const Tensor& send, std::span<const std::int64_t> send_rows, const Tensor& recv,
                    std::span<const std::int64_t> recv_rows, const Stream& s,
                    std::string_view what = {});
  /// The counts of all_to_all_v's receive side: element s of the result is what rank s passed
  /// here as send_rows[rank()]. An all-to-all of one i32 per rank (counts above INT32_MAX are
  /// refused), recorded as CommOp::all_to_all of dtype i32 and counted (see above).
  std::vector<std::int64_t> all_to_all_counts(std::span<const std::int64_t> send_rows,
                                              std::string_view what = {});
  /// Returns once every rank has called it (and, on NCCL, everything issued before it is done).
  void barrier();

  /// Communication since the last call (definition above); resets the counters.
  CommStats take_stats();

  /// This rank's recent ops (the watchdog prints them when an op hangs): the monitor's, shared
  /// with the rank's other communicators and symmetric memories.
  const FlightRecorder& recorder() const { return recorder_; }
  /// Seconds an op may take before the watchdog aborts the job (0: no watchdog).
  double timeout() const;

 protected:
  Communicator(int rank, int size, const CommOptions& o);

  virtual void do_all_gather(const Tensor& in, const Tensor& out, const Stream& s) = 0;
  virtual void do_reduce_scatter(const Tensor& in, const Tensor& out, const Stream& s) = 0;
  /// `max`: the element-wise maximum instead of the sum.
  virtual void do_all_reduce(const Tensor& t, const Stream& s, bool max) = 0;
  virtual void do_broadcast(const Tensor& t, int root, const Stream& s) = 0;
  virtual void do_sendrecv(const Tensor& send, int dst, const Tensor& recv, int src,
                           const Stream& s) = 0;
  virtual void do_barrier() = 0;
  /// all_to_all_v with counts in elements (rows · row size); called only when has_all_to_all().
  virtual void do_all_to_all_v(const Tensor& send, std::span<const std::int64_t> send_counts,
                               const Tensor& recv, std::span<const std::int64_t> recv_counts,
                               const Stream& s);
  /// Whether this backend implements do_all_to_all_v (MPI and NCCL do).
  virtual bool has_all_to_all() const { return false; }

  /// Whether this backend moves tensors on `d` (MPI: both, staging cuda tensors through the host;
  /// NCCL: cuda only).
  virtual bool accepts(Device d) const = 0;
  /// Called after do_*() returned for op `seq`. Synchronous backends (the default) mark it done;
  /// asynchronous ones track completion themselves and call recorder_.finish() later.
  virtual void issued(std::uint64_t seq);

  /// Starts watching (collective when the communicator makes its own monitor); call at the end
  /// of the derived constructor. `poll` runs on the watchdog thread (see Watchdog::Poll).
  void start_watchdog(std::function<std::string()> poll = {});
  /// With a monitor of its own: waits until every rank has reached it (watched, so that no rank
  /// leaves while another may still need its records; skipped while an exception unwinds). Then
  /// stops watching. Call first thing in the derived destructor.
  void shutdown();
  /// Reports the op being issued as failed: with a watchdog the job is diagnosed and aborted;
  /// without one this throws tpx::Error.
  [[noreturn]] void op_failed(const std::string& why);

  std::shared_ptr<CommMonitor> monitor_;
  bool own_monitor_;
  FlightRecorder& recorder_;  // the monitor's

 private:
  /// Records a new op (or completes the `booked` one) and counts it; nullopt if fault injection
  /// skips it.
  std::optional<std::uint64_t> begin_op(CommOp op, DType dtype, std::int64_t count,
                                        std::uint64_t payload, std::uint64_t bus, int peer = -1,
                                        int src = -1, std::string_view what = {},
                                        std::optional<std::uint64_t> booked = {});
  void end_op(std::uint64_t seq);
  void check_device(const Tensor& t, const char* op, const char* what) const;

  int rank_, size_;
  CommOptions options_;
  // Ops may be issued from more than one thread (a cpu comm stream's thread and the caller's),
  // one at a time; the counters are shared with take_stats() on the caller's thread.
  mutable std::mutex stats_mutex_;
  CommStats stats_;
  std::uint64_t current_seq_ = 0;
  std::map<std::uint64_t, std::int64_t> booked_;  // book()ed ops: seq → collective number
  OpGroup group_;                                 // how the records name this communicator's group
  std::string report_label_;                      // its group's "report" lane: "<group> report"
  int job_rank_;   // this rank in the whole job (what the fault flags name)
  int poll_ = -1;  // the backend's poll, registered with the monitor
};

/// A monitor (the rank's flight recorder and watchdog) over `o.group`, with `o`'s timeout and the
/// ops that `o`'s fault flags name on this rank (collective over the group): what a stage shares
/// between its communicators and symmetric memories (CommOptions::monitor), and what a
/// communicator made without one makes for itself.
std::shared_ptr<CommMonitor> make_comm_monitor(const CommOptions& o);

/// The communicator over MPI_COMM_WORLD for tensors on `device` (collective: every rank calls
/// it). `automatic` picks NCCL for cuda when every rank has its own GPU and MPI (host-staged)
/// otherwise, and name() says which and why. An impossible request (--comm nccl for cpu tensors,
/// in a build without NCCL, or with ranks sharing a GPU) throws tpx::ConfigError with the same
/// one-line message on every rank; NCCL is never initialised then.
std::unique_ptr<Communicator> make_communicator(const CommOptions& o, Device device);

/// Given one identity string per rank (host name and GPU PCI bus id), the first pair of ranks
/// (i < j) with the same identity, if any.
std::optional<std::pair<int, int>> find_shared_device(const std::vector<std::string>& ids);

}  // namespace tpx
