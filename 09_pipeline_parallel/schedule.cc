// Pipeline-parallel schedules: the four kinds, the layer split, the messages the actions imply,
// the live counts, the printed grid and the simulator (schedule.h).
#include "09_pipeline_parallel/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx::pipeline {

char letter(Phase p) {
  switch (p) {
    case Phase::forward:
      return 'F';
    case Phase::backward:
      return 'B';
    case Phase::weight:
      return 'W';
  }
  return '?';
}

std::string to_string(const Action& a, bool with_stage) {
  return with_stage ? fmt::format("{}{}@{}", letter(a.phase), a.microbatch, a.stage)
                    : fmt::format("{}{}", letter(a.phase), a.microbatch);
}

std::vector<int> PipelineShape::stages_of(int rank) const {
  std::vector<int> s;
  for (int v = 0; v < stages_per_rank; ++v) s.push_back(rank + v * ranks);
  return s;
}

std::vector<LayerRange> split_layers(int layers, int stages, std::string_view what,
                                     EndLayers ends) {
  if (stages < 1) throw ConfigError(fmt::format("{} gives no pipeline stage", what));
  if (ends.given()) {
    const std::string given =
        ends.first != 0 && ends.last != 0
            ? fmt::format("--first-stage-layers {} and --last-stage-layers {}", ends.first,
                          ends.last)
        : ends.first != 0 ? fmt::format("--first-stage-layers {}", ends.first)
                          : fmt::format("--last-stage-layers {}", ends.last);
    if (stages < 2)
      throw ConfigError(
          fmt::format("{} needs at least two pipeline stages, and {} makes one", given, what));
    for (const auto& [flag, n] :
         {std::pair{"--first-stage-layers", ends.first}, {"--last-stage-layers", ends.last}})
      if (n < 0 || n > layers)
        throw ConfigError(fmt::format("{} {} must be between 1 and --layers {}", flag, n, layers));
    const int fixed = (ends.first != 0 ? 1 : 0) + (ends.last != 0 ? 1 : 0);
    const int others = stages - fixed;
    const std::int64_t left = std::int64_t(layers) - ends.first - ends.last;
    if (others == 0 && left != 0)
      throw ConfigError(fmt::format(
          "{} must add up to --layers {}: {} makes two pipeline stages, the first and the last",
          given, layers, what));
    if (others > 0 && left < others)
      throw ConfigError(fmt::format(
          "{} leaves {} of --layers {} for the {} other pipeline stage{} of {}: every stage "
          "needs at least one layer",
          given, std::max<std::int64_t>(left, 0), layers, others, others == 1 ? "" : "s", what));
  } else if (layers < stages) {
    throw ConfigError(fmt::format(
        "{} makes {} pipeline stages but --layers is {}: every stage needs at least one layer",
        what, stages, layers));
  }
  // The stages the even split covers: all of them, less the ends given.
  const int lo = ends.first != 0 ? 1 : 0, hi = ends.last != 0 ? stages - 1 : stages;
  const int even = layers - ends.first - ends.last, n = hi - lo;
  std::vector<LayerRange> split;
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int count = s < lo    ? ends.first
                      : s >= hi ? ends.last
                                : even / n + (s - lo < even % n ? 1 : 0);
    split.push_back({first, count});
    first += count;
  }
  return split;
}

std::vector<double> stage_work(const std::vector<LayerRange>& layers, double first_extra,
                               double last_extra) {
  std::vector<double> work;
  for (const LayerRange& r : layers) work.push_back(double(r.count));
  if (!work.empty()) {
    work.front() += first_extra;
    work.back() += last_extra;
  }
  return work;
}

std::int64_t microbatch_size(std::int64_t local_batch, int microbatches) {
  if (microbatches < 1)
    throw ConfigError(fmt::format("--microbatches must be at least 1 (got {})", microbatches));
  if (local_batch % microbatches != 0)
    throw ConfigError(fmt::format("--microbatches {} does not divide the local batch of {} rows",
                                  microbatches, local_batch));
  return local_batch / microbatches;
}

// ---------------------------------------------------------------------------------------------
// Schedule

