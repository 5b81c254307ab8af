#include "watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx {
namespace {

constexpr int kTagRequest = 4401;  // "send me your records"; payload: the requester's rank
constexpr int kTagReply = 4402;    // ReplyHeader followed by the records

/// Header of a reply; the records follow it as raw OpRecord bytes. `now` is the replying rank's
/// clock when it answered: its records' ages are printed against it.
struct ReplyHeader {
  std::int32_t rank;
  std::int32_t role;
  std::uint64_t next_seq;
  std::uint64_t count;
  double now;
};

double now() {
  return FlightRecorder::now();
}

void sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

/// Prints `text` (the verdict first), flushed, and ends the job. The pause lets mpirun forward
/// the text before the abort's own lines (its MPI_ABORT box, ORTE_ERROR_LOG), which it prints as
/// soon as the abort reaches it.
[[noreturn]] void abort_job(const std::string& text) {
  std::fflush(stdout);
  fmt::print(stderr, "{}{}", text, text.ends_with('\n') ? "" : "\n");
  std::fflush(stderr);
  sleep_ms(200);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

}  // namespace

double Watchdog::grace_seconds(double timeout_s) {
  return std::clamp(timeout_s / 4, 0.5, 5.0);
}

bool Watchdog::supported() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}

namespace {

/// How every line of a group's watchdog starts: the whole job's ranks need no words; a group's
/// are its own numbers, so the line names the group and the job ranks they stand for.
std::string watchdog_prefix(const RankGroup& g) {
  if (g.is_world()) return "tpx: comm watchdog";
  std::string ranks;
  for (int r = 0; r < g.size(); ++r) ranks += fmt::format("{}{}", r ? "," : "", g.world_rank_of(r));
  return fmt::format("tpx: comm watchdog ({}: its ranks 0..{} are job ranks {})", g.name(),
                     g.size() - 1, ranks);
}

}  // namespace

Watchdog::Watchdog(const FlightRecorder& recorder, double timeout_s, Poll poll,
                   const RankGroup& group)
    : prefix_(watchdog_prefix(group)),
      recorder_(recorder),
      timeout_s_(timeout_s),
      grace_s_(grace_seconds(timeout_s)),
      poll_(std::move(poll)) {
  TPX_CHECK(timeout_s > 0, "the comm timeout must be positive (got {})", timeout_s);
  TPX_CHECK(supported(), "the comm watchdog needs MPI_THREAD_MULTIPLE");
  TPX_MPI_CHECK(MPI_Comm_dup(group.comm(), &comm_));
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  TPX_MPI_CHECK(
      MPI_Irecv(&request_buf_, 1, MPI_INT, MPI_ANY_SOURCE, kTagRequest, comm_, &request_));
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&request_);
    MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  for (auto& [req, buf] : outgoing_) MPI_Wait(&req, MPI_STATUS_IGNORE);
  MPI_Comm_free(&comm_);
}

void Watchdog::barrier() {
  TPX_MPI_CHECK(MPI_Barrier(comm_));
}

void Watchdog::fail_op(std::uint64_t seq, const std::string& why) {
  {
    std::lock_guard lock(mu_);
    if (!failure_) failure_ = Failure{seq, why};
  }
  cv_.notify_all();
  // The watchdog thread diagnoses and ends the job; should that not happen, end it from here.
  std::this_thread::sleep_for(std::chrono::duration<double>(2 * grace_s_ + 10.0));
  abort_job(fmt::format("{}: rank {}: op #{} failed: {}", prefix_, rank_, seq, why));
}

void Watchdog::pause() {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(5), [this] { return stop_ || failure_; });
}

