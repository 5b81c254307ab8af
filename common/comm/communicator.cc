// The backend-independent half of the Communicator: argument checks, accounting, the flight
// recorder and fault injection around every op, and the choice of backend.
#include "communicator.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <exception>
#include <limits>
#include <span>
#include <thread>

#include <fmt/format.h>

#include "backends.h"
#include "common/check.h"
#include "common/checked.h"
#include "watchdog.h"

namespace tpx {

CommKind parse_comm_kind(const std::string& s) {
  if (s == "auto") return CommKind::automatic;
  if (s == "mpi") return CommKind::mpi;
  if (s == "nccl") return CommKind::nccl;
  fail(fmt::format("unknown communicator '{}' (expected auto, mpi or nccl)", s));
}

const char* to_string(CommKind k) {
  switch (k) {
    case CommKind::automatic:
      return "auto";
    case CommKind::mpi:
      return "mpi";
    case CommKind::nccl:
      return "nccl";
  }
  return "?";
}

namespace {

/// --fault-comm-delay-us: op `seq` of job rank `rank` waits 0 … max_us µs, drawn by a hash of
/// the two (splitmix64's finaliser), so the same op waits as long on every run.
std::chrono::microseconds comm_delay(int rank, std::uint64_t seq, int max_us) {
  std::uint64_t z = seq * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(rank) + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return std::chrono::microseconds(z % (static_cast<std::uint64_t>(max_us) + 1));
}

}  // namespace

std::shared_ptr<CommMonitor> make_comm_monitor(const CommOptions& o) {
  TPX_CHECK(o.timeout_s > 0, "the comm timeout must be positive (got {} s)", o.timeout_s);
  const int me = o.group.world_rank_of(o.group.rank());
  auto named = [me](int rank, std::int64_t n) { return rank == me ? n : -1; };
  return std::make_shared<CommMonitor>(
      o.timeout_s, o.group,
      FaultTargets{.job_rank = me,
                   .collective = named(o.fault_rank, o.fault_seq),
                   .signal = named(o.signal_fault_rank, o.signal_fault),
                   .pull = named(o.copy_fault_rank, o.copy_fault)});
}

Communicator::Communicator(int rank, int size, const CommOptions& o)
    : monitor_(o.monitor ? o.monitor : make_comm_monitor(o)),
      own_monitor_(!o.monitor),
      recorder_(monitor_->recorder()),
      rank_(rank),
      size_(size),
      options_(o),
      group_{options_.group_label.empty() ? std::string_view(options_.group.name())
                                          : std::string_view(options_.group_label),
             rank, options_.group.job_ranks()},
      report_label_(fmt::format("{} report", options_.group.name())),
      job_rank_(o.group.world_rank_of(rank)) {
  options_.monitor.reset();  // held once, in monitor_
}

Communicator::~Communicator() = default;

std::vector<double> Communicator::all_gather_report(double mine, std::string_view what) {
  std::vector<double> all(static_cast<std::size_t>(size_), mine);
  all_gather_report(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(all)),
                    what);
  return all;
}

void Communicator::all_gather_report(std::span<const std::byte> mine, std::span<std::byte> all,
                                     std::string_view what) {
  TPX_CHECK(all.size() == mine.size() * std::size_t(size_),
            "report gather of {} B from each of {} ranks into {} B", mine.size(), size_,
            all.size());
  TPX_CHECK(mine.size() <= std::size_t(std::numeric_limits<int>::max()),
            "report gather of {} B: more than an MPI count", mine.size());
  if (size_ == 1) {
    std::ranges::copy(mine, all.begin());
    return;
  }
  // Recorded as fp32 elements (the recorder's unit; a double is two).
  const OpGroup lane{report_label_, group_.rank, group_.jobs};
  const auto bytes = std::uint64_t(all.size());
  const std::uint64_t seq =
      recorder_.begin(CommOp::all_gather, DType::f32, static_cast<std::int64_t>(bytes / 4), bytes,
                      -1, -1, what, lane);
  recorder_.started(seq);
  const int n = static_cast<int>(mine.size());
  const int rc =
      MPI_Allgather(mine.data(), n, MPI_BYTE, all.data(), n, MPI_BYTE, options_.group.comm());
  recorder_.finish(seq, rc == MPI_SUCCESS ? OpState::done : OpState::failed);
  TPX_MPI_CHECK(rc);
}