Schedule::Schedule(std::string name, PipelineShape shape, bool split_backward,
                   std::vector<std::vector<Action>> per_rank)
    : name_(std::move(name)),
      shape_(shape),
      split_(split_backward),
      per_rank_(std::move(per_rank)) {
  TPX_CHECK(shape_.ranks >= 1 && shape_.microbatches >= 1 && shape_.stages_per_rank >= 1,
            "schedule {}: P, M and V must be at least 1", name_);
  TPX_CHECK(static_cast<int>(per_rank_.size()) == shape_.ranks,
            "schedule {}: {} action lists for {} ranks", name_, per_rank_.size(), shape_.ranks);
  for (int r = 0; r < shape_.ranks; ++r)
    for (const Action& a : per_rank_[r]) {
      TPX_CHECK(a.microbatch >= 0 && a.microbatch < shape_.microbatches && a.stage >= 0 &&
                    a.stage < shape_.stages() && shape_.rank_of(a.stage) == r,
                "schedule {}: rank {} cannot run {}", name_, r, to_string(a, true));
      TPX_CHECK(split_ || a.phase != Phase::weight,
                "schedule {}: a fused schedule has no W action ({} on rank {})", name_,
                to_string(a, true), r);
    }
}

const std::vector<Action>& Schedule::actions(int rank) const {
  TPX_CHECK(rank >= 0 && rank < shape_.ranks, "schedule {} has no rank {}", name_, rank);
  return per_rank_[rank];
}

double Schedule::formula_bubble(const Costs&) const {
  return std::numeric_limits<double>::quiet_NaN();
}