void Watchdog::run() {
  try {
    while (!stop_) {
      const std::string backend_error = poll_ ? poll_() : std::string();
      service_requests();
      std::optional<Failure> failure;
      {
        std::lock_guard lock(mu_);
        failure = failure_;
      }
      if (failure || !backend_error.empty()) {
        const std::string why = failure ? failure->why : backend_error;
        OpRecord op;
        const auto ops = recorder_.snapshot();
        if (failure) {
          op.seq = failure->seq;
          for (const OpRecord& r : ops)
            if (r.seq == failure->seq) op = r;
        } else if (auto oldest = recorder_.oldest_in_flight()) {
          op = *oldest;
        } else if (!ops.empty()) {
          op = ops.back();
        }
        report(op, fmt::format("op #{} failed on rank {}: {}", op.seq, rank_, why));
      }
      if (auto op = recorder_.oldest_in_flight(); op && now() - op->enqueue_s > timeout_s_)
        report(*op, fmt::format("an op did not complete in {:.1f} s", timeout_s_));
      pause();
    }
  } catch (const std::exception& e) {
    abort_job(fmt::format("{}: rank {}: internal error: {}", prefix_, rank_, e.what()));
  }
}

void Watchdog::service_requests() {
  for (;;) {
    int done = 0;
    MPI_Status status;
    TPX_MPI_CHECK(MPI_Test(&request_, &done, &status));
    if (!done) break;
    reply_to(status.MPI_SOURCE);
    TPX_MPI_CHECK(
        MPI_Irecv(&request_buf_, 1, MPI_INT, MPI_ANY_SOURCE, kTagRequest, comm_, &request_));
  }
  std::erase_if(outgoing_, [](auto& o) {
    int done = 0;
    MPI_Test(&o.first, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
}

namespace {

/// A rank's last ops as its dump prints them under `headline`: the last 64, and further back to
/// a few before the oldest that is not done (skipped, in flight, failed); the analysis reads the
/// whole ring. Ages are counted back from `now`, the rank's own clock when it took the records.
std::string dump_text(const std::string& headline, const std::vector<OpRecord>& ops, double now,
                      int rank) {
  constexpr std::ptrdiff_t kShown = 64, kContext = 8;
  const auto n = static_cast<std::ptrdiff_t>(ops.size());
  const auto open =
      std::ranges::find_if(ops, [](const OpRecord& r) { return r.state != OpState::done; });
  const std::ptrdiff_t first =
      std::max<std::ptrdiff_t>(0, std::min(open - ops.begin() - kContext, n - kShown));
  return headline + "\n" +
         format_ops(std::span(ops).subspan(static_cast<std::size_t>(first)), now,
                    fmt::format("[rank {}] ", rank));
}

}  // namespace

void Watchdog::reply_to(int requester) {
  // A rank asked for our records: another rank is diagnosing, so this one stays passive (it
  // will not print the verdict line) unless it is already diagnosing itself. It prints nothing:
  // the reporter prints the verdict first, then every rank's records it was sent.
  int expected = static_cast<int>(Role::watching);
  role_.compare_exchange_strong(expected, static_cast<int>(Role::passive));
  const auto ops = recorder_.snapshot();
  const ReplyHeader h{rank_, role_.load(), recorder_.next_seq(), ops.size(), now()};
  std::vector<char> buf(sizeof h + ops.size() * sizeof(OpRecord));
  std::memcpy(buf.data(), &h, sizeof h);
  if (!ops.empty()) std::memcpy(buf.data() + sizeof h, ops.data(), ops.size() * sizeof(OpRecord));
  outgoing_.emplace_back(MPI_REQUEST_NULL, std::move(buf));
  auto& [req, data] = outgoing_.back();
  TPX_MPI_CHECK(MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_BYTE, requester,
                          kTagReply, comm_, &req));
}

void Watchdog::wait_to_be_killed(double seconds, const std::string& line) {
  // Keep answering the reporter; it ends the job. If it cannot, end it from here.
  const double deadline = now() + seconds;
  while (now() < deadline) {
    service_requests();
    sleep_ms(5);
  }
  abort_job(line + " (the reporting rank did not end the job)\n" +
            dump_text(fmt::format("{}: rank {} last ops:", prefix_, rank_), recorder_.snapshot(),
                      now(), rank_));
}

void Watchdog::report(const OpRecord& op, const std::string& trigger) {
  const std::string op_words =
      fmt::format("op #{} ({}) on rank {} is the oldest in flight", op.seq, describe_op(op), rank_);
  int expected = static_cast<int>(Role::watching);
  if (!role_.compare_exchange_strong(expected, static_cast<int>(Role::reporting))) {
    // Another rank already asked for our records and is diagnosing; it ends the job.
    wait_to_be_killed(grace_s_ + 10.0, fmt::format("{}: {}; {}", prefix_, trigger, op_words));
  }

  // Ask every other rank for its records; wait for the answers until the grace deadline.
  const std::size_t max_bytes = sizeof(ReplyHeader) + recorder_.capacity() * sizeof(OpRecord);
  std::vector<std::vector<char>> replies(static_cast<std::size_t>(size_));
  std::vector<MPI_Request> recvs(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  std::vector<MPI_Request> asks(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  std::vector<bool> answered(static_cast<std::size_t>(size_), false);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto i = static_cast<std::size_t>(r);
    replies[i].resize(max_bytes);
    TPX_MPI_CHECK(MPI_Irecv(replies[i].data(), static_cast<int>(max_bytes), MPI_BYTE, r, kTagReply,
                            comm_, &recvs[i]));
    TPX_MPI_CHECK(MPI_Isend(&rank_, 1, MPI_INT, r, kTagRequest, comm_, &asks[i]));
  }
  const double deadline = now() + grace_s_;
  for (;;) {
    int pending = 0;
    for (int r = 0; r < size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == rank_ || answered[i]) continue;
      int done = 0;
      TPX_MPI_CHECK(MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE));
      if (done)
        answered[i] = true;
      else
        ++pending;
    }
    service_requests();
    if (pending == 0 || now() > deadline) break;
    sleep_ms(2);
  }

  std::vector<RankOps> ranks(static_cast<std::size_t>(size_));
  std::vector<double> clocks(static_cast<std::size_t>(size_), 0.0);  // each reply's `now`
  std::vector<int> silent;
  int printer = rank_;
  for (int r = 0; r < size_; ++r) {
    const auto i = static_cast<std::size_t>(r);
    RankOps& ro = ranks[i];
    ro.rank = r;
    if (r == rank_) {
      ro.responded = true;
      ro.ops = recorder_.snapshot();
      ro.next_seq = recorder_.next_seq();
      clocks[i] = now();
      continue;
    }
    if (!answered[i]) {
      silent.push_back(r);
      continue;
    }
    ReplyHeader h;
    std::memcpy(&h, replies[i].data(), sizeof h);
    ro.responded = true;
    ro.next_seq = h.next_seq;
    clocks[i] = h.now;
    ro.ops.resize(h.count);
    if (h.count > 0)
      std::memcpy(ro.ops.data(), replies[i].data() + sizeof h, h.count * sizeof(OpRecord));
    if (h.role == static_cast<int>(Role::reporting)) printer = std::min(printer, r);
  }

  // The verdict depends on the records alone, so whichever rank prints it, it reads the same.
  const Verdict v = diagnose(ranks);
  std::string line = fmt::format("{}: {}; {}", prefix_, trigger, v.text);
  if (!silent.empty()) line += fmt::format(" (no answer within {:.1f} s)", grace_s_);
  if (printer == rank_) {
    // The verdict first, then the records it was read from: this rank's, and each answer's.
    std::string text = line + "\n";
    for (const RankOps& ro : ranks) {
      if (!ro.responded) continue;
      const std::string headline =
          ro.rank == rank_ ? fmt::format("{}: rank {} last ops (it reports: {}; {}):", prefix_,
                                         rank_, trigger, op_words)
                           : fmt::format("{}: rank {} last ops (as it answered rank {}):", prefix_,
                                         ro.rank, rank_);
      text += dump_text(headline, ro.ops, clocks[static_cast<std::size_t>(ro.rank)], ro.rank);
    }
    abort_job(text);
  }
  // A lower rank is diagnosing the same hang and prints the line; give it time to end the job.
  wait_to_be_killed(grace_s_ + 10.0, line);
}

// --- the monitor ---------------------------------------------------------------------------------

CommMonitor::CommMonitor(double timeout_s, const RankGroup& group, const FaultTargets& faults)
    : timeout_s_(timeout_s), faults_(faults) {
  if (timeout_s > 0 && Watchdog::supported())
    watchdog_ = std::make_unique<Watchdog>(
        recorder_, timeout_s, [this] { return poll_all(); }, group);
}

CommMonitor::~CommMonitor() = default;

int CommMonitor::add_poll(Watchdog::Poll poll) {
  std::lock_guard lock(polls_mu_);
  polls_.emplace(next_poll_, std::move(poll));
  return next_poll_++;
}

void CommMonitor::remove_poll(int id) {
  std::lock_guard lock(polls_mu_);
  polls_.erase(id);
}

std::string CommMonitor::poll_all() {
  std::lock_guard lock(polls_mu_);
  for (auto& [id, poll] : polls_)
    if (std::string why = poll(); !why.empty()) return why;
  return {};
}

void CommMonitor::fail_op(std::uint64_t seq, const std::string& why) {
  recorder_.finish(seq, OpState::failed);
  if (watchdog_) watchdog_->fail_op(seq, why);
  fail(fmt::format("comm op #{} failed: {}", seq, why));
}

namespace {

/// How fault_report() words a fault flag of each kind (CommMonitor::Kind's order).
struct FaultWords {
  const char* flag;
  const char* noun;  // what the flag counts
  const char* verb;  // what it does to the op it names
};
constexpr std::array<FaultWords, 3> kFaultWords{
    {{"--fault-skip-collective", "collective", "skipped"},
     {"--fault-skip-signal", "signal", "skipped"},
     {"--fault-delay-copy", "pull", "delayed"}}};

}  // namespace

bool CommMonitor::strikes(Kind k, std::int64_t nth, std::uint64_t seq, bool peers) {
  const auto i = static_cast<std::size_t>(k);
  const std::array<std::int64_t, 3> target{faults_.collective, faults_.signal, faults_.pull};
  if (target[i] < 0 || nth != target[i]) return false;
  FaultOutcome outcome{peers ? FaultOutcome::State::struck : FaultOutcome::State::no_peers, seq,
                       fmt::format("op #{}", seq)};
  for (const OpRecord& r : recorder_.snapshot())
    if (r.seq == seq) outcome.op = fmt::format("op #{}: {}", seq, describe_op(r));
  std::lock_guard lock(faults_mu_);
  outcomes_[i] = std::move(outcome);
  return peers;
}

std::string CommMonitor::fault_report() const {
  const std::array<std::int64_t, 3> target{faults_.collective, faults_.signal, faults_.pull};
  std::string text;
  std::lock_guard lock(faults_mu_);
  for (std::size_t i = 0; i < target.size(); ++i) {
    if (target[i] < 0) continue;
    const FaultWords& w = kFaultWords[i];
    const FaultOutcome& o = outcomes_[i];
    const std::string named = fmt::format("{} {}:{}", w.flag, faults_.job_rank, target[i]);
    std::string line;
    switch (o.state) {
      case FaultOutcome::State::pending: {
        const std::int64_t issued = counters_[i].load();
        line = fmt::format("{} never fired: rank {} issued {}", named, faults_.job_rank,
                           issued == 0 ? fmt::format("no {}s", w.noun)
                                       : fmt::format("{} {}{} (0 … {})", issued, w.noun,
                                                     issued == 1 ? "" : "s", issued - 1));
        break;
      }
      case FaultOutcome::State::no_peers:
        line = fmt::format(
            "{} did not fire: rank {}'s {} {} ({}) has no other rank taking part, so none could "
            "notice it missing; it ran",
            named, faults_.job_rank, w.noun, target[i], o.op);
        break;
      case FaultOutcome::State::struck:
        line = fmt::format(
            "{} {} rank {}'s {} {} ({}), and the job still ran to its end: no rank noticed, so "
            "its results are not to be trusted",
            named, w.verb, faults_.job_rank, w.noun, target[i], o.op);
        break;
    }
    text += (text.empty() ? "" : "; ") + line;
  }
  return text;
}

void CommMonitor::barrier() {
  if (!watchdog_) return;
  const std::uint64_t seq = recorder_.begin(CommOp::barrier, DType::f32, 0, 0);
  recorder_.started(seq);
  watchdog_->barrier();
  recorder_.finish(seq, OpState::done);
}

}  // namespace tpx
