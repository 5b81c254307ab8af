#include "09_pipeline_parallel/channels.h"

#include <cstddef>
#include <deque>
#include <map>
#include <utility>

#include "common/check.h"

namespace tpx::pipeline {

int channel_colors(int ranks) {
  TPX_CHECK(ranks >= 1, "a pipeline of {} ranks", ranks);
  if (ranks == 1) return 1;
  return ranks % 2 == 0 ? 2 : 3;
}

int channel_color(int sender, int ranks) {
  TPX_CHECK(sender >= 0 && sender < ranks, "pipeline rank {} of {}", sender, ranks);
  if (ranks % 2 == 1 && ranks > 1 && sender == ranks - 1) return 2;  // it sends to rank 0 too
  return sender % 2;
}

std::string color_name(int color) {
  switch (color) {
    case 0:
      return "even";
    case 1:
      return "odd";
    default:
      return "last";
  }
}

namespace {

/// One transfer as a rank issues it: the transfer, and how many of the rank's actions must be
/// done before it may start.
struct Issued {
  Transfer x;
  std::size_t after = 0;
};

/// A rank's transfers in the executor's order of issue (Executor::run): at action i, the
/// receives of actions i … i + kReceivesAhead not posted yet (behind a mark of the actions before
/// i), then, after the action, its sends.
std::vector<Issued> issue_order(const Schedule& schedule, int rank) {
  const std::size_t n = schedule.actions(rank).size();
  std::vector<std::vector<Transfer>> receives(n), sends(n);
  for (const Transfer& x : transfers(schedule, rank))
    (x.send ? sends : receives)[x.action].push_back(x);
  std::vector<Issued> order;
  std::size_t posted = 0;  // receives of actions before this one are posted
  for (std::size_t i = 0; i < n; ++i) {
    for (; posted < n && posted <= i + kReceivesAhead; ++posted)
      for (const Transfer& x : receives[posted]) order.push_back({x, i});
    for (const Transfer& x : sends[i]) order.push_back({x, i + 1});
  }
  return order;
}

}  // namespace

std::vector<Transfer> fifo_deadlock(const Schedule& schedule, const QueueOf& queue_of) {
  const int ranks = schedule.shape().ranks;
  // Each rank's queues, and where every receive waits (by tag: the same on both sides).
  std::vector<std::map<int, std::deque<Issued>>> queues(static_cast<std::size_t>(ranks));
  std::vector<std::vector<int>> waiting(
      static_cast<std::size_t>(ranks));                               // receives pending per action
  std::map<int, std::pair<int, int>> receive_at;                      // tag -> (rank, queue)
  std::vector<std::size_t> done(static_cast<std::size_t>(ranks), 0);  // actions run, per rank
  for (int r = 0; r < ranks; ++r) {
    waiting[std::size_t(r)].assign(schedule.actions(r).size(), 0);
    for (const Issued& op : issue_order(schedule, r)) {
      const int q = queue_of(r, op.x);
      queues[std::size_t(r)][q].push_back(op);
      if (!op.x.send) {
        ++waiting[std::size_t(r)][op.x.action];
        receive_at[op.x.tag] = {r, q};
      }
    }
  }
  auto started = [&](int r, const Issued& op) { return done[std::size_t(r)] >= op.after; };
  for (bool progress = true; progress;) {
    progress = false;
    // Compute: each rank runs its next actions while their messages are in.
    for (int r = 0; r < ranks; ++r) {
      const auto& wait = waiting[std::size_t(r)];
      while (done[std::size_t(r)] < wait.size() && wait[done[std::size_t(r)]] == 0) {
        ++done[std::size_t(r)];
        progress = true;
      }
    }
    // Messages: a send at the head of its queue meets its receive at the head of the peer's.
    for (int r = 0; r < ranks; ++r)
      for (auto& [q, fifo] : queues[std::size_t(r)]) {
        if (fifo.empty() || !fifo.front().x.send || !started(r, fifo.front())) continue;
        const Transfer& x = fifo.front().x;
        const auto [peer, peer_q] = receive_at.at(x.tag);
        auto& other = queues[std::size_t(peer)][peer_q];
        if (other.empty() || other.front().x.tag != x.tag || !started(peer, other.front()))
          continue;
        --waiting[std::size_t(peer)][other.front().x.action];
        other.pop_front();
        fifo.pop_front();
        progress = true;
      }
  }
  std::vector<Transfer> stuck;
  for (const auto& rank_queues : queues)
    for (const auto& [q, fifo] : rank_queues)
      for (const Issued& op : fifo) stuck.push_back(op.x);
  return stuck;
}

}  // namespace tpx::pipeline