namespace {

using Lists = std::vector<std::vector<Action>>;

Action fwd(int m, int s) {
  return {m, s, Phase::forward};
}
Action bwd(int m, int s) {
  return {m, s, Phase::backward};
}
Action wgt(int m, int s) {
  return {m, s, Phase::weight};
}

// GPipe: all M forwards, then all M backwards, both in micro-batch order.
Lists build_gpipe(const PipelineShape& sh) {
  Lists lists(sh.ranks);
  for (int p = 0; p < sh.ranks; ++p) {
    for (int m = 0; m < sh.microbatches; ++m) lists[p].push_back(fwd(m, p));
    for (int m = 0; m < sh.microbatches; ++m) lists[p].push_back(bwd(m, p));
  }
  return lists;
}

// 1F1B and ZB-H1 share the order of F and B: min(P−p−1, M) warm-up forwards, steady (F, B)
// pairs, cool-down backwards. Split (ZB-H1), each B is followed by a W, except that rank p's
// first p steady B's are not: the W's run in micro-batch order, so rank p owes p of them until
// the cool-down, and runs those it still owes after its last B.
Lists build_one_f_one_b(const PipelineShape& sh, bool split) {
  const int P = sh.ranks, M = sh.microbatches;
  Lists lists(P);
  for (int p = 0; p < P; ++p) {
    std::vector<Action>& list = lists[p];
    const int warmup = std::min(P - p - 1, M);
    // ZB-H1: rank p owes p W's, so that it holds (P−p−1) + 1 + p = P micro-batches at most,
    // rank 0's count under 1F1B. The owed W's are what fills the waits for the next B.
    const int defer = split ? p : 0;
    int next_w = 0;
    for (int m = 0; m < warmup; ++m) list.push_back(fwd(m, p));
    for (int i = 0; i < M - warmup; ++i) {
      list.push_back(fwd(warmup + i, p));
      list.push_back(bwd(i, p));
      if (split && i >= defer) list.push_back(wgt(next_w++, p));
    }
    for (int m = M - warmup; m < M; ++m) {
      list.push_back(bwd(m, p));
      if (split) list.push_back(wgt(next_w++, p));
    }
    while (split && next_w < M) list.push_back(wgt(next_w++, p));
  }
  return lists;
}

// Interleaved 1F1B, Megatron-LM's order. Rank p's k-th forward (k = 0 … M·V−1) takes, of the
// k / (P·V)-th group of P micro-batches, micro-batch k mod P through its (k mod P·V) / P-th
// virtual stage; its k-th backward the same micro-batch through the stages in reverse. A group
// of P micro-batches keeps all P ranks busy on one pass through a chunk, so the next chunk's
// first forward arrives at rank 0 just as it finishes the group: hence M mod P = 0.
//
// The bubble, with equal costs f (forward) and b (the fused backward) per virtual stage and no
// latency. Each rank works M·V·(f+b). In 1F1B a rank waits (P−1)(f+b) in all: the pipeline fills
// through P−1 ranks before the last one starts, and drains back through them, at f and b per
// hop. Interleaving keeps that fill and drain across the P ranks but makes each hop one virtual
// stage, 1/V of a rank's layers, so the wait is (P−1)(f+b) in virtual-stage costs: Megatron-LM's
// bubble time (P−1)(t_f+t_b)/V with t_f = V·f, t_b = V·b a rank's whole forward and backward.
// Between fill and drain no rank waits, because the forwards go in groups of P micro-batches:
// micro-batch 0 leaves rank P−1's stage of chunk c at the time rank 0 finishes the group's P-th
// forward on chunk c, and arrives for chunk c+1 just then (hence M mod P = 0). So
//   bubble = (P−1)(f+b) / (M·V·(f+b) + (P−1)(f+b)) = (P−1) / (V·M + P−1),
// Megatron-LM's "(1/v)·(p−1)/m" of the ideal time written as a share of the whole step. The
// waits come at other moments than in 1F1B, each rank's as long in all. simulate() reproduces the
// formula exactly for every P, M, V and cost tested (tests/test_schedule.cc).
Lists build_interleaved(const PipelineShape& sh) {
  const int P = sh.ranks, M = sh.microbatches, V = sh.stages_per_rank;
  const int total = M * V;
  auto stage_of = [&](int p, int k, bool forward) {
    const int chunk = (k % (P * V)) / P;
    return (forward ? chunk : V - 1 - chunk) * P + p;
  };
  auto microbatch_of = [&](int k) { return (k / (P * V)) * P + k % P; };
  Lists lists(P);
  for (int p = 0; p < P; ++p) {
    const int warmup = std::min(2 * (P - p - 1) + (V - 1) * P, total);
    std::vector<Action>& list = lists[p];
    for (int k = 0; k < warmup; ++k) list.push_back(fwd(microbatch_of(k), stage_of(p, k, true)));
    for (int i = 0; i < total - warmup; ++i) {
      const int k = warmup + i;
      list.push_back(fwd(microbatch_of(k), stage_of(p, k, true)));
      list.push_back(bwd(microbatch_of(i), stage_of(p, i, false)));
    }
    for (int k = total - warmup; k < total; ++k)
      list.push_back(bwd(microbatch_of(k), stage_of(p, k, false)));
  }
  return lists;
}

// (P−1)/(M+P−1): GPipe's and 1F1B's idle share for any F and B costs (the fused backward
// costing B+W): each rank works M(F+B+W) and waits (P−1)(F+B+W) (Huang et al. 2019).
double fill_drain_bubble(const PipelineShape& sh) {
  const double P = sh.ranks, M = sh.microbatches;
  return (P - 1) / (M + P - 1);
}

}  // namespace

GPipe::GPipe(PipelineShape shape) : Schedule("gpipe", shape, false, build_gpipe(shape)) {}
double GPipe::formula_bubble(const Costs&) const {
  return fill_drain_bubble(shape());
}

OneFOneB::OneFOneB(PipelineShape shape)
    : Schedule("1f1b", shape, false, build_one_f_one_b(shape, false)) {}
double OneFOneB::formula_bubble(const Costs&) const {
  return fill_drain_bubble(shape());
}

Interleaved1F1B::Interleaved1F1B(PipelineShape shape)
    : Schedule("interleaved-1f1b", shape, false, build_interleaved(shape)) {}
double Interleaved1F1B::formula_bubble(const Costs&) const {
  const double P = shape().ranks, M = shape().microbatches, V = shape().stages_per_rank;
  return (P - 1) / (V * M + P - 1);
}

