// The pipeline schedules (09_pipeline_parallel/schedule.h) without a model or MPI: the order of
// every micro-batch's passes, the messages, the live counts, the simulated bubble against each
// paper's formula over a sweep of P, M and V, the simulator on timelines worked by hand, the
// layer split, the errors, tools/tpx_schedule's output against the library, and the
// communicators the messages travel on (channels.h) against the executor's order of issue.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "09_pipeline_parallel/channels.h"
#include "09_pipeline_parallel/schedule.h"
#include "common/check.h"
#include "test_util.h"

namespace tpx {
namespace {

namespace pl = pipeline;
using pl::Action;
using pl::Phase;
using pl::PipelineShape;

// Every (schedule, P, M, V) the sweep covers: P = 1 … 5, M = 1 … 12 (interleaved: multiples of
// P, V = 2 … 4).
struct Case {
  std::string name;
  PipelineShape shape;
};

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (int P = 1; P <= 5; ++P)
    for (int M : {1, 2, 3, 4, 5, 6, 8, 12}) {
      for (const char* name : {"gpipe", "1f1b", "zb-h1"}) cases.push_back({name, {P, M, 1}});
      if (M % P == 0)
        for (int V = 2; V <= 4; ++V) cases.push_back({"interleaved-1f1b", {P, M, V}});
    }
  return cases;
}

std::string label(const Case& c) {
  return fmt::format("{} P={} M={} V={}", c.name, c.shape.ranks, c.shape.microbatches,
                     c.shape.stages_per_rank);
}

// Where each (phase, micro-batch, stage) sits in its rank's list; fails on a repeat.
std::map<std::tuple<Phase, int, int>, std::size_t> positions(const pl::Schedule& s, int rank) {
  std::map<std::tuple<Phase, int, int>, std::size_t> pos;
  const auto& list = s.actions(rank);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const bool fresh =
        pos.emplace(std::tuple{list[i].phase, list[i].microbatch, list[i].stage}, i).second;
    EXPECT_TRUE(fresh) << s.name() << " rank " << rank << " repeats "
                       << pl::to_string(list[i], true);
  }
  return pos;
}

TEST(Schedule, EveryPassOnceForwardBeforeBackwardBeforeWeight) {
  for (const Case& c : sweep()) {
    SCOPED_TRACE(label(c));
    const auto s = pl::make_schedule(c.name, c.shape);
    const int P = c.shape.ranks, M = c.shape.microbatches, V = c.shape.stages_per_rank;
    EXPECT_EQ(s->split_backward(), c.name == "zb-h1");
    for (int p = 0; p < P; ++p) {
      const auto pos = positions(*s, p);
      const std::size_t per_mb = s->split_backward() ? 3 : 2;
      EXPECT_EQ(s->actions(p).size(), per_mb * static_cast<std::size_t>(M * V));
      for (int v = 0; v < V; ++v)
        for (int m = 0; m < M; ++m) {
          const int stage = p + v * P;  // rank p holds p, p+P, …
          const auto f = pos.find({Phase::forward, m, stage});
          const auto b = pos.find({Phase::backward, m, stage});
          ASSERT_NE(f, pos.end()) << "F" << m << "@" << stage << " missing on rank " << p;
          ASSERT_NE(b, pos.end()) << "B" << m << "@" << stage << " missing on rank " << p;
          EXPECT_LT(f->second, b->second) << "rank " << p << " mb " << m << " stage " << stage;
          const auto w = pos.find({Phase::weight, m, stage});
          if (s->split_backward()) {
            ASSERT_NE(w, pos.end()) << "W" << m << "@" << stage << " missing on rank " << p;
            EXPECT_LT(b->second, w->second) << "rank " << p << " mb " << m;
          } else {
            EXPECT_EQ(w, pos.end());
          }
        }
    }
  }
}

TEST(Schedule, GPipeAndOneFOneBOrdersAsTheirPapersDescribe) {
  // GPipe: all forwards, then all backwards. 1F1B: P−p−1 warm-up forwards, then F and B
  // alternating, then the remaining backwards (written out by hand for P = 2, M = 3).
  const auto g = pl::make_schedule("gpipe", {3, 4, 1});
  for (int p = 0; p < 3; ++p) {
    const auto& list = g->actions(p);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(list[i].phase, i < 4 ? Phase::forward : Phase::backward);
      EXPECT_EQ(list[i].microbatch, i % 4);
    }
  }
  const auto s = pl::make_schedule("1f1b", {2, 3, 1});
  auto text = [](const pl::Schedule& sc, int p) {
    std::vector<std::string> t;
    for (const Action& a : sc.actions(p)) t.push_back(pl::to_string(a, false));
    return fmt::format("{}", fmt::join(t, " "));
  };
  EXPECT_EQ(text(*s, 0), "F0 F1 B0 F2 B1 B2");
  EXPECT_EQ(text(*s, 1), "F0 B0 F1 B1 F2 B2");
  // ZB-H1 at P = 2, M = 3: rank 0 owes no W; rank 1 runs its first B without its W.
  const auto z = pl::make_schedule("zb-h1", {2, 3, 1});
  EXPECT_EQ(text(*z, 0), "F0 F1 B0 W0 F2 B1 W1 B2 W2");
  EXPECT_EQ(text(*z, 1), "F0 B0 F1 B1 W0 F2 B2 W1 W2");
}