double Communicator::timeout() const {
  return monitor_->timeout();
}

void Communicator::start_watchdog(std::function<std::string()> poll) {
  if (poll) poll_ = monitor_->add_poll(std::move(poll));
}

void Communicator::shutdown() {
  if (poll_ >= 0) monitor_->remove_poll(std::exchange(poll_, -1));
  if (own_monitor_ && std::uncaught_exceptions() == 0 && size_ > 1) monitor_->barrier();
}

std::uint64_t Communicator::book(CommOp op, std::string_view what, int peer, int src) {
  const std::uint64_t seq = recorder_.reserve(op, what, group_, peer, src);
  std::lock_guard lock(stats_mutex_);
  booked_.emplace(seq, monitor_->next(CommMonitor::Kind::collective));
  return seq;
}

void Communicator::issued(std::uint64_t seq) {
  recorder_.finish(seq, OpState::done);
}

void Communicator::op_failed(const std::string& why) {
  std::uint64_t seq = 0;
  {
    std::lock_guard lock(stats_mutex_);
    seq = current_seq_;
  }
  monitor_->fail_op(seq, why);
}

std::optional<std::uint64_t> Communicator::begin_op(CommOp op, DType dtype, std::int64_t count,
                                                    std::uint64_t payload, std::uint64_t bus,
                                                    int peer, int src, std::string_view what,
                                                    std::optional<std::uint64_t> booked) {
  std::uint64_t seq = 0;
  std::int64_t nth = 0;  // the rank's how-manyth collective this is
  if (booked) {
    seq = *booked;
    recorder_.fill(seq, dtype, count, payload, peer, src);
    std::lock_guard lock(stats_mutex_);
    const auto node = booked_.extract(seq);
    nth = node ? node.mapped() : -1;
  } else {
    seq = recorder_.begin(op, dtype, count, payload, peer, src, what, group_);
    nth = monitor_->next(CommMonitor::Kind::collective);
  }
  // Fault injection: this rank silently skips the op, when another rank takes part in it.
  const bool peers = op == CommOp::sendrecv
                         ? (peer >= 0 && peer != rank_) || (src >= 0 && src != rank_)
                         : size_ > 1;
  if (monitor_->strikes(CommMonitor::Kind::collective, nth, seq, peers)) {
    recorder_.finish(seq, OpState::skipped);
    return std::nullopt;
  }
  {
    std::lock_guard lock(stats_mutex_);
    stats_.payload_bytes += payload;
    stats_.bus_bytes += bus;
    stats_.calls += 1;
    current_seq_ = seq;
  }
  if (options_.comm_delay_us > 0)  // fault injection: the lane runs late
    std::this_thread::sleep_for(comm_delay(job_rank_, seq, options_.comm_delay_us));
  recorder_.started(seq);
  return seq;
}

void Communicator::end_op(std::uint64_t seq) {
  issued(seq);
}

void Communicator::check_device(const Tensor& t, const char* op, const char* what) const {
  if (!t.defined()) fail(fmt::format("{}: the {} tensor is undefined", op, what));
  if (!accepts(t.device()))
    fail(fmt::format("{}: {} cannot move {} tensors ({} is {})", op, name(), to_string(t.device()),
                     what, t.describe()));
}