ZeroBubbleH1::ZeroBubbleH1(PipelineShape shape)
    : Schedule("zb-h1", shape, true, build_one_f_one_b(shape, true)) {}
// Qi et al. 2023, section 3: 1F1B's bubble is (P−1)(F+B+W); ZB-H1's is (P−1)(F+B−W), each W
// that a rank owes filling a W-sized piece of its wait. As a share of the step:
// (P−1)(F+B−W) / (M(F+B+W) + (P−1)(F+B−W)). It assumes M ≥ P (each rank has its W's to owe)
// and W no larger than F and B (an owed W must fit the wait it fills); outside that: NaN.
double ZeroBubbleH1::formula_bubble(const Costs& c) const {
  const double P = shape().ranks, M = shape().microbatches;
  if (M < P || c.weight > std::min(c.forward, c.backward))
    return std::numeric_limits<double>::quiet_NaN();
  const double wait = (P - 1) * (c.forward + c.backward - c.weight);
  return wait / (M * (c.forward + c.backward + c.weight) + wait);
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"};
  return names;
}

double schedule_actions(std::string_view name, const PipelineShape& shape) {
  // In floating point: P·V·M·3 cannot overflow.
  return double(shape.ranks) * std::max(shape.stages_per_rank, 1) * double(shape.microbatches) *
         (name == "zb-h1" ? 3.0 : 2.0);
}

std::string stages_per_rank_problem(std::string_view name, int V) {
  if (name == "interleaved-1f1b")
    return V < 2 ? fmt::format(
                       "--schedule interleaved-1f1b needs --stages-per-rank of at least 2 (got {})",
                       V)
                 : std::string();
  if (V != 1)
    return fmt::format(
        "--stages-per-rank {} needs --schedule interleaved-1f1b (--schedule {} holds one stage "
        "per rank)",
        V, name);
  return {};
}

std::unique_ptr<Schedule> make_schedule(std::string_view name, const PipelineShape& shape) {
  if (std::find(schedule_names().begin(), schedule_names().end(), name) == schedule_names().end())
    throw ConfigError(fmt::format("unknown --schedule '{}' (one of: {})", name,
                                  fmt::join(schedule_names(), ", ")));
  if (shape.ranks < 1)
    throw ConfigError(fmt::format("--pp must be at least 1 (got {})", shape.ranks));
  if (shape.microbatches < 1)
    throw ConfigError(
        fmt::format("--microbatches must be at least 1 (got {})", shape.microbatches));
  const int V = shape.stages_per_rank;
  // Every rank's list is held whole (and simulated, printed, run): a size guard before any is
  // made.
  const double actions = schedule_actions(name, shape);
  if (actions > double(kMaxScheduleActions))
    throw ConfigError(fmt::format(
        "--pp {} × --stages-per-rank {} × --microbatches {} makes {:.3g} actions, more than the "
        "{:.3g} a schedule is made with (every rank's list is held in memory)",
        shape.ranks, V, shape.microbatches, actions, double(kMaxScheduleActions)));
  if (std::string p = stages_per_rank_problem(name, V); !p.empty()) throw ConfigError(p);
  if (name == "interleaved-1f1b") {
    if (shape.microbatches % shape.ranks != 0)
      throw ConfigError(fmt::format(
          "--schedule interleaved-1f1b needs --microbatches {} to be a multiple of --pp {}",
          shape.microbatches, shape.ranks));
    return std::make_unique<Interleaved1F1B>(shape);
  }
  if (name == "gpipe") return std::make_unique<GPipe>(shape);
  if (name == "1f1b") return std::make_unique<OneFOneB>(shape);
  return std::make_unique<ZeroBubbleH1>(shape);
}

// ---------------------------------------------------------------------------------------------
// Messages and live counts

int message_tag(const PipelineShape& shape, Payload payload, int microbatch, int boundary) {
  const int boundaries = std::max(shape.stages() - 1, 1);
  return (microbatch * boundaries + boundary) * 2 + (payload == Payload::gradient ? 1 : 0);
}

