#include "flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx {

const char* to_string(CommOp op) {
  switch (op) {
    case CommOp::all_gather:
      return "all_gather";
    case CommOp::reduce_scatter:
      return "reduce_scatter";
    case CommOp::all_reduce:
      return "all_reduce";
    case CommOp::all_reduce_max:
      return "all_reduce_max";
    case CommOp::broadcast:
      return "broadcast";
    case CommOp::send:
      return "send";
    case CommOp::recv:
      return "recv";
    case CommOp::sendrecv:
      return "sendrecv";
    case CommOp::barrier:
      return "barrier";
    case CommOp::signal:
      return "signal";
    case CommOp::signal_wait:
      return "signal_wait";
  }
  return "?";
}

const char* to_string(OpState s) {
  switch (s) {
    case OpState::in_flight:
      return "in flight";
    case OpState::done:
      return "done";
    case OpState::skipped:
      return "skipped";
    case OpState::failed:
      return "failed";
  }
  return "?";
}

FlightRecorder::FlightRecorder(std::size_t capacity) : ring_(capacity) {
  TPX_CHECK(capacity > 0, "a flight recorder needs room for at least one op");
}

double FlightRecorder::now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::uint64_t FlightRecorder::begin(CommOp op, DType dtype, std::int64_t count, std::uint64_t bytes,
                                    int peer, int src, std::string_view what) {
  const double t = now();
  std::lock_guard lock(mu_);
  const std::uint64_t seq = next_++;
  OpRecord& r = ring_[seq % ring_.size()];
  r = OpRecord{};
  r.seq = seq;
  r.bytes = bytes;
  r.count = count;
  r.enqueue_s = t;
  r.peer = peer;
  r.src = src;
  r.op = op;
  r.dtype = dtype;
  what.copy(r.what, std::min(what.size(), sizeof r.what - 1));
  return seq;
}

OpRecord* FlightRecorder::find(std::uint64_t seq) {
  if (seq >= next_ || next_ - seq > ring_.size()) return nullptr;
  return &ring_[seq % ring_.size()];
}

void FlightRecorder::started(std::uint64_t seq) {
  const double t = now();
  std::lock_guard lock(mu_);
  if (OpRecord* r = find(seq)) r->start_s = t;
}

void FlightRecorder::finish(std::uint64_t seq, OpState state) {
  const double t = now();
  std::lock_guard lock(mu_);
  if (OpRecord* r = find(seq)) {
    r->state = state;
    r->end_s = t;
  }
}

std::vector<OpRecord> FlightRecorder::snapshot() const {
  std::lock_guard lock(mu_);
  const std::uint64_t n = std::min<std::uint64_t>(next_, ring_.size());
  std::vector<OpRecord> out;
  out.reserve(n);
  for (std::uint64_t seq = next_ - n; seq < next_; ++seq) out.push_back(ring_[seq % ring_.size()]);
  return out;
}

std::uint64_t FlightRecorder::next_seq() const {
  std::lock_guard lock(mu_);
  return next_;
}

std::optional<OpRecord> FlightRecorder::oldest_in_flight() const {
  std::lock_guard lock(mu_);
  const std::uint64_t n = std::min<std::uint64_t>(next_, ring_.size());
  for (std::uint64_t seq = next_ - n; seq < next_; ++seq) {
    const OpRecord& r = ring_[seq % ring_.size()];
    if (r.state == OpState::in_flight) return r;
  }
  return std::nullopt;
}

std::string describe_op(const OpRecord& r) {
  if (r.op == CommOp::barrier) return "barrier";
  if (r.op == CommOp::signal || r.op == CommOp::signal_wait) {
    std::string s = r.op == CommOp::signal
                        ? fmt::format("signal to {} gen {}", r.peer, r.count)
                        : fmt::format("signal_wait from {} gen {}", r.src, r.count);
    if (r.what[0] != '\0') s += fmt::format(" ({})", std::string_view(r.what));
    return s;
  }
  std::string s =
      fmt::format("{} {}[{}] {} B", to_string(r.op), to_string(r.dtype), r.count, r.bytes);
  if (r.op == CommOp::broadcast) s += fmt::format(" root {}", r.peer);
  if (r.op == CommOp::sendrecv || r.op == CommOp::send || r.op == CommOp::recv) {
    if (r.peer >= 0) s += fmt::format(" to {}", r.peer);
    if (r.src >= 0) s += fmt::format(" from {}", r.src);
  }
  if (r.what[0] != '\0') s += fmt::format(" ({})", std::string_view(r.what));
  return s;
}