namespace {

/// Sums are of f32 or bf16 tensors (a bf16 sum adds in fp32 at each hop and rounds once, as
/// NCCL does); maxima of f32 ones. FP8 codes are moved, never reduced.
void check_summable(const Tensor& t, const char* op, bool sum = true) {
  if (t.dtype() != DType::f32 && !(sum && t.dtype() == DType::bf16))
    fail(
        fmt::format("{} reduces {} tensors only; got {} (cast first, or use all_gather to move "
                    "fp8 bytes)",
                    op, sum ? "f32 and bf16" : "f32", t.describe()));
}

/// full = N·part along dim 0 (or at least in element count when the ranks differ).
void check_split(const Tensor& part, const Tensor& full, int n, const char* op) {
  const bool ok =
      part.dtype() == full.dtype() && part.device() == full.device() &&
      full.numel() == n * part.numel() &&
      (part.ndim() != full.ndim() || part.ndim() == 0 || full.dim(0) == n * part.dim(0));
  if (!ok)
    fail(
        fmt::format("{} over {} ranks needs the full tensor to be {} x the part along dim 0 with "
                    "the same dtype and device; got part {} and full {}",
                    op, n, n, part.describe(), full.describe()));
}

void check_rank(int r, int n, const char* op, const char* what) {
  if (r < 0 || r >= n) fail(fmt::format("{}: {} rank {} is not in [0, {})", op, what, r, n));
}

std::uint64_t ring_share(std::uint64_t bytes, int n, int factor) {
  return bytes * static_cast<std::uint64_t>(factor) * static_cast<std::uint64_t>(n - 1) /
         static_cast<std::uint64_t>(n);
}

}  // namespace

void Communicator::all_gather(const Tensor& in, const Tensor& out, const Stream& s,
                              std::optional<std::uint64_t> booked) {
  check_device(in, "all_gather", "input");
  check_device(out, "all_gather", "output");
  check_split(in, out, size_, "all_gather");
  const std::uint64_t payload = out.nbytes();
  const auto seq = begin_op(CommOp::all_gather, in.dtype(), out.numel(), payload,
                            ring_share(payload, size_, 1), -1, -1, {}, booked);
  if (!seq) return;
  do_all_gather(in, out, s);
  end_op(*seq);
}

void Communicator::reduce_scatter(const Tensor& in, const Tensor& out, const Stream& s,
                                  std::optional<std::uint64_t> booked) {
  check_device(in, "reduce_scatter", "input");
  check_device(out, "reduce_scatter", "output");
  check_summable(in, "reduce_scatter");
  check_split(out, in, size_, "reduce_scatter");
  const std::uint64_t payload = in.nbytes();
  const auto seq = begin_op(CommOp::reduce_scatter, in.dtype(), in.numel(), payload,
                            ring_share(payload, size_, 1), -1, -1, {}, booked);
  if (!seq) return;
  do_reduce_scatter(in, out, s);
  end_op(*seq);
}

void Communicator::all_reduce(const Tensor& t, const Stream& s) {
  check_device(t, "all_reduce", "input");
  check_summable(t, "all_reduce");
  const std::uint64_t payload = t.nbytes();
  const auto seq =
      begin_op(CommOp::all_reduce, t.dtype(), t.numel(), payload, ring_share(payload, size_, 2));
  if (!seq) return;
  do_all_reduce(t, s, /*max=*/false);
  end_op(*seq);
}

void Communicator::all_reduce_max(const Tensor& t, const Stream& s) {
  check_device(t, "all_reduce_max", "input");
  check_summable(t, "all_reduce_max", /*sum=*/false);
  const std::uint64_t payload = t.nbytes();
  const auto seq = begin_op(CommOp::all_reduce_max, t.dtype(), t.numel(), payload,
                            ring_share(payload, size_, 2));
  if (!seq) return;
  do_all_reduce(t, s, /*max=*/true);
  end_op(*seq);
}

void Communicator::broadcast(const Tensor& t, int root, const Stream& s) {
  check_device(t, "broadcast", "input");
  check_rank(root, size_, "broadcast", "root");
  const std::uint64_t payload = t.nbytes();
  const auto seq =
      begin_op(CommOp::broadcast, t.dtype(), t.numel(), payload, size_ > 1 ? payload : 0, root);
  if (!seq) return;
  do_broadcast(t, root, s);
  end_op(*seq);
}