std::vector<Transfer> transfers(const Schedule& schedule, int rank) {
  const PipelineShape& sh = schedule.shape();
  const int last = sh.stages() - 1;
  std::vector<Transfer> out;
  // One message from virtual stage `from` to `to` (adjacent), unless both are on this rank.
  auto add = [&](bool send, Payload payload, const Action& a, int from, int to, std::size_t i) {
    const int peer = sh.rank_of(send ? to : from);
    if (peer == rank) return;
    out.push_back({send, payload, a.microbatch, from, to, peer,
                   message_tag(sh, payload, a.microbatch, std::min(from, to)), i});
  };
  const std::vector<Action>& list = schedule.actions(rank);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    const int s = a.stage;
    if (a.phase == Phase::forward) {
      if (s > 0) add(false, Payload::activation, a, s - 1, s, i);
      if (s < last) add(true, Payload::activation, a, s, s + 1, i);
    } else if (a.phase == Phase::backward) {
      if (s < last) add(false, Payload::gradient, a, s + 1, s, i);
      if (s > 0) add(true, Payload::gradient, a, s, s - 1, i);
    }
  }
  return out;
}

std::vector<int> live_counts(const Schedule& schedule, int rank) {
  const Phase frees = schedule.split_backward() ? Phase::weight : Phase::backward;
  std::vector<int> counts;
  int live = 0;
  for (const Action& a : schedule.actions(rank)) {
    if (a.phase == Phase::forward) ++live;
    if (a.phase == frees) --live;
    counts.push_back(live);
  }
  return counts;
}

std::vector<int> peak_live(const Schedule& schedule) {
  std::vector<int> peaks;
  for (int r = 0; r < schedule.shape().ranks; ++r) {
    const std::vector<int> c = live_counts(schedule, r);
    peaks.push_back(c.empty() ? 0 : *std::max_element(c.begin(), c.end()));
  }
  return peaks;
}

