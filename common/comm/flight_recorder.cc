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
    case CommOp::pull:
      return "pull";
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

namespace {

void copy_text(std::string_view text, char* out, std::size_t size) {
  text.copy(out, std::min(text.size(), size - 1));
}

}  // namespace

std::uint64_t FlightRecorder::reserve(CommOp op, std::string_view what, const OpGroup& group) {
  const double t = now();
  std::lock_guard lock(mu_);
  const std::uint64_t seq = next_++;
  OpRecord& r = ring_[seq % ring_.size()];
  r = OpRecord{};
  r.seq = seq;
  r.enqueue_s = t;
  r.op = op;
  r.group_rank = group.name.empty() ? -1 : group.rank;
  copy_text(what, r.what, sizeof r.what);
  copy_text(group.name, r.group, sizeof r.group);
  return seq;
}

void FlightRecorder::fill(std::uint64_t seq, DType dtype, std::int64_t count, std::uint64_t bytes,
                          int peer, int src) {
  std::lock_guard lock(mu_);
  if (OpRecord* r = find(seq)) {
    r->bytes = bytes;
    r->count = count;
    r->peer = peer;
    r->src = src;
    r->dtype = dtype;
    r->sized = true;
  }
}

std::uint64_t FlightRecorder::begin(CommOp op, DType dtype, std::int64_t count, std::uint64_t bytes,
                                    int peer, int src, std::string_view what,
                                    const OpGroup& group) {
  const std::uint64_t seq = reserve(op, what, group);
  fill(seq, dtype, count, bytes, peer, src);
  std::lock_guard lock(mu_);
  if (OpRecord* r = find(seq)) r->src_job = group.job_of(src);
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
  std::string s;
  if (r.op == CommOp::barrier) {
    s = "barrier";
  } else if (r.op == CommOp::signal) {
    s = fmt::format("signal to {} gen {}", r.peer, r.count);
  } else if (r.op == CommOp::signal_wait) {
    s = fmt::format("signal_wait from {} gen {}", r.src, r.count);
  } else if (r.op == CommOp::pull) {
    s = fmt::format("pull {} B from {}", r.bytes, r.src);
  } else {
    s = fmt::format("{} {}[{}] {} B", to_string(r.op), to_string(r.dtype), r.count, r.bytes);
    if (r.op == CommOp::broadcast) s += fmt::format(" root {}", r.peer);
    if (r.op == CommOp::sendrecv || r.op == CommOp::send || r.op == CommOp::recv) {
      if (r.peer >= 0) s += fmt::format(" to {}", r.peer);
      if (r.src >= 0) s += fmt::format(" from {}", r.src);
    }
  }
  if (r.what[0] != '\0') s += fmt::format(" ({})", std::string_view(r.what));
  if (r.group[0] != '\0') s += fmt::format(" in {}", std::string_view(r.group));
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

const OpRecord* oldest_in_flight(const RankOps& r) {
  for (const OpRecord& op : r.ops)
    if (op.state == OpState::in_flight) return &op;
  return nullptr;
}

/// "rank 3", or "rank 3 (rank 1 of dp group 1)" when `op` ran in a group.
std::string rank_words(int rank, const OpRecord* op) {
  if (op == nullptr || op->group[0] == '\0') return fmt::format("rank {}", rank);
  return fmt::format("rank {} (rank {} of {})", rank, op->group_rank, std::string_view(op->group));
}

std::string ranks_words(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "));
}

std::string last_op_words(const RankOps& r) {
  return r.next_seq == 0 ? "it has issued no ops"
                         : fmt::format("its last op is #{}, done", r.next_seq - 1);
}

/// Rule 1 of diagnose(): the first op a responding rank skipped or issued differently.
std::optional<Verdict> first_difference(const std::vector<const RankOps*>& live) {
  std::uint64_t lo = UINT64_MAX, hi = 0;
  for (const RankOps* r : live) {
    lo = std::min(lo, r->ops.empty() ? r->next_seq : r->ops.front().seq);
    hi = std::max(hi, r->next_seq);
  }
  for (std::uint64_t seq = lo; seq < hi; ++seq) {
    std::vector<Entry> entries;
    for (const RankOps* r : live) entries.push_back(entry_at(*r, seq));
    // The expected op: the most common signature among ranks that executed it.
    // A booked op not yet run (not sized) has no sizes to compare: it neither votes nor differs,
    // unless it is another kind of op altogether.
    auto differs = [](const OpRecord& r, const Signature& want) {
      return r.sized ? signature_of(r) != want : r.op != std::get<0>(want);
    };
    std::map<Signature, int> votes;
    for (const Entry& e : entries)
      if (e.kind == Entry::record && e.rec->state != OpState::skipped && e.rec->sized)
        ++votes[signature_of(*e.rec)];
    std::optional<Signature> expected;
    int best = 0;
    for (const auto& [sig, n] : votes)
      if (n > best) best = n, expected = sig;
    const OpRecord* example = nullptr;  // the op as a rank that ran it has it
    for (const Entry& e : entries)
      if (!example && e.kind == Entry::record && e.rec->state != OpState::skipped && expected &&
          e.rec->sized && signature_of(*e.rec) == *expected)
        example = e.rec;

    Verdict v;
    std::vector<std::string> problems;
    const OpRecord* culprit_op = nullptr;
    for (std::size_t i = 0; i < live.size(); ++i) {
      const Entry& e = entries[i];
      if (e.kind != Entry::record) continue;
      const int rank = live[i]->rank;
      if (e.rec->state == OpState::skipped) {
        problems.push_back(fmt::format("{} skipped it", rank_words(rank, e.rec)));
      } else if (expected && differs(*e.rec, *expected)) {
        problems.push_back(
            fmt::format("{} issued {} instead", rank_words(rank, e.rec), describe_op(*e.rec)));
      } else {
        continue;
      }
      v.ranks.push_back(rank);
      if (culprit_op == nullptr) culprit_op = e.rec;
    }
    if (problems.empty()) continue;
    constexpr std::size_t kShown = 4;
    const std::size_t more = problems.size() > kShown ? problems.size() - kShown : 0;
    problems.resize(std::min(problems.size(), kShown));
    v.seq = seq;
    v.text = fmt::format("first difference at op #{} ({}): {}", seq, describe_op(*culprit_op),
                         fmt::join(problems, "; "));
    if (more > 0) v.text += fmt::format("; and {} more rank(s)", more);
    if (example) v.text += fmt::format(" (the others: {})", describe_op(*example));
    return v;
  }
  return std::nullopt;
}

}  // namespace