void Communicator::sendrecv(const Tensor& send, int dst, const Tensor& recv, int src,
                            const Stream& s, std::string_view what,
                            std::optional<std::uint64_t> booked) {
  if (send.defined()) {
    check_device(send, "sendrecv", "send");
    check_rank(dst, size_, "sendrecv", "destination");
  }
  if (recv.defined()) {
    check_device(recv, "sendrecv", "receive");
    check_rank(src, size_, "sendrecv", "source");
  }
  if (send.defined() && recv.defined() && send.device() != recv.device())
    fail(fmt::format("sendrecv: send {} and receive {} must be on the same device", send.describe(),
                     recv.describe()));
  const std::uint64_t payload = send.defined() ? send.nbytes() : 0;
  const Tensor& any = send.defined() ? send : recv;
  const auto seq = begin_op(CommOp::sendrecv, any.defined() ? any.dtype() : DType::f32,
                            send.defined() ? send.numel() : 0, payload,
                            send.defined() && dst != rank_ ? payload : 0, send.defined() ? dst : -1,
                            recv.defined() ? src : -1, what, booked);
  if (!seq) return;
  do_sendrecv(send, dst, recv, src, s);
  end_op(*seq);
}

namespace {

/// The rows of `counts` (one per rank of an all-to-all of n ranks), checked: n of them, none
/// negative, their sum returned.
std::int64_t check_rows(std::span<const std::int64_t> counts, int n, const char* side) {
  if (counts.size() != static_cast<std::size_t>(n))
    fail(fmt::format("all_to_all_v: {} {} counts for {} ranks", counts.size(), side, n));
  std::int64_t sum = 0;
  for (std::size_t d = 0; d < counts.size(); ++d) {
    if (counts[d] < 0)
      fail(fmt::format("all_to_all_v: {} count {} for rank {}", side, counts[d], d));
    const auto next = checked_add(sum, counts[d]);
    if (!next) fail(fmt::format("all_to_all_v: the {} counts overflow a 64-bit sum", side));
    sum = *next;
  }
  return sum;
}

/// The elements in one row (everything after dim 0) of t.
std::int64_t row_numel(const Tensor& t) {
  std::int64_t n = 1;
  for (int i = 1; i < t.ndim(); ++i) n = checked_product({n, t.dim(i)}, "all_to_all_v's row size");
  return n;
}

}  // namespace

void Communicator::all_to_all_v(const Tensor& send, std::span<const std::int64_t> send_rows,
                                const Tensor& recv, std::span<const std::int64_t> recv_rows,
                                const Stream& s, std::string_view what) {
  check_device(send, "all_to_all_v", "send");
  check_device(recv, "all_to_all_v", "receive");
  if (!has_all_to_all())
    fail(fmt::format("all_to_all_v: {} has no all-to-all yet; use --comm mpi", name()));
  if (send.ndim() < 1 || recv.ndim() < 1 || send.dtype() != recv.dtype() ||
      send.device() != recv.device() ||
      Tensor::Shape(send.shape().begin() + 1, send.shape().end()) !=
          Tensor::Shape(recv.shape().begin() + 1, recv.shape().end()))
    fail(
        fmt::format("all_to_all_v needs send and receive tensors of the same row shape (after "
                    "dim 0), dtype and device; got send {} and receive {}",
                    send.describe(), recv.describe()));
  if (check_rows(send_rows, size_, "send") != send.dim(0) ||
      check_rows(recv_rows, size_, "receive") != recv.dim(0))
    fail(
        fmt::format("all_to_all_v: the send counts must sum to send's {} rows and the receive "
                    "counts to receive's {} rows",
                    send.dim(0), recv.dim(0)));
  const std::int64_t row = row_numel(send);
  std::vector<std::int64_t> send_counts(send_rows.size()), recv_counts(recv_rows.size());
  std::int64_t away = 0;  // rows that leave this rank
  for (int d = 0; d < size_; ++d) {
    send_counts[static_cast<std::size_t>(d)] =
        checked_product({send_rows[static_cast<std::size_t>(d)], row}, "all_to_all_v's send count");
    recv_counts[static_cast<std::size_t>(d)] = checked_product(
        {recv_rows[static_cast<std::size_t>(d)], row}, "all_to_all_v's receive count");
    if (d != rank_) away += send_rows[static_cast<std::size_t>(d)];
  }
  const std::uint64_t payload = send.nbytes();
  const std::uint64_t bus = static_cast<std::uint64_t>(
      checked_product({away, row, static_cast<std::int64_t>(dtype_size(send.dtype()))},
                      "all_to_all_v's bus bytes"));
  const auto seq =
      begin_op(CommOp::all_to_all, send.dtype(), send.numel(), payload, bus, -1, -1, what);
  if (!seq) return;
  do_all_to_all_v(send, send_counts, recv, recv_counts, s);
  end_op(*seq);
}