std::string format_schedule(const Schedule& schedule) {
  const PipelineShape& sh = schedule.shape();
  const bool with_stage = sh.stages_per_rank > 1;
  std::size_t width = 0;
  for (int r = 0; r < sh.ranks; ++r)
    for (const Action& a : schedule.actions(r))
      width = std::max(width, to_string(a, with_stage).size());
  std::string out = fmt::format(
      "schedule {}: P={} ranks, M={} micro-batches, V={} stage{} per rank ({})\n", schedule.name(),
      sh.ranks, sh.microbatches, sh.stages_per_rank, sh.stages_per_rank == 1 ? "" : "s",
      schedule.split_backward() ? "F forward, B input gradient, W weight gradients"
                                : "F forward, B backward");
  if (with_stage) out += "  (F3@5: micro-batch 3 on virtual stage 5)\n";
  const int rank_width = static_cast<int>(fmt::format("{}", sh.ranks - 1).size());
  for (int r = 0; r < sh.ranks; ++r) {
    std::string row = fmt::format("rank {:>{}} |", r, rank_width);
    for (const Action& a : schedule.actions(r))
      row += fmt::format(" {:<{}}", to_string(a, with_stage), width);
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The simulator

double SimResult::bubble() const {
  if (makespan <= 0.0 || idle.empty()) return 0.0;
  double total = 0.0;
  for (double i : idle) total += i;
  return total / (static_cast<double>(idle.size()) * makespan);
}

double SimResult::idle_fraction(int rank) const {
  return makespan > 0.0 ? idle.at(static_cast<std::size_t>(rank)) / makespan : 0.0;
}

namespace {

// The end time of every (phase, micro-batch, stage), NaN until it has run.
class Finished {
 public:
  explicit Finished(const PipelineShape& sh)
      : sh_(sh),
        end_(static_cast<std::size_t>(3 * sh.microbatches * sh.stages()),
             std::numeric_limits<double>::quiet_NaN()) {}
  double& at(Phase p, int m, int s) {
    return end_[(static_cast<std::size_t>(p) * static_cast<std::size_t>(sh_.stages()) +
                 static_cast<std::size_t>(s)) *
                    static_cast<std::size_t>(sh_.microbatches) +
                static_cast<std::size_t>(m)];
  }

 private:
  PipelineShape sh_;
  std::vector<double> end_;
};

// The actions `a` waits for (on any rank), in the order the text above simulate() gives.
std::vector<Action> inputs_of(const Action& a, int last_stage) {
  switch (a.phase) {
    case Phase::forward:
      if (a.stage > 0) return {fwd(a.microbatch, a.stage - 1)};
      return {};
    case Phase::backward:
      if (a.stage < last_stage) return {fwd(a.microbatch, a.stage), bwd(a.microbatch, a.stage + 1)};
      return {fwd(a.microbatch, a.stage)};
    case Phase::weight:
      return {bwd(a.microbatch, a.stage)};
  }
  return {};
}

// Every (phase, micro-batch, stage) the schedule needs appears once in all the lists together.
void check_complete(const Schedule& schedule) {
  const PipelineShape& sh = schedule.shape();
  Finished seen(sh);  // used as a counter: NaN = 0 times
  for (int r = 0; r < sh.ranks; ++r)
    for (const Action& a : schedule.actions(r)) {
      double& n = seen.at(a.phase, a.microbatch, a.stage);
      n = std::isnan(n) ? 1.0 : n + 1.0;
      TPX_CHECK(n == 1.0, "schedule {} runs {} more than once", schedule.name(),
                to_string(a, true));
    }
  const std::vector<Phase> phases =
      schedule.split_backward() ? std::vector<Phase>{Phase::forward, Phase::backward, Phase::weight}
                                : std::vector<Phase>{Phase::forward, Phase::backward};
  for (Phase p : phases)
    for (int s = 0; s < sh.stages(); ++s)
      for (int m = 0; m < sh.microbatches; ++m)
        TPX_CHECK(!std::isnan(seen.at(p, m, s)), "schedule {} never runs {}", schedule.name(),
                  to_string({m, s, p}, true));
}

}  // namespace

SimResult simulate(const Schedule& schedule, const Costs& costs,
                   const std::vector<double>& stage_work) {
  check_complete(schedule);
  const PipelineShape& sh = schedule.shape();
  const int P = sh.ranks, last = sh.stages() - 1;
  TPX_CHECK(stage_work.empty() || int(stage_work.size()) == sh.stages(),
            "simulate: {} stage costs for {} virtual stages", stage_work.size(), sh.stages());
  auto phase_cost = [&](Phase p) {
    switch (p) {
      case Phase::forward:
        return costs.forward;
      case Phase::backward:
        return schedule.split_backward() ? costs.backward : costs.backward + costs.weight;
      case Phase::weight:
        return costs.weight;
    }
    return 0.0;
  };
  auto cost_of = [&](const Action& a) {
    const double work = stage_work.empty() ? 1.0 : stage_work[std::size_t(a.stage)];
    return phase_cost(a.phase) * work;
  };
  Finished done(sh);
  SimResult r;
  r.timeline.resize(static_cast<std::size_t>(P));
  r.busy.assign(static_cast<std::size_t>(P), 0.0);
  std::vector<std::size_t> next(static_cast<std::size_t>(P), 0);
  std::vector<double> free_at(static_cast<std::size_t>(P), 0.0);
  // Each pass runs, on every rank, the actions whose inputs have finished; a pass that runs
  // nothing while some rank has actions left is a deadlock. An action's times depend only on its
  // inputs' and its predecessor's, so the order of the passes does not change them.
  for (bool progress = true; progress;) {
    progress = false;
    for (int p = 0; p < P; ++p) {
      const std::vector<Action>& list = schedule.actions(p);
      while (next[p] < list.size()) {
        const Action& a = list[next[p]];
        double start = free_at[p];
        bool ready = true;
        for (const Action& in : inputs_of(a, last)) {
          const double end = done.at(in.phase, in.microbatch, in.stage);
          if (std::isnan(end)) {
            ready = false;
            break;
          }
          start = std::max(start, end + (sh.rank_of(in.stage) == p ? 0.0 : costs.latency));
        }
        if (!ready) break;
        const double end = start + cost_of(a);
        done.at(a.phase, a.microbatch, a.stage) = end;
        r.timeline[p].push_back({a, start, end});
        r.busy[p] += cost_of(a);
        free_at[p] = end;
        r.makespan = std::max(r.makespan, end);
        ++next[p];
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int p = 0; p < P; ++p) {
    const std::vector<Action>& list = schedule.actions(p);
    if (next[p] == list.size()) continue;
    const Action& a = list[next[p]];
    std::vector<std::string> waits;
    for (const Action& in : inputs_of(a, last))
      if (std::isnan(done.at(in.phase, in.microbatch, in.stage)))
        waits.push_back(fmt::format("{} on rank {}", to_string(in, true), sh.rank_of(in.stage)));
    stuck.push_back(fmt::format("rank {} at {} waits for {}", p, to_string(a, true),
                                fmt::join(waits, " and ")));
  }
  if (!stuck.empty())
    fail(fmt::format("schedule {} deadlocks: {}", schedule.name(), fmt::join(stuck, "; ")));
  for (int p = 0; p < P; ++p) r.idle.push_back(r.makespan - r.busy[p]);
  r.peak_live = peak_live(schedule);
  r.stage_work = stage_work;
  return r;
}

std::string format_timeline(const Schedule& schedule, const SimResult& result, double unit) {
  TPX_CHECK(unit > 0.0, "the timeline's unit must be positive (got {})", unit);
  const bool with_stage = schedule.shape().stages_per_rank > 1;
  // Time t in whole units; fails when t is not one.
  auto units = [&](double t) {
    const double u = std::round(t / unit);
    TPX_CHECK(std::abs(u * unit - t) <= 1e-9 * std::max(1.0, std::abs(t)),
              "time {} is not a whole number of units of {}", t, unit);
    return static_cast<std::size_t>(u);
  };
  const std::size_t columns = units(result.makespan);
  // Per rank and column: the name of the action that starts there, "-" where one goes on, "."
  // where the rank is idle.
  std::vector<std::vector<std::string>> grid(result.timeline.size());
  std::size_t width = 1;
  for (std::size_t p = 0; p < result.timeline.size(); ++p) {
    std::vector<std::string>& row = grid[p];
    for (const TimedAction& t : result.timeline[p]) {
      const std::size_t begin = units(t.start), end = units(t.end);
      if (end == begin) continue;  // costs nothing: not drawn
      row.resize(begin, std::string(1, '.'));
      row.push_back(to_string(t.action, with_stage));
      row.resize(end, std::string(1, '-'));
      width = std::max(width, row[begin].size());
    }
    row.resize(columns, std::string(1, '.'));
  }
  std::string out;
  const int rank_width = static_cast<int>(fmt::format("{}", grid.size() - 1).size());
  for (std::size_t p = 0; p < grid.size(); ++p) {
    std::string row = fmt::format("rank {:>{}} |", p, rank_width);
    for (const std::string& cell : grid[p]) row += fmt::format(" {:<{}}", cell, width);
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  return out;
}

std::string format_simulation(const Schedule& schedule, const Costs& costs,
                              const SimResult& result) {
  std::string out =
      fmt::format("simulated with F={:g} B={:g} W={:g}{}, P2P latency {:g}\n", costs.forward,
                  costs.backward, costs.weight,
                  schedule.split_backward() ? "" : " (a fused backward costs B+W)", costs.latency);
  if (!result.stage_work.empty())
    out += fmt::format("each virtual stage's actions cost these times as much: {}\n",
                       fmt::join(result.stage_work, " "));
  out += "rank |     busy |     idle | idle fraction | peak live\n";
  for (int p = 0; p < schedule.shape().ranks; ++p)
    out += fmt::format("{:>4} | {:>8.4g} | {:>8.4g} | {:>13.4f} | {:>9}\n", p, result.busy[p],
                       result.idle[p], result.idle_fraction(p), result.peak_live[p]);
  const double formula = schedule.formula_bubble(costs);
  out +=
      fmt::format("makespan {:g}, bubble {:.4f} (formula {})\n", result.makespan, result.bubble(),
                  std::isnan(formula) ? std::string("none") : fmt::format("{:.4f}", formula));
  return out;
}

}  // namespace tpx::pipeline