Verdict diagnose(std::span<const RankOps> ranks) {
  std::vector<const RankOps*> live;
  std::vector<int> silent;
  for (const RankOps& r : ranks) {
    if (r.responded)
      live.push_back(&r);
    else
      silent.push_back(r.rank);
  }
  Verdict v;
  if (auto d = first_difference(live)) return *d;

  // The oldest op in flight on a responding rank: what the job waits in.
  const RankOps* oldest_rank = nullptr;
  const OpRecord* oldest = nullptr;
  for (const RankOps* r : live)
    if (const OpRecord* op = oldest_in_flight(*r); op && (!oldest || op->seq < oldest->seq))
      oldest_rank = r, oldest = op;

  if (!silent.empty()) {
    v.ranks = silent;
    v.text = fmt::format("{} did not answer (stopped, or stuck outside communication)",
                         ranks_words(silent));
    if (oldest) {
      v.seq = oldest->seq;
      v.text += fmt::format("; the others wait in op #{} ({})", oldest->seq, describe_op(*oldest));
    }
    return v;
  }
  if (!oldest) {
    std::uint64_t through = UINT64_MAX;
    for (const RankOps* r : live) through = std::min(through, r->next_seq);
    v.text = fmt::format("the ranks' recorded ops agree and none is in flight (through #{})",
                         through == 0 || through == UINT64_MAX ? 0 : through - 1);
    return v;
  }

  // A wait for a peer's signal is the peer's to end: follow the waits to a rank that is not
  // waiting for another (or back to one already seen).
  auto find_rank = [&](int job_rank) -> const RankOps* {
    for (const RankOps* r : live)
      if (r->rank == job_rank) return r;
    return nullptr;
  };
  std::vector<int> seen{oldest_rank->rank};
  while (oldest->op == CommOp::signal_wait && oldest->src_job >= 0) {
    const RankOps* peer = find_rank(oldest->src_job);
    if (peer == nullptr || std::ranges::find(seen, peer->rank) != seen.end()) break;
    const OpRecord* op = oldest_in_flight(*peer);
    if (op == nullptr) break;
    seen.push_back(peer->rank);
    oldest_rank = peer, oldest = op;
  }

  const std::uint64_t seq = oldest->seq;
  std::vector<int> holding, done, behind;
  const OpRecord* holding_op = oldest;
  for (const RankOps* r : live) {
    const Entry e = entry_at(*r, seq);
    if (e.kind == Entry::not_issued) {
      if (oldest_in_flight(*r) == nullptr) behind.push_back(r->rank);
    } else if (e.kind == Entry::record && e.rec->state == OpState::in_flight) {
      holding.push_back(r->rank);
    } else {
      done.push_back(r->rank);
    }
  }
  v.seq = seq;
  if (!behind.empty()) {
    v.ranks = behind;
    std::vector<std::string> words;
    for (int r : behind)
      words.push_back(fmt::format("{} has not issued it ({})", rank_words(r, nullptr),
                                  last_op_words(*find_rank(r))));
    v.text =
        fmt::format("op #{} ({}) waits: {}", seq, describe_op(*holding_op), fmt::join(words, "; "));
  } else if (!done.empty() || holding.size() == 1) {
    // The op is stuck on the ranks still holding it, and only there.
    v.ranks = {oldest_rank->rank};
    v.text = fmt::format("op #{} ({}) did not complete on {}{}", seq, describe_op(*holding_op),
                         rank_words(oldest_rank->rank, holding_op),
                         done.empty() ? "" : fmt::format("; {} completed it", ranks_words(done)));
  } else {
    v.text = fmt::format("every rank waits in op #{} ({}): none skipped it or issued another", seq,
                         describe_op(*holding_op));
  }
  return v;
}

}  // namespace tpx