std::vector<std::int64_t> Communicator::all_to_all_counts(std::span<const std::int64_t> send_rows,
                                                          std::string_view what) {
  if (!has_all_to_all())
    fail(fmt::format("all_to_all_counts: {} has no all-to-all yet; use --comm mpi", name()));
  if (!accepts(Device::cpu))
    fail(fmt::format(
        "all_to_all_counts: {} moves device memory only; exchange the counts as a device tensor "
        "with all_to_all_v",
        name()));
  check_rows(send_rows, size_, "send");
  const Tensor send = Tensor::empty({size_}, DType::i32), recv = Tensor::zeros({size_}, DType::i32);
  for (int d = 0; d < size_; ++d) {
    const std::int64_t c = send_rows[static_cast<std::size_t>(d)];
    if (c > std::numeric_limits<std::int32_t>::max())
      fail(fmt::format("all_to_all_counts: {} rows for rank {} exceed the i32 count", c, d));
    send.data<std::int32_t>()[d] = static_cast<std::int32_t>(c);
  }
  const std::vector<std::int64_t> one(static_cast<std::size_t>(size_), 1);
  const std::uint64_t payload = send.nbytes();
  const auto seq = begin_op(CommOp::all_to_all, DType::i32, size_, payload,
                            payload - dtype_size(DType::i32), -1, -1, what);
  std::vector<std::int64_t> out(static_cast<std::size_t>(size_), 0);
  if (!seq) return out;
  do_all_to_all_v(send, one, recv, one, Stream());
  end_op(*seq);
  for (int d = 0; d < size_; ++d) out[static_cast<std::size_t>(d)] = recv.data<std::int32_t>()[d];
  return out;
}

void Communicator::do_all_to_all_v(const Tensor&, std::span<const std::int64_t>, const Tensor&,
                                   std::span<const std::int64_t>, const Stream&) {
  fail(fmt::format("all_to_all_v: {} has no all-to-all yet", name()));
}

void Communicator::barrier() {
  const auto seq = begin_op(CommOp::barrier, DType::f32, 0, 0, 0);
  if (!seq) return;
  do_barrier();
  end_op(*seq);
}

CommStats Communicator::take_stats() {
  std::lock_guard lock(stats_mutex_);
  const CommStats s = stats_;
  stats_ = {};
  return s;
}

std::optional<std::pair<int, int>> find_shared_device(const std::vector<std::string>& ids) {
  for (std::size_t j = 0; j < ids.size(); ++j)
    for (std::size_t i = 0; i < j; ++i)
      if (ids[i] == ids[j]) return std::pair{static_cast<int>(i), static_cast<int>(j)};
  return std::nullopt;
}