std::string format_ops(std::span<const OpRecord> ops, double now, const std::string& prefix) {
  if (ops.empty()) return prefix + "(no ops recorded)\n";
  std::string out;
  auto ago = [now](double t) { return t < 0 ? std::string("-") : fmt::format("{:.3f}", now - t); };
  out += fmt::format("{}{:>6}  {:<64} {:>10} {:>10} {:>10}  {}\n", prefix, "seq", "op", "enqueued",
                     "started", "ended", "state (times: seconds ago)");
  for (const OpRecord& r : ops)
    out += fmt::format("{}{:>6}  {:<64} {:>10} {:>10} {:>10}  {}\n", prefix,
                       fmt::format("#{}", r.seq), describe_op(r), ago(r.enqueue_s), ago(r.start_s),
                       ago(r.end_s), to_string(r.state));
  return out;
}

namespace {

/// What must match across ranks for one op. Point-to-point ops legitimately differ in peers and
/// sizes between ranks, so only the op itself is compared for them.
using Signature = std::tuple<CommOp, DType, std::uint64_t, int>;

Signature signature_of(const OpRecord& r) {
  switch (r.op) {
    case CommOp::all_gather:
    case CommOp::reduce_scatter:
    case CommOp::all_reduce:
    case CommOp::all_reduce_max:
      return {r.op, r.dtype, r.bytes, -1};
    case CommOp::broadcast:
      return {r.op, r.dtype, r.bytes, r.peer};
    default:
      return {r.op, DType::f32, 0, -1};
  }
}

/// One rank's entry for one sequence number.
struct Entry {
  enum Kind { record, evicted, not_issued } kind = record;
  const OpRecord* rec = nullptr;
};

Entry entry_at(const RankOps& r, std::uint64_t seq) {
  if (seq >= r.next_seq) return {Entry::not_issued, nullptr};
  for (const OpRecord& op : r.ops)
    if (op.seq == seq) return {Entry::record, &op};
  return {Entry::evicted, nullptr};
}

std::string last_op_words(const RankOps& r) {
  return r.next_seq == 0 ? "it has issued no ops"
                         : fmt::format("its last op is #{}", r.next_seq - 1);
}

}  // namespace

Disagreement find_disagreement(std::span<const RankOps> ranks) {
  std::vector<const RankOps*> live;
  for (const RankOps& r : ranks)
    if (r.responded) live.push_back(&r);
  Disagreement d;
  if (live.empty()) return d;

  std::uint64_t lo = UINT64_MAX, hi = 0, min_next = UINT64_MAX;
  for (const RankOps* r : live) {
    lo = std::min(lo, r->ops.empty() ? r->next_seq : r->ops.front().seq);
    hi = std::max(hi, r->next_seq);
    min_next = std::min(min_next, r->next_seq);
  }
  for (std::uint64_t seq = lo; seq < hi; ++seq) {
    std::vector<Entry> entries;
    for (const RankOps* r : live) entries.push_back(entry_at(*r, seq));

    // The expected op: the most common signature among ranks that executed it.
    std::map<Signature, int> votes;
    for (const Entry& e : entries)
      if (e.kind == Entry::record && e.rec->state != OpState::skipped)
        ++votes[signature_of(*e.rec)];
    std::optional<Signature> expected;
    const OpRecord* example = nullptr;
    int best = 0;
    for (const auto& [sig, n] : votes)
      if (n > best) best = n, expected = sig;
    for (const Entry& e : entries)
      if (e.kind == Entry::record && expected && signature_of(*e.rec) == *expected) example = e.rec;

    std::vector<std::string> problems;
    for (std::size_t i = 0; i < live.size(); ++i) {
      const RankOps& r = *live[i];
      const Entry& e = entries[i];
      if (e.kind == Entry::not_issued) {
        problems.push_back(fmt::format("rank {} has not issued it ({})", r.rank, last_op_words(r)));
      } else if (e.kind == Entry::record && e.rec->state == OpState::skipped) {
        problems.push_back(fmt::format("rank {} skipped it", r.rank));
      } else if (e.kind == Entry::record && expected && signature_of(*e.rec) != *expected) {
        problems.push_back(fmt::format("rank {} issued {} instead", r.rank, describe_op(*e.rec)));
      }
    }
    if (problems.empty()) continue;

    constexpr std::size_t kShown = 4;
    const std::size_t more = problems.size() > kShown ? problems.size() - kShown : 0;
    problems.resize(std::min(problems.size(), kShown));
    d.seq = seq;
    d.detail = fmt::format("{}", fmt::join(problems, "; "));
    if (more > 0) d.detail += fmt::format("; and {} more rank(s)", more);
    if (example) d.detail += fmt::format(" (the others: {})", describe_op(*example));
    return d;
  }
  d.agreed_through = min_next == 0 ? 0 : min_next - 1;
  return d;
}

}  // namespace tpx
