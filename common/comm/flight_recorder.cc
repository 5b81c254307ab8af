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
    case CommOp::all_to_all:
      return "all_to_all";
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

namespace {

bool point_to_point(CommOp op) {
  return op == CommOp::sendrecv || op == CommOp::send || op == CommOp::recv;
}

}  // namespace

std::uint64_t FlightRecorder::reserve(CommOp op, std::string_view what, const OpGroup& group,
                                      int peer, int src) {
  const double t = now();
  // The lane: the group's, or for an op that only sends (or only receives) its link's.
  std::string lane(group.name);
  if (point_to_point(op) && (peer >= 0) != (src >= 0))
    lane += peer >= 0 ? fmt::format(" >{}", group.job_of(peer))
                      : fmt::format(" <{}", group.job_of(src));
  std::lock_guard lock(mu_);
  const std::uint64_t seq = next_++;
  OpRecord& r = ring_[seq % ring_.size()];
  r = OpRecord{};
  r.seq = seq;
  r.enqueue_s = t;
  r.op = op;
  r.group_rank = group.name.empty() ? -1 : group.rank;
  r.peer = peer;
  r.src = src;
  r.peer_job = group.job_of(peer);
  r.src_job = group.job_of(src);
  r.lane_seq = lanes_[lane]++;
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
  const std::uint64_t seq = reserve(op, what, group, peer, src);
  fill(seq, dtype, count, bytes, peer, src);
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

/// A lane: the ops that the same ranks must issue alike, numbered alike. `from`/`to` name a
/// link (job ranks), -1 for a group's lane; `legacy`: records without lane numbers (made by
/// hand), whose lane is the whole job in program order.
struct Lane {
  std::string group;
  int from = -1, to = -1;
  bool legacy = false;
  auto operator<=>(const Lane&) const = default;
  bool link() const { return from >= 0; }
};

Lane lane_of(const OpRecord& r, int rank) {
  if (r.lane_seq == OpRecord::kNoLane) return {"", -1, -1, true};
  Lane l{std::string(r.group), -1, -1, false};
  if (point_to_point(r.op) && (r.peer >= 0) != (r.src >= 0)) {
    l.from = r.peer >= 0 ? rank : r.src_job;
    l.to = r.peer >= 0 ? r.peer_job : rank;
  }
  return l;
}

std::uint64_t index_in_lane(const OpRecord& r) {
  return r.lane_seq == OpRecord::kNoLane ? r.seq : r.lane_seq;
}

/// One rank's entry for one op of a lane.
struct Entry {
  enum Kind { record, evicted, not_issued } kind = record;
  const OpRecord* rec = nullptr;
};

Entry entry_at(const RankOps& r, const Lane& lane, std::uint64_t index) {
  if (lane.legacy) {
    if (index >= r.next_seq) return {Entry::not_issued, nullptr};
    for (const OpRecord& op : r.ops)
      if (op.seq == index) return {Entry::record, &op};
    return {Entry::evicted, nullptr};
  }
  // The rank's retained ops of the lane: the newest of them is its last (older ones leave the
  // ring first); none retained reads as none issued.
  bool any = false;
  std::uint64_t newest = 0;
  for (const OpRecord& op : r.ops) {
    if (op.lane_seq == OpRecord::kNoLane || lane_of(op, r.rank) != lane) continue;
    if (op.lane_seq == index) return {Entry::record, &op};
    any = true;
    newest = std::max(newest, op.lane_seq);
  }
  if (!any || index > newest) return {Entry::not_issued, nullptr};
  return {Entry::evicted, nullptr};
}

/// The group a group lane's ops run in: a communicator's report lane ("dp group 1 report",
/// Communicator::all_gather_report) has the members of the group itself ("dp group 1").
std::string_view group_of_lane(std::string_view name) {
  constexpr std::string_view kReport = " report";
  if (name.ends_with(kReport)) name.remove_suffix(kReport.size());
  return name;
}

/// The ranks that must issue a lane's ops: a link's two ends; a group's members that recorded
/// any op of it, or of the group's other lane (its report lane, or the group's own: a rank whose
/// first report is not issued yet is a member all the same); for records made by hand, every
/// rank.
std::vector<const RankOps*> members_of(const Lane& lane, const std::vector<const RankOps*>& live) {
  std::vector<const RankOps*> out;
  for (const RankOps* r : live) {
    bool in = lane.legacy || r->rank == lane.from || r->rank == lane.to;
    if (!lane.link() && !lane.legacy)
      for (const OpRecord& op : r->ops) {
        if (op.lane_seq == OpRecord::kNoLane) continue;
        const Lane other = lane_of(op, r->rank);
        if (other == lane ||
            (!other.link() && group_of_lane(other.group) == group_of_lane(lane.group))) {
          in = true;
          break;
        }
      }
    if (in) out.push_back(r);
  }
  return out;
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

/// Rule 1 of diagnose() in one lane: the first op a member skipped or issued differently.
std::optional<Verdict> first_difference(const Lane& lane,
                                        const std::vector<const RankOps*>& members,
                                        const OpRecord** culprit) {
  std::uint64_t lo = UINT64_MAX, hi = 0;
  for (const RankOps* r : members) {
    if (lane.legacy) {
      lo = std::min(lo, r->ops.empty() ? r->next_seq : r->ops.front().seq);
      hi = std::max(hi, r->next_seq);
      continue;
    }
    for (const OpRecord& op : r->ops)
      if (op.lane_seq != OpRecord::kNoLane && lane_of(op, r->rank) == lane) {
        lo = std::min(lo, op.lane_seq);
        hi = std::max(hi, op.lane_seq + 1);
      }
  }
  for (std::uint64_t index = lo; index < hi; ++index) {
    std::vector<Entry> entries;
    for (const RankOps* r : members) entries.push_back(entry_at(*r, lane, index));
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
    int example_rank = -1;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const Entry& e = entries[i];
      if (!example && e.kind == Entry::record && e.rec->state != OpState::skipped && expected &&
          e.rec->sized && signature_of(*e.rec) == *expected)
        example = e.rec, example_rank = members[i]->rank;
    }

    Verdict v;
    std::vector<std::string> problems;
    const OpRecord* culprit_op = nullptr;
    for (std::size_t i = 0; i < members.size(); ++i) {
      const Entry& e = entries[i];
      if (e.kind != Entry::record) continue;
      const int rank = members[i]->rank;
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
    v.seq = culprit_op->seq;
    *culprit = culprit_op;
    v.text = fmt::format("first difference at op #{} ({}): {}", culprit_op->seq,
                         describe_op(*culprit_op), fmt::join(problems, "; "));
    if (more > 0) v.text += fmt::format("; and {} more rank(s)", more);
    if (example && lane.link())
      v.text += fmt::format(" (its {}: rank {}'s op #{}, {})",
                            lane.from == example_rank ? "send" : "receive", example_rank,
                            example->seq, describe_op(*example));
    else if (example)
      v.text += fmt::format(" (the others: {})", describe_op(*example));
    return v;
  }
  return std::nullopt;
}

/// Rule 1 over every lane: the difference whose op was enqueued first.
std::optional<Verdict> first_difference(const std::vector<const RankOps*>& live) {
  std::map<Lane, bool> lanes;
  for (const RankOps* r : live)
    for (const OpRecord& op : r->ops) lanes[lane_of(op, r->rank)] = true;
  std::optional<Verdict> best;
  double best_t = 0;
  for (const auto& [lane, _] : lanes) {
    const OpRecord* culprit = nullptr;
    auto v = first_difference(lane, members_of(lane, live), &culprit);
    if (v && (!best || culprit->enqueue_s < best_t))
      best = std::move(v), best_t = culprit->enqueue_s;
  }
  return best;
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

  // The oldest op in flight on a responding rank: what the job waits in (enqueued first; by
  // sequence number among equals).
  const RankOps* oldest_rank = nullptr;
  const OpRecord* oldest = nullptr;
  for (const RankOps* r : live)
    if (const OpRecord* op = oldest_in_flight(*r);
        op &&
        (!oldest || std::tie(op->enqueue_s, op->seq) < std::tie(oldest->enqueue_s, oldest->seq)))
      oldest_rank = r, oldest = op;

  if (!silent.empty()) {
    v.ranks = silent;
    v.text = fmt::format("{} did not answer (stopped, or stuck outside communication)",
                         ranks_words(silent));
    if (oldest) {
      v.seq = oldest->seq;
      v.text += fmt::format("; the others wait in op #{} ({}) on rank {}", oldest->seq,
                            describe_op(*oldest), oldest_rank->rank);
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

  auto find_rank = [&](int job_rank) -> const RankOps* {
    for (const RankOps* r : live)
      if (r->rank == job_rank) return r;
    return nullptr;
  };
  // Follow the waits to a rank that is not waiting for another (or back to one already seen): a
  // wait for a peer's signal is the peer's to end; an op whose lane has a member waiting in
  // another op is that member's.
  std::vector<int> seen{oldest_rank->rank};
  std::vector<int> holding, done, behind;
  for (;;) {
    if (oldest->op == CommOp::signal_wait && oldest->src_job >= 0) {
      const RankOps* peer = find_rank(oldest->src_job);
      const OpRecord* op = peer ? oldest_in_flight(*peer) : nullptr;
      if (op != nullptr && std::ranges::find(seen, peer->rank) == seen.end()) {
        seen.push_back(peer->rank);
        oldest_rank = peer, oldest = op;
        continue;
      }
    }
    const Lane lane = lane_of(*oldest, oldest_rank->rank);
    const std::uint64_t index = index_in_lane(*oldest);
    holding.clear(), done.clear(), behind.clear();
    const RankOps* waiting_elsewhere = nullptr;
    for (const RankOps* r : members_of(lane, live)) {
      const Entry e = entry_at(*r, lane, index);
      if (e.kind == Entry::not_issued) {
        if (oldest_in_flight(*r) == nullptr)
          behind.push_back(r->rank);
        else if (!lane.legacy && waiting_elsewhere == nullptr)
          waiting_elsewhere = r;
      } else if (e.kind == Entry::record && e.rec->state == OpState::in_flight) {
        holding.push_back(r->rank);
      } else {
        done.push_back(r->rank);
      }
    }
    if (!behind.empty() || waiting_elsewhere == nullptr ||
        std::ranges::find(seen, waiting_elsewhere->rank) != seen.end())
      break;
    seen.push_back(waiting_elsewhere->rank);
    oldest_rank = waiting_elsewhere, oldest = oldest_in_flight(*waiting_elsewhere);
  }

  const std::uint64_t seq = oldest->seq;
  const OpRecord* holding_op = oldest;
  v.seq = seq;
  if (!behind.empty()) {
    v.ranks = behind;
    std::vector<std::string> words;
    for (int r : behind)
      words.push_back(fmt::format("{} has not issued it ({})", rank_words(r, nullptr),
                                  last_op_words(*find_rank(r))));
    v.text = fmt::format("op #{} ({}) on rank {} waits: {}", seq, describe_op(*holding_op),
                         oldest_rank->rank, fmt::join(words, "; "));
  } else if (!done.empty() || holding.size() == 1) {
    // The op is stuck on the ranks still holding it, and only there.
    v.ranks = {oldest_rank->rank};
    v.text = fmt::format("op #{} ({}) did not complete on {}{}", seq, describe_op(*holding_op),
                         rank_words(oldest_rank->rank, holding_op),
                         done.empty() ? "" : fmt::format("; {} completed it", ranks_words(done)));
  } else {
    v.text =
        fmt::format("every rank waits in op #{} ({}) on rank {}: none skipped it or issued another",
                    seq, describe_op(*holding_op), oldest_rank->rank);
  }
  return v;
}

}  // namespace tpx