namespace {

#if TPX_WITH_NCCL
/// Every rank's local_gpu_identity(), gathered over `group` (collective over it).
std::vector<std::string> gather_gpu_identities(const RankGroup& group) {
  constexpr int kLen = 512;
  std::array<char, kLen> mine{};
  const std::string id = local_gpu_identity();
  id.copy(mine.data(), kLen - 1);
  const int n = group.size();
  std::vector<char> all(static_cast<std::size_t>(n) * kLen);
  TPX_MPI_CHECK(
      MPI_Allgather(mine.data(), kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, group.comm()));
  std::vector<std::string> ids;
  for (int r = 0; r < n; ++r) ids.emplace_back(all.data() + std::size_t(r) * kLen);
  return ids;
}
#endif

}  // namespace

std::unique_ptr<Communicator> make_communicator(const CommOptions& o, Device device) {
  if (device == Device::cpu) {
    if (o.kind == CommKind::nccl)
      throw ConfigError(
          "--comm nccl moves device memory and needs --device cuda; use --comm mpi "
          "or auto for the cpu backend");
    return make_mpi_communicator(o, "mpi (host memory)");
  }
#if !TPX_WITH_NCCL
  if (o.kind == CommKind::nccl)
    throw ConfigError(
        "--comm nccl: this build has no NCCL (configure with NCCL available, or use "
        "--comm mpi or auto)");
  return make_mpi_communicator(o, "mpi (host-staged; this build has no NCCL)");
#else
  if (o.kind == CommKind::mpi) return make_mpi_communicator(o, "mpi (host-staged)");
  // NCCL refuses two ranks on one GPU; find out before it is ever initialised.
  const std::vector<std::string> ids = gather_gpu_identities(o.group);
  if (const auto shared = find_shared_device(ids)) {
    const auto [a, b] = *shared;
    if (o.kind == CommKind::nccl)
      throw ConfigError(fmt::format(
          "--comm nccl needs one GPU per rank, but ranks {} and {} share GPU {}; use --comm "
          "auto or mpi (host-staged collectives)",
          a, b, ids[static_cast<std::size_t>(a)]));
    return make_mpi_communicator(
        o, fmt::format("mpi (host-staged: ranks {} and {} share a GPU, NCCL needs one per rank)", a,
                       b));
  }
  return make_nccl_communicator(o);
#endif
}

std::unique_ptr<ZeroCtaComm> make_zero_cta_comm(const CommOptions& o, Device device) {
  constexpr const char* flag = "--all-gather nccl-zero-cta";
  if (device == Device::cpu)
    throw ConfigError(fmt::format("{} moves GPU memory and needs --device cuda", flag));
#if !TPX_WITH_NCCL
  (void)o;
  throw ConfigError(fmt::format(
      "{}: this build has no NCCL (the hand-built pulls, --all-gather pulls, need none)", flag));
#else
  constexpr int kZeroCta = 22800;  // NCCL 2.28.0: the first with NCCL_CTA_POLICY_ZERO
  auto version = [](int v) { return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100); };
  if (nccl_version(/*built=*/true) < kZeroCta)
    throw ConfigError(fmt::format("{} needs NCCL >= 2.28; this build's is {}", flag,
                                  version(nccl_version(/*built=*/true))));
  int oldest = nccl_version();  // the ranks may load different libraries: the oldest decides
  TPX_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &oldest, 1, MPI_INT, MPI_MIN, o.group.comm()));
  if (oldest < kZeroCta)
    throw ConfigError(
        fmt::format("{} needs NCCL >= 2.28 on every rank; found {}", flag, version(oldest)));
  const std::vector<std::string> ids = gather_gpu_identities(o.group);
  if (const auto shared = find_shared_device(ids)) {
    const auto [a, b] = *shared;
    throw ConfigError(fmt::format(
        "{} needs one GPU per rank (NCCL refuses two ranks on one device), but ranks {} and {} "
        "share GPU {}; the hand-built pulls (--all-gather pulls) run there",
        flag, a, b, ids[static_cast<std::size_t>(a)]));
  }
  return make_nccl_zero_cta_comm(o);
#endif
}

}  // namespace tpx