TEST(Schedule, ZeroBubbleIsOneFOneBWithTheWeightGradientsMoved) {
  // Without its W's, ZB-H1 runs exactly 1F1B's F's and B's, and the W's come in micro-batch
  // order.
  for (int P = 1; P <= 5; ++P)
    for (int M = 1; M <= 9; ++M) {
      SCOPED_TRACE(fmt::format("P={} M={}", P, M));
      const auto z = pl::make_schedule("zb-h1", {P, M, 1});
      const auto o = pl::make_schedule("1f1b", {P, M, 1});
      for (int p = 0; p < P; ++p) {
        std::vector<Action> fb, w;
        for (const Action& a : z->actions(p)) (a.phase == Phase::weight ? w : fb).push_back(a);
        EXPECT_EQ(fb, o->actions(p)) << "rank " << p;
        for (int m = 0; m < M; ++m) EXPECT_EQ(w.at(m).microbatch, m);
      }
    }
}

TEST(Schedule, InterleavedHoldsStagesRoundRobinAndGoesInGroupsOfP) {
  const PipelineShape sh{2, 4, 2};
  EXPECT_EQ(sh.stages_of(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(sh.stages_of(1), (std::vector<int>{1, 3}));
  const auto s = pl::make_schedule("interleaved-1f1b", sh);
  // Rank 0's forwards, in order: micro-batches 0, 1 on stage 0, then on stage 2, then 2, 3 on
  // stage 0, then on stage 2 (groups of P = 2).
  std::vector<std::pair<int, int>> fwd;
  for (const Action& a : s->actions(0))
    if (a.phase == Phase::forward) fwd.emplace_back(a.microbatch, a.stage);
  EXPECT_EQ(fwd, (std::vector<std::pair<int, int>>{
                     {0, 0}, {1, 0}, {0, 2}, {1, 2}, {2, 0}, {3, 0}, {2, 2}, {3, 2}}));
  std::vector<std::pair<int, int>> bwd;
  for (const Action& a : s->actions(0))
    if (a.phase == Phase::backward) bwd.emplace_back(a.microbatch, a.stage);
  EXPECT_EQ(bwd, (std::vector<std::pair<int, int>>{
                     {0, 2}, {1, 2}, {0, 0}, {1, 0}, {2, 2}, {3, 2}, {2, 0}, {3, 0}}));
  // Warm-up: 2·(P−p−1) + (V−1)·P forwards before the first backward.
  for (int p = 0; p < 2; ++p) {
    const auto& list = s->actions(p);
    const auto first_b = std::find_if(list.begin(), list.end(),
                                      [](const Action& a) { return a.phase == Phase::backward; });
    EXPECT_EQ(first_b - list.begin(), 2 * (2 - p - 1) + (2 - 1) * 2 + 1) << "rank " << p;
  }
}

TEST(Schedule, SendsMatchReceivesInOrderAndAtTheirActions) {
  for (const Case& c : sweep()) {
    SCOPED_TRACE(label(c));
    const auto s = pl::make_schedule(c.name, c.shape);
    const int P = c.shape.ranks, M = c.shape.microbatches, S = c.shape.stages();
    // channel (from rank, to rank, payload) → tags in posting order, from each side
    std::map<std::tuple<int, int, pl::Payload>, std::vector<int>> sent, received;
    std::set<int> tags;
    int messages = 0;
    for (int p = 0; p < P; ++p)
      for (const pl::Transfer& t : pl::transfers(*s, p)) {
        const Action& a = s->actions(p).at(t.action);
        EXPECT_EQ(a.microbatch, t.microbatch);
        EXPECT_NE(t.peer, p);
        EXPECT_EQ(std::abs(t.from_stage - t.to_stage), 1);
        // An activation goes up a stage and is made by F, consumed by F; a gradient goes down,
        // made and consumed by B.
        EXPECT_EQ(t.payload == pl::Payload::activation, t.to_stage == t.from_stage + 1);
        EXPECT_EQ(a.phase, t.payload == pl::Payload::activation ? Phase::forward : Phase::backward);
        EXPECT_EQ(a.stage, t.send ? t.from_stage : t.to_stage);
        EXPECT_EQ(t.peer, (t.send ? t.to_stage : t.from_stage) % P);
        if (t.send) {
          sent[{p, t.peer, t.payload}].push_back(t.tag);
          EXPECT_TRUE(tags.insert(t.tag).second) << "tag " << t.tag << " sent twice";
          ++messages;
        } else {
          received[{t.peer, p, t.payload}].push_back(t.tag);
        }
      }
    // Every send has its receive, and each channel receives in the order it sends.
    EXPECT_EQ(sent, received);
    // With P > 1 every boundary between virtual stages crosses ranks: one activation and one
    // gradient per micro-batch and boundary (V times 1F1B's count, less one boundary).
    EXPECT_EQ(messages, P > 1 ? 2 * M * (S - 1) : 0);
  }
}

// --- the communicators a pipeline's messages travel on (channels.h) -----------------------------

/// A transfer's queue on its rank: one of the payload's communicators, or a lane.
int payload_queue(const pl::Transfer& x, int within) {
  return 8 * static_cast<int>(x.payload) + within;
}

TEST(Channels, NoRankSendsAndReceivesOnOneCommunicator) {
  for (int P = 1; P <= 7; ++P) {
    EXPECT_EQ(pl::channel_colors(P), P == 1 ? 1 : P % 2 == 0 ? 2 : 3) << "P " << P;
    for (int r = 0; r < P; ++r) {
      const int color = pl::channel_color(r, P);
      EXPECT_LT(color, pl::channel_colors(P));
      // A rank sends to r ± 1 (mod P, a wrapped message with V > 1) and receives from them.
      if (P > 1) {
        EXPECT_NE(color, pl::channel_color((r + 1) % P, P)) << "P " << P << " rank " << r;
        EXPECT_NE(color, pl::channel_color((r + P - 1) % P, P)) << "P " << P << " rank " << r;
      }
    }
  }
}

TEST(Channels, OneCommunicatorPerPayloadDeadlocksInterleaving) {
  // What NCCL would do with one communicator per payload (one queue for a rank's sends and
  // receives): the executor's receive posted one action ahead blocks the send its peer needs.
  const auto s = pl::make_schedule("interleaved-1f1b", {2, 2, 2});
  const auto stuck =
      pl::fifo_deadlock(*s, [](int, const pl::Transfer& x) { return payload_queue(x, 0); });
  ASSERT_FALSE(stuck.empty());
  // Rank 0 waits for F0@1's output before it sends F1@0's, which rank 1 waits for first.
  EXPECT_TRUE(std::ranges::any_of(stuck, [](const pl::Transfer& x) {
    return x.send && x.payload == pl::Payload::activation && x.microbatch == 1 && x.from_stage == 0;
  }));
}

TEST(Channels, TheColorsAndTheLanesNeverDeadlock) {
  int one_queue_stuck = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(label(c));
    const auto s = pl::make_schedule(c.name, c.shape);
    const int P = c.shape.ranks;
    // NCCL: the communicator of the sender's color, for each payload.
    const auto colors = pl::fifo_deadlock(*s, [P](int rank, const pl::Transfer& x) {
      return payload_queue(x, pl::channel_color(x.send ? rank : x.peer, P));
    });
    EXPECT_TRUE(colors.empty()) << colors.size() << " messages stuck";
    // MPI: a send lane and a receive lane per payload, each a thread of its own.
    const auto lanes = pl::fifo_deadlock(
        *s, [](int, const pl::Transfer& x) { return payload_queue(x, x.send ? 1 : 0); });
    EXPECT_TRUE(lanes.empty()) << lanes.size() << " messages stuck";
    one_queue_stuck += pl::fifo_deadlock(
                           *s,
                           [](int, const pl::Transfer& x) {
                             return payload_queue(x, 0);
                           }).empty()
                           ? 0
                           : 1;
  }
  // The check can tell: one queue per payload deadlocks somewhere in the sweep.
  EXPECT_GT(one_queue_stuck, 0);
}

TEST(Schedule, LiveActivationCountsPerRank) {
  for (const Case& c : sweep()) {
    SCOPED_TRACE(label(c));
    const auto s = pl::make_schedule(c.name, c.shape);
    const int P = c.shape.ranks, M = c.shape.microbatches, V = c.shape.stages_per_rank;
    const std::vector<int> peak = pl::peak_live(*s);
    ASSERT_EQ(peak.size(), static_cast<std::size_t>(P));
    for (int p = 0; p < P; ++p) {
      const std::vector<int> counts = pl::live_counts(*s, p);
      ASSERT_EQ(counts.size(), s->actions(p).size());
      EXPECT_EQ(counts.back(), 0) << "rank " << p << " ends with live activations";
      EXPECT_EQ(peak[p], *std::max_element(counts.begin(), counts.end()));
      if (c.name == "gpipe") {
        EXPECT_EQ(peak[p], M) << "rank " << p;
      }
      if (c.name == "1f1b") {
        EXPECT_LE(peak[p], P - p) << "rank " << p;
        EXPECT_EQ(peak[p], std::min(P - p, M)) << "rank " << p;
      }
      // ZB-H1 holds the owed W's activations: P on every rank, 1F1B's peak (rank 0's).
      if (c.name == "zb-h1") {
        EXPECT_EQ(peak[p], std::min(P, M)) << "rank " << p;
      }
      // Interleaved: the warm-up's forwards plus one, in virtual-stage units (1/V each).
      if (c.name == "interleaved-1f1b") {
        EXPECT_EQ(peak[p], std::min(2 * (P - p - 1) + (V - 1) * P + 1, M * V)) << "rank " << p;
      }
    }
    if (c.name == "zb-h1") {
      const auto one = pl::peak_live(*pl::make_schedule("1f1b", c.shape));
      EXPECT_EQ(*std::max_element(peak.begin(), peak.end()),
                *std::max_element(one.begin(), one.end()));
    }
  }
  // GPipe's peak grows with M, 1F1B's does not.
  EXPECT_LT(pl::peak_live(*pl::make_schedule("gpipe", {4, 4, 1}))[0],
            pl::peak_live(*pl::make_schedule("gpipe", {4, 8, 1}))[0]);
  EXPECT_EQ(pl::peak_live(*pl::make_schedule("1f1b", {4, 4, 1}))[0],
            pl::peak_live(*pl::make_schedule("1f1b", {4, 8, 1}))[0]);
}

// The bubble each paper derives, written here from the papers rather than taken from the
// library: GPipe and 1F1B (P−1)/(M+P−1); interleaved (P−1)/(V·M+P−1) (the derivation is in
// schedule.cc); ZB-H1 (P−1)(F+B−W) / (M(F+B+W) + (P−1)(F+B−W)) for M ≥ P.
double paper_bubble(const Case& c, const pl::Costs& k) {
  const double P = c.shape.ranks, M = c.shape.microbatches, V = c.shape.stages_per_rank;
  if (c.name == "interleaved-1f1b") return (P - 1) / (V * M + P - 1);
  if (c.name == "zb-h1") {
    const double wait = (P - 1) * (k.forward + k.backward - k.weight);
    return wait / (M * (k.forward + k.backward + k.weight) + wait);
  }
  return (P - 1) / (M + P - 1);
}

// Costs::stage_work: an action on stage s lasts its phase's cost times the stage's work; all
// ones is the unweighted simulation; and a last stage that carries the output layer's cost is
// the pipeline's bottleneck, so moving a block off it shortens the step.
TEST(Simulator, StageWorkScalesEachStagesActions) {
  for (const std::string name : {"gpipe", "1f1b", "zb-h1"}) {
    SCOPED_TRACE(name);
    const auto s = pl::make_schedule(name, {4, 8, 1});
    EXPECT_EQ(pl::simulate(*s, {}, {1, 1, 1, 1}).makespan, pl::simulate(*s).makespan);
    const pl::Costs k{1, 2, 1, 0};
    const std::vector<double> work = {3, 1, 2, 0.5};
    const pl::SimResult r = pl::simulate(*s, k, work);
    for (int p = 0; p < 4; ++p)
      for (const pl::TimedAction& t : r.timeline[std::size_t(p)]) {
        const double phase = t.action.phase == Phase::forward ? k.forward
                             : t.action.phase == Phase::weight
                                 ? k.weight
                                 : k.backward + (s->split_backward() ? 0.0 : k.weight);
        EXPECT_DOUBLE_EQ(t.end - t.start, phase * work[std::size_t(t.action.stage)]);
      }
    // L = 8 over P = 4, the output layer worth two blocks on the last stage: the even split
    // 2, 2, 2, 2 makes the last stage's work 4; --last-stage-layers 1 gives 3, 2, 2, 1, work at
    // most 3. Every micro-batch passes the slowest stage, so the step is at least
    // M · (F + B + W) · the largest work, and it falls with it.
    using Split = std::vector<pl::LayerRange>;
    const Split even = pl::split_layers(8, 4, "--pp 4");
    const Split relieved = pl::split_layers(8, 4, "--pp 4", {.last = 1});
    EXPECT_EQ(relieved, (Split{{0, 3}, {3, 2}, {5, 2}, {7, 1}}));
    const std::vector<double> head = pl::stage_work(even, 0.0, 2.0);
    const std::vector<double> moved = pl::stage_work(relieved, 0.0, 2.0);
    EXPECT_EQ(head, (std::vector<double>{2, 2, 2, 4}));
    EXPECT_EQ(moved, (std::vector<double>{3, 2, 2, 3}));
    const pl::SimResult before = pl::simulate(*s, {}, head), after = pl::simulate(*s, {}, moved);
    EXPECT_GE(before.makespan, 8 * 3 * 4.0);
    EXPECT_GE(after.makespan, 8 * 3 * 3.0);
    EXPECT_LT(after.makespan, before.makespan);
    // The same work in all over a shorter step: the bubble shrinks with the makespan.
    EXPECT_LT(after.bubble(), before.bubble());
  }
  EXPECT_THROW((void)pl::simulate(*pl::make_schedule("1f1b", {2, 2, 1}), {}, {1, 1, 1}), Error);
}

TEST(Simulator, BubbleEqualsEachPapersFormula) {
  // Unit costs, a backward twice a forward, W half of B, F or B three times W: the formulas
  // hold for each (ZB-H1's needs W ≤ F, B).
  const std::vector<pl::Costs> costs = {{1, 1, 1, 0},   {1, 2, 1, 0}, {2, 2, 1, 0},
                                        {1, 1, 0.5, 0}, {3, 1, 1, 0}, {1, 3, 1, 0}};
  int zb_checked = 0;
  for (const Case& c : sweep())
    for (const pl::Costs& k : costs) {
      SCOPED_TRACE(fmt::format("{} F={} B={} W={}", label(c), k.forward, k.backward, k.weight));
      const auto s = pl::make_schedule(c.name, c.shape);
      const pl::SimResult r = pl::simulate(*s, k);
      // The bubble is Σ idle / (P · makespan), every rank doing all its work.
      const double per_microbatch = k.forward + k.backward + k.weight;  // fused or split
      for (int p = 0; p < c.shape.ranks; ++p)
        EXPECT_DOUBLE_EQ(r.busy[p],
                         per_microbatch * c.shape.microbatches * c.shape.stages_per_rank);
      if (c.name == "zb-h1" && c.shape.microbatches < c.shape.ranks) {
        // Outside the formula's range (no W to owe on every rank): still below 1F1B's.
        EXPECT_TRUE(std::isnan(s->formula_bubble(k)));
        EXPECT_LT(r.bubble(), (c.shape.ranks - 1.0) / (c.shape.microbatches + c.shape.ranks - 1.0));
        continue;
      }
      zb_checked += c.name == "zb-h1";
      EXPECT_NEAR(r.bubble(), paper_bubble(c, k), 1e-12);
      EXPECT_NEAR(s->formula_bubble(k), paper_bubble(c, k), 1e-12);
    }
  EXPECT_GT(zb_checked, 40);
  // A W longer than F: the owed W's no longer fit the waits, and ZB-H1 claims no formula.
  EXPECT_TRUE(std::isnan(pl::make_schedule("zb-h1", {2, 4, 1})->formula_bubble({1, 1, 2, 0})));
  EXPECT_FALSE(std::isnan(pl::make_schedule("zb-h1", {2, 4, 1})->formula_bubble({1, 1, 1, 0})));
}

TEST(Simulator, ZeroBubbleBelowOneFOneBAndInterleavedBelowOneFOneB) {
  for (int P = 2; P <= 6; ++P)
    for (int M = 1; M <= 12; ++M) {
      SCOPED_TRACE(fmt::format("P={} M={}", P, M));
      const double one = pl::simulate(*pl::make_schedule("1f1b", {P, M, 1})).bubble();
      EXPECT_LT(pl::simulate(*pl::make_schedule("zb-h1", {P, M, 1})).bubble(), one);
      EXPECT_NEAR(pl::simulate(*pl::make_schedule("gpipe", {P, M, 1})).bubble(), one, 1e-12);
      if (M % P == 0) {
        EXPECT_LT(pl::simulate(*pl::make_schedule("interleaved-1f1b", {P, M, 2})).bubble(), one);
      }
    }
  // P = 1 has no bubble at all.
  EXPECT_EQ(pl::simulate(*pl::make_schedule("zb-h1", {1, 3, 1})).bubble(), 0.0);
}

TEST(Simulator, LatencyOnlyDelaysAndNeverDeadlocks) {
  // With messages that take time every schedule still completes, its busy time unchanged, and
  // no action starts earlier than without latency.
  for (const Case& c : sweep())
    for (double latency : {0.25, 3.0}) {
      SCOPED_TRACE(fmt::format("{} latency {}", label(c), latency));
      const auto s = pl::make_schedule(c.name, c.shape);
      const pl::SimResult fast = pl::simulate(*s);
      const pl::SimResult slow = pl::simulate(*s, {1, 1, 1, latency});
      EXPECT_EQ(slow.busy, fast.busy);
      EXPECT_GE(slow.makespan, fast.makespan);
      if (c.shape.ranks > 1) {
        EXPECT_GT(slow.makespan, fast.makespan);
      }
      for (int p = 0; p < c.shape.ranks; ++p)
        for (std::size_t i = 0; i < fast.timeline[p].size(); ++i)
          EXPECT_GE(slow.timeline[p][i].start, fast.timeline[p][i].start);
    }
}

TEST(Simulator, TimelineWorkedByHand) {
  // 1F1B, P = 2, M = 2, F = 1, B + W = 2, latency 0.5:
  //   rank 0: F0 [0,1]  F1 [1,2]                 B0 [5,7]   B1 [8,10]
  //   rank 1:    F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
  // (rank 0's B0 waits for rank 1's B0 + 0.5; its B1 for rank 1's B1 at 7.5 + 0.5.)
  const auto s = pl::make_schedule("1f1b", {2, 2, 1});
  const pl::SimResult r = pl::simulate(*s, {1, 1, 1, 0.5});
  auto times = [&](int p) {
    std::vector<std::pair<double, double>> t;
    for (const pl::TimedAction& a : r.timeline[p]) t.emplace_back(a.start, a.end);
    return t;
  };
  using T = std::vector<std::pair<double, double>>;
  EXPECT_EQ(times(0), (T{{0, 1}, {1, 2}, {5, 7}, {8, 10}}));
  EXPECT_EQ(times(1), (T{{1.5, 2.5}, {2.5, 4.5}, {4.5, 5.5}, {5.5, 7.5}}));
  EXPECT_EQ(r.makespan, 10.0);
  EXPECT_EQ(r.busy, (std::vector<double>{6, 6}));
  EXPECT_EQ(r.idle, (std::vector<double>{4, 4}));
  EXPECT_DOUBLE_EQ(r.idle_fraction(0), 0.4);
  EXPECT_DOUBLE_EQ(r.bubble(), 0.4);
  EXPECT_EQ(r.peak_live, (std::vector<int>{2, 1}));

  // ZB-H1, P = 2, M = 2, unit costs, no latency:
  //   rank 0: F0 [0,1] F1 [1,2] B0 [3,4] W0 [4,5] B1 [5,6] W1 [6,7]
  //   rank 1: F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7]
  const auto z = pl::make_schedule("zb-h1", {2, 2, 1});
  const pl::SimResult rz = pl::simulate(*z);
  const auto& t0 = rz.timeline[0];
  ASSERT_EQ(t0.size(), 6u);
  EXPECT_EQ(t0[2].action, (Action{0, 0, Phase::backward}));
  EXPECT_EQ(t0[2].start, 3.0);
  EXPECT_EQ(rz.timeline[1][4].action, (Action{0, 1, Phase::weight}));
  EXPECT_EQ(rz.timeline[1][4].start, 5.0);
  EXPECT_EQ(rz.makespan, 7.0);
  EXPECT_DOUBLE_EQ(rz.bubble(), 1.0 / 7.0);  // (P−1)/(3M+P−1)
}

TEST(Simulator, ReportsDeadlocksAndIncompleteLists) {
  // Rank 1 wants micro-batch 1 first; rank 0 sends it only after B0, which rank 1 makes only
  // after micro-batch 1: each waits for the other.
  const pl::Schedule stuck("stuck", {2, 2, 1}, false,
                           {{{0, 0, Phase::forward},
                             {0, 0, Phase::backward},
                             {1, 0, Phase::forward},
                             {1, 0, Phase::backward}},
                            {{1, 1, Phase::forward},
                             {0, 1, Phase::forward},
                             {0, 1, Phase::backward},
                             {1, 1, Phase::backward}}});
  try {
    (void)pl::simulate(stuck);
    FAIL() << "no deadlock reported";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("deadlocks"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0 at B0@0 waits for B0@1 on rank 1"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 at F1@1 waits for F1@0 on rank 0"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos);
  }
  const pl::Schedule missing("missing", {1, 2, 1}, false,
                             {{{0, 0, Phase::forward}, {0, 0, Phase::backward}}});
  EXPECT_THROW((void)pl::simulate(missing), Error);
  // A W in a fused schedule, or an action on a stage the rank does not hold, is refused.
  EXPECT_THROW(pl::Schedule("w", {1, 1, 1}, false, {{{0, 0, Phase::weight}}}), Error);
  EXPECT_THROW(pl::Schedule("r", {2, 1, 1}, false, {{{0, 1, Phase::forward}}, {}}), Error);
}

// --first-stage-layers and --last-stage-layers: the ends take what is given, the stages between
// them the rest evenly (the first of them one more each for the remainder); the even split is
// the same with or without an empty EndLayers.
TEST(LayerSplit, GivenEndsTakeTheirLayersAndTheMiddleSplitsTheRest) {
  using Split = std::vector<pl::LayerRange>;
  EXPECT_EQ(pl::split_layers(4, 2, "--pp 2", {.first = 1}), (Split{{0, 1}, {1, 3}}));
  EXPECT_EQ(pl::split_layers(4, 2, "--pp 2", {.last = 1}), (Split{{0, 3}, {3, 1}}));
  EXPECT_EQ(pl::split_layers(5, 3, "--pp 3", {.first = 1, .last = 1}),
            (Split{{0, 1}, {1, 3}, {4, 1}}));
  EXPECT_EQ(pl::split_layers(7, 4, "--pp 4", {.last = 1}), (Split{{0, 2}, {2, 2}, {4, 2}, {6, 1}}));
  EXPECT_EQ(pl::split_layers(9, 4, "--pp 4", {.first = 1, .last = 2}),
            (Split{{0, 1}, {1, 3}, {4, 3}, {7, 2}}));
  EXPECT_EQ(pl::split_layers(10, 5, "--pp 5", {.first = 1}),
            (Split{{0, 1}, {1, 3}, {4, 2}, {6, 2}, {8, 2}}));
  // Virtual stages: the first is rank 0's first, the last the last rank's last.
  EXPECT_EQ(pl::split_layers(5, 4, "--pp 2 × --stages-per-rank 2", {.first = 2}),
            (Split{{0, 2}, {2, 1}, {3, 1}, {4, 1}}));
  for (int L = 2; L <= 12; ++L)
    for (int S = 2; S <= L; ++S)
      EXPECT_EQ(pl::split_layers(L, S, "--pp", {}), pl::split_layers(L, S, "--pp"));
  struct Bad {
    int layers, stages;
    pl::EndLayers ends;
    std::string words;
  };
  for (const Bad& b :
       {Bad{4, 1, {.first = 1}, "--first-stage-layers 1 needs at least two"},
        Bad{4, 1, {.last = 2}, "--last-stage-layers 2 needs at least two"},
        Bad{4, 2, {.first = 5}, "--first-stage-layers 5 must be between 1 and --layers 4"},
        Bad{4, 2, {.first = 4}, "leaves 0 of --layers 4 for the 1 other pipeline stage "},
        Bad{4, 2, {.first = 1, .last = 1}, "must add up to --layers 4"},
        Bad{4,
            3,
            {.first = 2, .last = 2},
            "leaves 0 of --layers 4 for the 1 other pipeline stage "},
        Bad{5,
            4,
            {.first = 2, .last = 2},
            "leaves 1 of --layers 5 for the 2 other pipeline stages"}}) {
    try {
      (void)pl::split_layers(b.layers, b.stages, "--pp", b.ends);
      ADD_FAILURE() << b.words << ": accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(b.words), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
}

TEST(LayerSplit, ContiguousFirstStagesTakeTheRemainder) {
  using Split = std::vector<pl::LayerRange>;
  EXPECT_EQ(pl::split_layers(4, 3, "--pp 3"), (Split{{0, 2}, {2, 1}, {3, 1}}));
  EXPECT_EQ(pl::split_layers(7, 4, "--pp 4"), (Split{{0, 2}, {2, 2}, {4, 2}, {6, 1}}));
  EXPECT_EQ(pl::split_layers(4, 4, "--pp 2 × --stages-per-rank 2"),
            (Split{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));
  EXPECT_EQ(pl::split_layers(3, 1, "--pp 1"), (Split{{0, 3}}));
  for (int L = 1; L <= 12; ++L)
    for (int S = 1; S <= L; ++S) {
      const auto split = pl::split_layers(L, S, "--pp");
      int next = 0;
      for (const auto& r : split) {
        EXPECT_EQ(r.first, next);
        EXPECT_TRUE(r.count == L / S || r.count == L / S + 1);
        next += r.count;
      }
      EXPECT_EQ(next, L);
    }
  try {
    (void)pl::split_layers(3, 4, "--pp 4");
    FAIL() << "3 layers over 4 stages accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--pp 4"), std::string::npos) << e.what();
  }
}

TEST(Factory, BadNamesAndSizesAreOneLineConfigErrors) {
  EXPECT_EQ(pl::schedule_names(),
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}));
  for (const std::string& n : pl::schedule_names())
    EXPECT_EQ(pl::make_schedule(n, {2, 4, n == "interleaved-1f1b" ? 2 : 1})->name(), n);
  const std::vector<std::pair<std::string, PipelineShape>> bad = {
      {"pipedream", {2, 4, 1}},         // unknown
      {"1f1b", {0, 4, 1}},              // P < 1
      {"gpipe", {2, 0, 1}},             // M < 1
      {"1f1b", {2, 4, 2}},              // V on a schedule with one stage per rank
      {"zb-h1", {2, 4, 3}},             //
      {"interleaved-1f1b", {2, 4, 1}},  // V < 2
      {"interleaved-1f1b", {2, 3, 2}},  // M not a multiple of P
      {"interleaved-1f1b", {4, 6, 2}},
  };
  for (const auto& [name, shape] : bad) {
    SCOPED_TRACE(fmt::format("{} P={} M={} V={}", name, shape.ranks, shape.microbatches,
                             shape.stages_per_rank));
    try {
      (void)pl::make_schedule(name, shape);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_FALSE(what.empty());
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
  EXPECT_EQ(pl::microbatch_size(8, 4), 2);
  EXPECT_EQ(pl::microbatch_size(6, 6), 1);
  EXPECT_THROW((void)pl::microbatch_size(8, 3), ConfigError);
  EXPECT_THROW((void)pl::microbatch_size(8, 0), ConfigError);
}

TEST(Format, GridOneRowPerRank) {
  const auto s = pl::make_schedule("1f1b", {2, 3, 1});
  const auto lines = test::lines_of(pl::format_schedule(*s));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_NE(lines[0].find("1f1b"), std::string::npos);
  EXPECT_EQ(lines[1], "rank 0 | F0 F1 B0 F2 B1 B2");
  EXPECT_EQ(lines[2], "rank 1 | F0 B0 F1 B1 F2 B2");
  // With several stages per rank each action names its stage, in equal-width columns.
  const auto i = pl::make_schedule("interleaved-1f1b", {2, 2, 2});
  const auto il = test::lines_of(pl::format_schedule(*i));
  ASSERT_EQ(il.size(), 4u);
  EXPECT_EQ(il[2], "rank 0 | F0@0 F1@0 F0@2 F1@2 B0@2 B1@2 B0@0 B1@0");
}

TEST(Format, TimelineOneColumnPerUnit) {
  // 1F1B, P = 2, M = 2, unit costs (a fused backward is two columns), no latency:
  //   rank 0: F0 [0,1] F1 [1,2] waits for B0 until 4, B0 [4,6], waits until 7, B1 [7,9]
  //   rank 1: waits until 1, F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7], idle until 9
  const auto s = pl::make_schedule("1f1b", {2, 2, 1});
  const auto lines = test::lines_of(pl::format_timeline(*s, pl::simulate(*s)));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "rank 0 | F0 F1 .  .  B0 -  .  B1 -");
  EXPECT_EQ(lines[1], "rank 1 | .  F0 B0 -  F1 B1 -  .  .");
  // Half a unit of latency cannot be drawn in whole columns of 1, and is refused.
  EXPECT_THROW((void)pl::format_timeline(*s, pl::simulate(*s, {1, 1, 1, 0.5}), 1.0), Error);
  // With columns of 0.5 it can: the makespan of 10 is 20 columns.
  const auto half = test::lines_of(pl::format_timeline(*s, pl::simulate(*s, {1, 1, 1, 0.5}), 0.5));
  ASSERT_EQ(half.size(), 2u);
  EXPECT_EQ(half[0].substr(0, 19), "rank 0 | F0 -  F1 -");
}

// tools/tpx_schedule prints what the library formats, and refuses bad input with one line.
TEST(TpxSchedule, PrintsTheLibrarysScheduleAndSimulation) {
  test::TempDir dir;
  const std::vector<std::tuple<std::string, PipelineShape, pl::Costs>> runs = {
      {"1f1b", {4, 8, 1}, {1, 1, 1, 0}},
      {"zb-h1", {3, 6, 1}, {1, 2, 1, 0.25}},
      {"interleaved-1f1b", {2, 4, 2}, {1, 1, 1, 0}},
      {"gpipe", {2, 3, 1}, {2, 3, 1, 0}},
  };
  for (const auto& [name, shape, k] : runs) {
    SCOPED_TRACE(name);
    const std::string args =
        fmt::format("--pp {} --microbatches {} --schedule {} --stages-per-rank {}", shape.ranks,
                    shape.microbatches, name, shape.stages_per_rank);
    const auto plain = test::run_command(fmt::format("{} {}", TPX_SCHEDULE_BIN, args), dir);
    ASSERT_EQ(plain.exit_code, 0) << plain.err;
    const auto s = pl::make_schedule(name, shape);
    EXPECT_EQ(plain.out, pl::format_schedule(*s));
    const auto sim = test::run_command(
        fmt::format("{} {} --simulate --forward {} --backward {} --weight {} --latency {}",
                    TPX_SCHEDULE_BIN, args, k.forward, k.backward, k.weight, k.latency),
        dir);
    ASSERT_EQ(sim.exit_code, 0) << sim.err;
    const pl::SimResult r = pl::simulate(*s, k);
    EXPECT_EQ(sim.out, pl::format_schedule(*s) + pl::format_simulation(*s, k, r));
    EXPECT_NE(sim.out.find(fmt::format("bubble {:.4f}", r.bubble())), std::string::npos) << sim.out;
    const auto drawn = test::run_command(
        fmt::format(
            "{} {} --simulate --timeline --forward {} --backward {} --weight {} --latency {}",
            TPX_SCHEDULE_BIN, args, k.forward, k.backward, k.weight, k.latency),
        dir);
    ASSERT_EQ(drawn.exit_code, 0) << drawn.err;
    // The column is the smallest nonzero cost.
    const double unit =
        std::min({k.forward, k.backward, k.weight, k.latency > 0 ? k.latency : k.weight});
    EXPECT_EQ(drawn.out, sim.out + pl::format_timeline(*s, r, unit));
  }
  for (const char* bad : {"--pp 2 --microbatches 3 --schedule interleaved-1f1b "
                          "--stages-per-rank 2",
                          "--schedule nope", "--pp 0", "--pp 2 --stages-per-rank 2",
                          "--microbatches x", "--no-such-flag", "--forward -1 --simulate",
                          "--timeline", "--simulate --timeline --backward 1.5",
                          // past the size guards: one line, at once, not bad_alloc or minutes
                          "--pp 2147483647 --microbatches 2147483647 --simulate",
                          "--pp 2000 --microbatches 100000 --simulate",
                          "--pp 4 --microbatches 8 --simulate --timeline --forward 1000000000",
                          // costs: finite, F, B and W > 0, the latency >= 0; with and without
                          // the timeline, never a table of nan nor an internal check
                          "--pp 2 --microbatches 4 --simulate --forward inf",
                          "--pp 2 --microbatches 4 --simulate --timeline --forward inf "
                          "--backward inf --weight inf",
                          "--pp 2 --microbatches 4 --simulate --backward nan",
                          "--pp 2 --microbatches 4 --simulate --weight 0",
                          "--pp 2 --microbatches 4 --simulate --forward 0 --backward 0",
                          "--pp 2 --microbatches 4 --simulate --latency -1e300",
                          "--pp 2 --microbatches 4 --simulate --latency inf",
                          "--pp 2 --microbatches 4 --simulate --forward 1e308 --backward 1e308"}) {
    SCOPED_TRACE(bad);
    const auto r = test::run_command(fmt::format("{} {}", TPX_SCHEDULE_BIN, bad), dir);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(test::lines_of(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_EQ(r.err.rfind("tpx_schedule: error: ", 0), 0u) << r.err;
    // A bad cost is named: one of the cost flags given is in the line (with --timeline, the
    // timeline's own limits may speak first).
    bool cost_given = false, cost_named = false;
    for (const std::string flag : {"--forward", "--backward", "--weight", "--latency"}) {
      if (std::string_view(bad).find(flag) == std::string_view::npos) continue;
      cost_given = true;
      cost_named = cost_named || r.err.find(flag) != std::string::npos;
    }
    if (std::string_view(bad).find("--timeline") == std::string_view::npos) {
      EXPECT_EQ(cost_named, cost_given) << r.err;
    }
    if (std::string_view(bad).find("2147483647") != std::string_view::npos ||
        std::string_view(bad).find("--pp 2000") != std::string_view::npos) {
      EXPECT_NE(r.err.find("actions, more than the 1e+07"), std::string::npos) << r.err;
    }
  }
}

}  // namespace
}  // namespace tpx
