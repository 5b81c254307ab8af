// Pipeline-parallel schedules (stage 09), on their own: no model, no MPI. A schedule says, for
// every pipeline rank, in which order it runs the forward and backward passes of the M
// micro-batches through the virtual stages it holds. Stage 09's executor is to run these lists;
// the tests and tools/tpx_schedule check, print and simulate them without running a model.
//
// The design:
//   * An Action is (micro-batch, virtual stage, phase). The phase is F (forward), B (backward)
//     or W (weight gradients). In a fused schedule (gpipe, 1f1b, interleaved-1f1b) B is the whole
//     backward, the input gradient and the weight gradients, and there is no W. In a split
//     schedule (zb-h1) B computes only the input gradient, which the previous stage waits for,
//     and W the weight gradients, which nobody waits for and may run later.
//   * A Schedule holds one ordered Action list per rank; a rank runs its list in order. The
//     point-to-point messages are not actions: each follows from the actions (transfers()). An
//     F on a virtual stage s > 0 receives s−1's activation, an F on s < S−1 sends its output to
//     s+1; a B on s < S−1 receives s+1's gradient, a B on s > 0 sends its input gradient to s−1;
//     messages between virtual stages on the same rank stay local. transfers() lists a rank's
//     receives just before the action that consumes them and its sends just after the action
//     that produces them, each with a tag unique in the step, so the executor can post them all
//     non-blocking (a receive early, ahead of the action) and compute while they are in flight.
//     Between two ranks, every schedule here receives in the order it sends (tested).
//   * Virtual stages: S = P·V stages for P ranks and V stages per rank; rank p holds the
//     virtual stages p, p+P, p+2P, … (Megatron-LM's interleaving; V = 1 is the plain pipeline).
//     The layers are split contiguously over the S virtual stages (split_layers()): evenly, or
//     with a given number on the first and the last virtual stage (EndLayers) and the rest
//     evenly over the stages between.
//   * One class per schedule kind (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1), made by name
//     with make_schedule(); each also knows the bubble its paper derives (formula_bubble()).
//   * simulate() runs the lists with given F/B/W costs and a P2P latency, honouring every
//     dependency, and returns each rank's busy and idle time, the makespan, the bubble and the
//     peak number of live micro-batch activations; a schedule that deadlocks is reported with
//     the actions each stuck rank waits for, never hung.
//
// The schedules: GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks
// using Pipeline Parallelism"); 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient
// Pipeline-Parallel DNN Training"); interleaved 1F1B (Narayanan et al. 2021, "Efficient
// Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"); ZB-H1 (Qi et al.
// 2023, "Zero Bubble Pipeline Parallelism").
//
// defines: tpx::pipeline::Phase, letter(), Action, to_string(), PipelineShape, LayerRange,
//          EndLayers, split_layers(), microbatch_size(), Costs, stage_work(), Schedule, GPipe, OneFOneB,
//          Interleaved1F1B, ZeroBubbleH1, schedule_names(), schedule_actions(),
//          stages_per_rank_problem(),
//          make_schedule(), Payload, Transfer,
//          message_tag(), transfers(), live_counts(), peak_live(), format_schedule(),
//          TimedAction, SimResult, simulate(), format_timeline(), format_simulation()
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tpx::pipeline {

/// What an action computes: the forward, the backward (the input gradient; in a fused schedule
/// also the weight gradients) or, in a split schedule, the weight gradients alone.
enum class Phase { forward, backward, weight };

/// 'F', 'B' or 'W'.
char letter(Phase p);

/// One pass of one micro-batch through one virtual stage.
struct Action {
  int microbatch = 0;  ///< 0 … M−1
  int stage = 0;       ///< the virtual stage, 0 … P·V−1
  Phase phase = Phase::forward;
  bool operator==(const Action&) const = default;
};

/// "F3" (V = 1) or "F3@5" (micro-batch 3 on virtual stage 5) when a rank holds several stages.
std::string to_string(const Action& a, bool with_stage);

/// The sizes a schedule is made for.
struct PipelineShape {
  int ranks = 1;            ///< P, the pipeline-parallel degree (--pp)
  int microbatches = 1;     ///< M (--microbatches)
  int stages_per_rank = 1;  ///< V (--stages-per-rank): virtual stages per rank
  /// S = P·V, the virtual stages.
  int stages() const { return ranks * stages_per_rank; }
  /// The rank that holds virtual stage s: s mod P.
  int rank_of(int stage) const { return stage % ranks; }
  /// The virtual stages of rank p, ascending: p, p+P, …, p+(V−1)·P.
  std::vector<int> stages_of(int rank) const;
};

/// Layers [first, first+count) of the model.
struct LayerRange {
  int first = 0;
  int count = 0;
  bool operator==(const LayerRange&) const = default;
};

/// The layers of the first and the last virtual stage when given (--first-stage-layers,
/// --last-stage-layers); 0 = not given: that end takes its share of the even split.
struct EndLayers {
  int first = 0;
  int last = 0;
  bool given() const { return first != 0 || last != 0; }
};

/// The layers of each of `stages` virtual stages: contiguous, in stage order. Virtual stage 0
/// takes ends.first layers and stage S−1 ends.last when given; the layers left go evenly over
/// the other stages, the first of them taking one more each until the remainder is spent (with
/// no ends given: the first L mod stages take one layer more). Throws ConfigError, `what`
/// naming the stage count ("--pp 4", "--pp 2 × --stages-per-rank 3"), when a stage would hold
/// no layer (L < stages, or the ends leave fewer layers than stages between them), when an end
/// is given with one stage, or when the two ends of two stages do not add up to L.
std::vector<LayerRange> split_layers(int layers, int stages, std::string_view what,
                                     EndLayers ends = {});

/// The rows of one micro-batch: local_batch / M. Throws ConfigError unless M ≥ 1 divides the
/// local batch.
std::int64_t microbatch_size(std::int64_t local_batch, int microbatches);

/// What each action costs (any unit) and what a message between ranks takes, for simulate() and
/// formula_bubble(). A fused backward costs backward + weight. An action is one pass through one
/// virtual stage: with V stages per rank it covers 1/V of a rank's layers, so to compare an
/// interleaved schedule with a plain one at the same model, divide its costs by V.
struct Costs {
  double forward = 1.0;
  double backward = 1.0;  ///< the input gradient (B)
  double weight = 1.0;    ///< the weight gradients (W)
  double latency = 0.0;  ///< from the end of an action to the start of its consumer on another rank
};

/// Each virtual stage's work in blocks, for simulate()'s stage_work: its layers, plus `first_extra`
/// on stage 0 and `last_extra` on the last stage (the embedding's and the output layer's and
/// loss's time in blocks).
std::vector<double> stage_work(const std::vector<LayerRange>& layers, double first_extra = 0.0,
                               double last_extra = 0.0);

/// Per-rank action lists. The kinds below build theirs; the public constructor takes any lists
/// (tests build broken ones with it), and checks only that they fit the shape: every action's
/// micro-batch and stage exist, its stage belongs to the rank, W appears only when split.
class Schedule {
 public:
  Schedule(std::string name, PipelineShape shape, bool split_backward,
           std::vector<std::vector<Action>> per_rank);
  virtual ~Schedule() = default;
  Schedule(const Schedule&) = default;
  Schedule& operator=(const Schedule&) = default;

  const std::string& name() const { return name_; }
  const PipelineShape& shape() const { return shape_; }
  /// True when the backward is split into B (input gradient) and W (weight gradients).
  bool split_backward() const { return split_; }
  /// Rank p's actions, in the order it runs them.
  const std::vector<Action>& actions(int rank) const;
  /// The idle fraction this kind's paper derives for the given costs with no latency (the same
  /// definition as SimResult::bubble()); NaN for a schedule with no formula.
  virtual double formula_bubble(const Costs& costs) const;

 private:
  std::string name_;
  PipelineShape shape_;
  bool split_ = false;
  std::vector<std::vector<Action>> per_rank_;
};

/// GPipe: every forward, then every backward (micro-batch 0 first). All M micro-batches'
/// activations are alive at the turn. Bubble `(P−1)/(M+P−1)`.
class GPipe final : public Schedule {
 public:
  explicit GPipe(PipelineShape shape);
  double formula_bubble(const Costs& costs) const override;
};

/// 1F1B (PipeDream-Flush): rank p warms up with min(P−p−1, M) forwards, then alternates one
/// forward and one backward, then cools down with the backwards left. At most min(P−p, M)
/// micro-batches alive on rank p; the bubble is GPipe's, `(P−1)/(M+P−1)`.
class OneFOneB final : public Schedule {
 public:
  explicit OneFOneB(PipelineShape shape);
  double formula_bubble(const Costs& costs) const override;
};

/// Interleaved 1F1B (Megatron-LM): V ≥ 2 virtual stages per rank, M a multiple of P. The
/// forwards go in groups of P micro-batches through the rank's first stage, then the same group
/// through its second, …; the backwards in the same groups from the last stage back. Rank p warms
/// up with min(2·(P−p−1) + (V−1)·P, M·V) forwards. Bubble `(P−1)/(V·M+P−1)` with equal costs per
/// virtual stage: the derivation is in schedule.cc.
class Interleaved1F1B final : public Schedule {
 public:
  explicit Interleaved1F1B(PipelineShape shape);
  double formula_bubble(const Costs& costs) const override;
};

/// ZB-H1 (Qi et al. 2023): 1F1B's order of F and B with the backward split; rank p runs its
/// first p steady B's without their W and catches those W's up in the cool-down, where they
/// fill the time 1F1B spends waiting. At most P micro-batches alive on any rank, 1F1B's
/// peak (rank 0's). Bubble `(P−1)(F+B−W) / (M(F+B+W) + (P−1)(F+B−W))` for M ≥ P and W ≤ F, B
/// (formula_bubble() is NaN outside that range).
class ZeroBubbleH1 final : public Schedule {
 public:
  explicit ZeroBubbleH1(PipelineShape shape);
  double formula_bubble(const Costs& costs) const override;
};

/// The names make_schedule() knows: gpipe, 1f1b, interleaved-1f1b, zb-h1.
const std::vector<std::string>& schedule_names();

/// The most actions (over every rank, F, B and W) make_schedule() lists: 10 million, a few
/// hundred MB of lists and simulation.
inline constexpr std::int64_t kMaxScheduleActions = 10'000'000;

/// The actions (over every rank: F and B, and W on zb-h1) of the schedule called `name` for
/// `shape`, P·V·M·2 or ·3, counted in floating point (no overflow), for the kMaxScheduleActions
/// guard.
double schedule_actions(std::string_view name, const PipelineShape& shape);

/// Why the schedule called `name` cannot hold V virtual stages per rank: interleaved-1f1b needs
/// V ≥ 2, the others V = 1. Empty when it can (or the name is unknown: make_schedule's to say).
std::string stages_per_rank_problem(std::string_view name, int V);

/// The schedule called `name` for `shape`. Throws ConfigError (one line) for an unknown name,
/// P, M or V below 1, V ≠ 1 on a schedule other than interleaved-1f1b, V < 2 or M not a
/// multiple of P on interleaved-1f1b, and more than kMaxScheduleActions actions.
std::unique_ptr<Schedule> make_schedule(std::string_view name, const PipelineShape& shape);

/// What a message carries: a forward activation, or the gradient of one going back.
enum class Payload { activation, gradient };

/// One point-to-point message as one rank sees it.
struct Transfer {
  bool send = false;  ///< true: this rank sends; false: it receives
  Payload payload = Payload::activation;
  int microbatch = 0;
  int from_stage = 0;      ///< the virtual stage that produces it
  int to_stage = 0;        ///< the virtual stage that consumes it
  int peer = 0;            ///< the other rank
  int tag = 0;             ///< message_tag(): unique in the step, equal on both sides
  std::size_t action = 0;  ///< index in this rank's list of the action that produces/consumes it
  bool operator==(const Transfer&) const = default;
};

/// A tag unique among the step's messages: the activation (payload 0) or gradient (1) of
/// micro-batch m across the boundary between virtual stages b and b+1.
int message_tag(const PipelineShape& shape, Payload payload, int microbatch, int boundary);

/// Rank p's sends and receives in the order it posts them: each receive just before the action
/// that consumes it, each send just after the action that produces it. Messages between
/// virtual stages of the same rank are not listed.
std::vector<Transfer> transfers(const Schedule& schedule, int rank);

/// The number of live micro-batch activations on rank p after each of its actions: one more
/// after an F, one fewer after the action that frees them (W when split, else B).
std::vector<int> live_counts(const Schedule& schedule, int rank);

/// The largest live count of each rank (counted per virtual stage: with V > 1 a micro-batch on
/// two of a rank's stages counts twice, each being 1/V of the rank's layers).
std::vector<int> peak_live(const Schedule& schedule);

/// The schedule as a readable grid, one row per rank with the actions in order, e.g.
///   schedule 1f1b: P=2 ranks, M=3 micro-batches, V=1 stage per rank (F forward, B backward)
///   rank 0 | F0 F1 B0 F2 B1 B2
///   rank 1 | F0 B0 F1 B1 F2 B2
std::string format_schedule(const Schedule& schedule);

/// An action as simulated: when it started and ended.
struct TimedAction {
  Action action;
  double start = 0.0;
  double end = 0.0;
};

/// What simulate() measured.
struct SimResult {
  std::vector<std::vector<TimedAction>> timeline;  ///< per rank, in list order
  std::vector<double> busy;                        ///< per rank: the sum of its actions' costs
  std::vector<double> idle;    ///< per rank: makespan − busy (waiting, before, between and after)
  std::vector<int> peak_live;  ///< per rank: peak_live()
  std::vector<double> stage_work;  ///< simulate()'s stage_work (empty: 1 on every stage)
  double makespan = 0.0;           ///< the end of the last action of any rank
  /// The bubble: the idle share of all ranks' time, Σ idle / (P · makespan).
  double bubble() const;
  /// Rank p's idle share: idle[p] / makespan.
  double idle_fraction(int rank) const;
};

/// Runs every rank's list in order: an action starts when its rank is free and its inputs are
/// there (F of micro-batch m on stage s after F on s−1; B on s after B on s+1 and after F on s;
/// W after B), plus `costs.latency` for an input that comes from another rank. Throws Error when
/// the lists are not a complete schedule (an action missing or repeated), or when they deadlock:
/// the message names what each stuck rank waits for. `stage_work`, per virtual stage, multiplies
/// the costs of that stage's actions (e.g. its blocks, stage_work()); empty: 1 on every stage.
/// formula_bubble() knows no stage_work (the papers' formulas assume equal stages).
SimResult simulate(const Schedule& schedule, const Costs& costs = {},
                   const std::vector<double>& stage_work = {});

/// The simulated timeline as text, one row per rank and one column per `unit` of time: an
/// action fills round(duration / unit) columns, its name in the first and "-" in the rest; "."
/// is idle. E.g. 1F1B at P = 2, M = 2 with unit costs (a fused backward takes two columns):
///   rank 0 | F0 F1 .  .  B0 -  .  B1 -
///   rank 1 | .  F0 B0 -  F1 B1 -  .  .
/// Throws Error when an action's start or end is not a whole number of units.
std::string format_timeline(const Schedule& schedule, const SimResult& result, double unit = 1.0);

/// The simulation as a table: per rank busy, idle, idle fraction and peak live count, then the
/// makespan, the bubble and the schedule's formula.
std::string format_simulation(const Schedule& schedule, const Costs& costs,
                              const SimResult& result);

}  // namespace tpx::pipeline
