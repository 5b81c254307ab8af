#include "09_pipeline_parallel/pipeline.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/memory.h"
#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/flags.h"
#include "08_context_parallel/layers.h"
#include "08_context_parallel/memory.h"
#include "08_context_parallel/traffic.h"
#include "09_pipeline_parallel/channels.h"
#include "09_pipeline_parallel/executor.h"
#include "09_pipeline_parallel/flags.h"
#include "09_pipeline_parallel/memory.h"
#include "common/block.h"
#include "common/check.h"
#include "common/checked.h"
#include "common/data.h"
#include "common/flops.h"
#include "common/lm.h"
#include "common/memory.h"
#include "common/ops.h"
#include "common/units.h"

namespace tpx::pp {

using cp::CpMethod;
using cp::MeshTraffic;
using pipeline::Action;
using pipeline::LayerRange;
using pipeline::Payload;
using pipeline::Phase;
using pipeline::PipelineShape;
using pipeline::Schedule;
using pipeline::Transfer;

// --- the pipeline's point-to-point lanes ---------------------------------------------------------

/// One payload's messages (activations forward, or gradients back): a communicator over the
/// pipeline group for each color of channels.h, a message travelling on its sender's, and two
/// lanes, one sending and one receiving. A lane, and a communicator, runs its transfers in the
/// order they were queued (NCCL: on one stream), and between two ranks every schedule receives in
/// the order it sends (tested in tests/test_schedule.cc). No rank sends and receives on one
/// communicator, so each queue is a FIFO channel to one peer: a send waits only for its own
/// receive to be posted, never for another message (Channels.TheColorsAndTheLanesNeverDeadlock).
/// The compute thread never waits for a send, only for the receives its next action needs.
struct PipelineParallel::Channel {
  std::vector<std::unique_ptr<Communicator>> comms;  // [color]: what ranks of that color send
  Stream send_lane, recv_lane;
};

PipelineParallel::PipelineParallel(const RunContext& ctx, Mesh mesh,
                                   std::unique_ptr<Parallelism> slice,
                                   std::unique_ptr<Schedule> schedule,
                                   std::vector<LayerRange> layers)
    : mesh_(std::move(mesh)),
      slice_(std::move(slice)),
      schedule_(std::move(schedule)),
      layers_(std::move(layers)),
      config_(ctx.options.config),
      trace_(ctx.trace),
      device_(ctx.options.config.device) {
  if (mesh_.pp == 1) return;
  CommOptions o = ctx.options.comm;
  o.group = mesh_.pp_group;
  // The channels' communicators order their messages apart: lanes of the group in the flight
  // recorder, e.g. "pp group 0.0.0 act even" (what the even ranks send).
  for (auto [c, payload] : {std::pair{&activations_, "act"}, std::pair{&gradients_, "grad"}}) {
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int color = 0; color < pipeline::channel_colors(mesh_.pp); ++color) {
      o.group_label =
          fmt::format("{} {} {}", mesh_.pp_group.name(), payload, pipeline::color_name(color));
      comms.push_back(make_communicator(o, device_));
    }
    // A transfer that blocks its caller (MPI; on cuda it stages through the host) runs on a host
    // lane, a thread of its own, so that the thread issuing compute never waits in it; NCCL only
    // queues its transfers on the lane's stream.
    const bool blocks = comms.front()->blocks_caller();
    auto lane = [&] {
      return blocks ? Stream::create_host_lane(device_) : Stream::create(device_);
    };
    Stream send_lane = lane(), recv_lane = lane();
    *c = std::make_unique<Channel>(Channel{std::move(comms), send_lane, recv_lane});
  }
}

PipelineParallel::~PipelineParallel() {
  // The lanes' queued transfers read tensors and communicators: drained before either goes.
  for (auto* c : {activations_.get(), gradients_.get()})
    if (c) {
      try {
        c->send_lane.synchronize();
        c->recv_lane.synchronize();
      } catch (...) {  // a failed transfer was reported where it was waited for
      }
    }
}

Sharding PipelineParallel::sharding() const {
  return pipeline_sharding(slice_->sharding(),
                           pipeline_memory(config_, *schedule_, layers_, mesh_.pp_index), mesh_.pp);
}

std::string PipelineParallel::comm_name() const {
  // The slice's words without its own mesh (this one names every dimension).
  std::string slice = slice_->comm_name();
  if (slice.starts_with("mesh ")) slice = slice.substr(slice.find("; ") + 2);
  return fmt::format("mesh P {} × D {} × CP {} × TP {}; pp: {}; {}", mesh_.pp, mesh_.dp, mesh_.cp,
                     mesh_.tp, activations_ ? activations_->comms.front()->name() : "none (P = 1)",
                     slice);
}

std::vector<std::int64_t> PipelineParallel::held_layers() const {
  return layers_of(schedule_->shape(), layers_, mesh_.pp_index);
}

BlockConfig PipelineParallel::reference_config(const BlockConfig& c) const {
  BlockConfig r = slice_->reference_config(c);
  r.moe.microbatches = schedule_->shape().microbatches;
  r.moe.replicas = mesh_.dp;
  return r;
}

PipelineParallel::Channel& PipelineParallel::channel(Payload p) {
  TPX_CHECK(activations_, "pipeline transfer with a single stage");
  return p == Payload::activation ? *activations_ : *gradients_;
}

Event PipelineParallel::send(const Transfer& x, const Tensor& t, const std::string& what) {
  Channel& ch = channel(x.payload);
  const Stream& lane = ch.send_lane;
  Communicator& comm = *ch.comms.at(pipeline::channel_color(mesh_.pp_index, mesh_.pp));
  const std::uint64_t booked = comm.book(CommOp::sendrecv, what, x.peer, -1);
  // Behind the compute stream's mark: t has been written.
  return run_after_compute(lane, {t}, [this, &comm, &lane, t, peer = x.peer, what, booked] {
    TraceScope span(trace_, what, Lane::pp_comm);
    comm.sendrecv(t, peer, Tensor(), peer, lane, what, booked);
  });
}

Event PipelineParallel::receive(const Transfer& x, const Tensor& buf, const std::string& what) {
  Channel& ch = channel(x.payload);
  const Stream& lane = ch.recv_lane;
  Communicator& comm = *ch.comms.at(pipeline::channel_color(x.peer, mesh_.pp));
  const std::uint64_t booked = comm.book(CommOp::sendrecv, what, -1, x.peer);
  // Behind the compute stream's mark: buf is free to be written.
  return run_after_compute(lane, {buf}, [this, &comm, &lane, buf, peer = x.peer, what, booked] {
    TraceScope span(trace_, what, Lane::pp_comm);
    comm.sendrecv(Tensor(), peer, buf, peer, lane, what, booked);
  });
}

// The report's collectives over the pipeline go through the activation channel's communicator,
// so the flight recorder has them and the watchdog diagnoses a pipeline stage that never joins
// (a bare MPI call would leave its peers waiting forever).
std::vector<double> PipelineParallel::gather_over_pipeline(double mine) const {
  if (mesh_.pp == 1) return {mine};
  return activations_->comms.front()->all_gather_report(mine, "report gather");
}

void PipelineParallel::pipeline_barrier() const {
  if (mesh_.pp > 1) (void)activations_->comms.front()->all_gather_report(0.0, "step barrier");
}

double PipelineParallel::sum_over_ranks(double local) {
  // Every rank adds the P stages' sums in the same order: the same double everywhere.
  double sum = 0.0;
  for (const double v : gather_over_pipeline(slice_->sum_over_ranks(local))) sum += v;
  return sum;
}

CommStats PipelineParallel::take_comm_stats() {
  CommStats s = slice_->take_comm_stats();
  for (auto* c : {activations_.get(), gradients_.get()})
    if (c)
      for (const auto& comm : c->comms) s.add_group("pp", comm->take_stats());
  return s;
}

void PipelineParallel::synchronize() {
  slice_->synchronize();
  for (auto* c : {activations_.get(), gradients_.get()})
    if (c) {
      c->send_lane.synchronize();
      c->recv_lane.synchronize();
    }
}

// --- the factory ---------------------------------------------------------------------------------

namespace {

/// What the flags ask for, checked: the mesh's sizes, the schedule's shape and the layers.
struct Layout {
  int pp = 1, dp = 1, cp = 1;
  PipelineShape shape;
  std::vector<LayerRange> layers;
};

/// A mesh size as a message names it: "--pp 2" when the flag was given (`flag_value` ≠ 0), "P 2
/// (--pp's default)" when the stage chose it.
std::string size_words(const char* flag, const char* letter, int flag_value, int value) {
  return flag_value != 0 ? fmt::format("{} {}", flag, value)
                         : fmt::format("{} {} ({}'s default)", letter, value, flag);
}

/// The virtual stages P·V, each holding at least one layer: their number, or ConfigError with a
/// --stages-per-rank (or --layers) that fits. `pp` names P as the user gave it.
int checked_stages(const BlockConfig& c, int P, int V, const std::string& pp) {
  // Layers are numbered by int here (LayerRange), so P·V is too: a product beyond the int range
  // is beyond every --layers this stage takes.
  if (c.layers > std::numeric_limits<int>::max())
    throw ConfigError(fmt::format(
        "--layers {} is more than 09_pipeline_parallel takes ({}): it numbers layers as int",
        c.layers, std::numeric_limits<int>::max()));
  const std::optional<int> stages = checked_mul(P, V);
  if (stages && *stages <= c.layers) return *stages;
  const std::int64_t most_v = c.layers / P;  // virtual stages per rank that --layers can fill
  const std::string remedy =
      V == 1        ? fmt::format("give --layers at least {}", P)
      : most_v >= 2 ? fmt::format("give --stages-per-rank at most {} (--layers {} / P {})", most_v,
                                  c.layers, P)
                    : fmt::format(
                          "give --stages-per-rank 2 (the fewest interleaved-1f1b "
                          "takes) and --layers at least {} (P {} × 2)",
                          std::int64_t(P) * 2, P);
  throw ConfigError(fmt::format(
      "{} makes {} pipeline stages but --layers is {}: every stage needs at least one layer; {}",
      V == 1 ? pp : fmt::format("{} × --stages-per-rank {}", pp, V), std::int64_t(P) * V, c.layers,
      remedy));
}

/// ConfigError when the schedule of `shape` would list more than kMaxScheduleActions actions
/// (make_schedule's guard, said before the layers are split or any list is made), naming the
/// flags as given and a smaller --microbatches or --stages-per-rank that fits.
void check_schedule_size(const PipelineFlags& o, const PipelineShape& shape, const std::string& pp,
                         bool interleaved) {
  const double actions = pipeline::schedule_actions(o.schedule, shape);
  const auto limit = double(pipeline::kMaxScheduleActions);
  if (actions <= limit) return;
  // The fewest micro-batches the schedule takes (P divides the local batch on interleaved-1f1b).
  PipelineShape fewest = shape;
  fewest.microbatches = interleaved ? shape.ranks : 1;
  const double per_stage = pipeline::schedule_actions(o.schedule, fewest) / shape.stages_per_rank;
  const std::string remedy =
      fewest.microbatches < shape.microbatches && per_stage * shape.stages_per_rank <= limit
          ? fmt::format("give --microbatches {}", fewest.microbatches)
          : fmt::format("give --stages-per-rank at most {} with --microbatches {}",
                        std::int64_t(limit / per_stage), fewest.microbatches);
  throw ConfigError(fmt::format(
      "{}{} × {} makes {:.3g} schedule actions, more than the {:.3g} a schedule is made with "
      "(every rank's list is held in memory): {}",
      pp,
      shape.stages_per_rank == 1 ? ""
                                 : fmt::format(" × --stages-per-rank {}", shape.stages_per_rank),
      o.microbatches != 0 ? fmt::format("--microbatches {}", shape.microbatches)
                          : fmt::format("M {} (--microbatches' default)", shape.microbatches),
      actions, limit, remedy));
}

Layout layout(const RunContext& ctx) {
  const PipelineFlags& o = ctx.options.flags<PipelineFlags>();
  const BlockConfig& c = ctx.options.config;
  const int given_dp = ctx.options.flags<fsdp::DataParallelFlags>().dp;
  const int given_cp = ctx.options.flags<cp::ContextParallelFlags>().cp;
  const MeshFlag newest = ctx.options.newest_mesh_flag();
  Layout l;
  l.pp = mesh_degree(o.pp, newest, MeshFlag::pp, ctx.world);
  l.dp = mesh_degree(given_dp, newest, MeshFlag::dp, ctx.world);
  l.cp = mesh_degree(given_cp, newest, MeshFlag::cp, ctx.world);
  // The flags are positive when given (cli_flags.h's add_count); P·D·C is checked, not wrapped.
  if (std::string p = Mesh::problem(ctx.world, l.dp, l.cp, l.pp,
                                    {.pp = o.pp != 0, .dp = given_dp != 0, .cp = given_cp != 0});
      !p.empty())
    throw ConfigError(p);
  const std::string pp = size_words("--pp", "P", o.pp, l.pp);
  const int v = o.stages_per_rank;
  if (std::string p = pipeline::stages_per_rank_problem(o.schedule, v); !p.empty())
    throw ConfigError(p);
  const int stages = checked_stages(c, l.pp, v, pp);
  if (c.batch % l.dp != 0)
    throw ConfigError(fmt::format(
        "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", l.dp,
        c.batch));
  const std::int64_t local_batch = c.batch / l.dp;
  const bool interleaved = o.schedule == "interleaved-1f1b";
  // The interleaved schedule takes only multiples of P: one that divides B / D exists exactly
  // when P does, whether --microbatches is given or not.
  if (interleaved && local_batch % l.pp != 0) {
    const std::string batch = l.dp == 1
                                  ? fmt::format("--batch {}", c.batch)
                                  : fmt::format("B / D = {} / {} = {}", c.batch, l.dp, local_batch);
    const std::string fix = fmt::format(
        "give --batch a multiple of {} (P·D), or another --schedule", std::int64_t(l.pp) * l.dp);
    throw ConfigError(
        o.microbatches != 0
            ? fmt::format("--schedule interleaved-1f1b needs --microbatches to be a multiple of "
                          "{} that divides the local batch ({}), and none does: {}",
                          pp, batch, fix)
            : fmt::format("--schedule interleaved-1f1b needs a number of micro-batches that is a "
                          "multiple of {} and divides the local batch ({}), and none does, so "
                          "the default --microbatches has none to take: {}",
                          pp, batch, fix));
  }
  int m = o.microbatches;
  // The default: as many as keep every stage busy in the steady state (P·V), if they fit the
  // local batch and the stage's limit; else P; else 1 (the interleaved schedule takes only
  // multiples of P, and P divides the local batch there).
  if (m == 0)
    for (const int candidate : {stages, l.pp, 1})
      if (candidate <= kMaxMicrobatches && local_batch % candidate == 0 &&
          (!interleaved || candidate % l.pp == 0)) {
        m = candidate;
        break;
      }
  TPX_CHECK(m >= 1, "no default --microbatches for P {}, B / D {}", l.pp, local_batch);
  // A limit of this stage, not of memory: each micro-batch costs every rank its books (the
  // schedule's actions and transfers, the passes' records, the trace's spans: the estimate's
  // "host per micro-batch", about 2.5 KiB per micro-batch and layer) and a step its messages,
  // while the bubble (P−1)/(M+P−1) is already below 0.1 % at M = 65536 for P ≤ 64.
  if (m > kMaxMicrobatches)
    throw ConfigError(fmt::format(
        "--microbatches {} is more than 09_pipeline_parallel takes ({}): every micro-batch "
        "costs each rank its books and a step its messages, and the bubble (P−1)/(M+P−1) is "
        "below 0.1 % at M = {} for P ≤ 64 already; cut the local batch into fewer, larger "
        "micro-batches",
        m, kMaxMicrobatches, kMaxMicrobatches));
  (void)pipeline::microbatch_size(local_batch, m);  // throws unless M divides B / D
  l.shape = {.ranks = l.pp, .microbatches = m, .stages_per_rank = v};
  check_schedule_size(o, l.shape, pp, interleaved);  // before the layers are split P·V ways
  l.layers = pipeline::split_layers(int(c.layers), stages,
                                    v == 1 ? pp : fmt::format("{} × --stages-per-rank {}", pp, v),
                                    {.first = o.first_stage_layers, .last = o.last_stage_layers});
  return l;
}

}  // namespace

std::unique_ptr<Parallelism> make_pipeline(const RunContext& ctx) {
  return make_pipeline_with(ctx, [](const RunContext& c, const Mesh& mesh, const auto& /*held*/) {
    return cp::make_context_parallel_on(c, mesh);
  });
}

std::unique_ptr<Parallelism> make_pipeline_with(const RunContext& ctx, const SliceFactory& slice) {
  Layout l = layout(ctx);
  auto schedule = pipeline::make_schedule(ctx.options.flags<PipelineFlags>().schedule,
                                          l.shape);  // its own checks
  Mesh mesh = Mesh::make(l.dp, l.cp, l.pp);
  auto on_slice = slice(ctx, mesh, layers_of(l.shape, l.layers, mesh.pp_index));
  return std::make_unique<PipelineParallel>(ctx, std::move(mesh), std::move(on_slice),
                                            std::move(schedule), std::move(l.layers));
}

int pipeline_degree(const RunContext& ctx) {
  return layout(ctx).pp;
}

namespace {

/// The language model's output layer and loss in blocks of this config: its FLOPs (forward and
/// backward, 3 · 2·S·B·H·V) over one block's (common/flops.h); 0 under --task block.
double head_in_blocks(const BlockConfig& c) {
  if (!c.lm()) return 0.0;
  BlockConfig one = c;
  one.layers = 1;
  one.task = Task::block;
  const double block = step_flops(one).total();
  return block > 0 ? 3.0 * 2.0 * double(c.seq) * double(c.batch) * double(c.hidden) *
                         double(c.vocab) / block
                   : 0.0;
}

}  // namespace

std::optional<std::string> describe_pipeline(const RunContext& ctx) {
  if (!ctx.options.flags<PipelineFlags>().print_schedule) return std::nullopt;
  const Layout l = layout(ctx);
  const auto schedule =
      pipeline::make_schedule(ctx.options.flags<PipelineFlags>().schedule, l.shape);
  std::string out = pipeline::format_schedule(*schedule);
  out += "layers:";
  for (std::size_t s = 0; s < l.layers.size(); ++s)
    out += fmt::format(" stage {} {}-{}{}", s, l.layers[s].first,
                       l.layers[s].first + l.layers[s].count - 1,
                       s + 1 < l.layers.size() ? "," : "\n");
  // With an end's layers given, each action costs its stage's layers (F = B = W = 1 a block);
  // else one unit each, as for equal stages.
  const bool ends = ctx.options.flags<PipelineFlags>().first_stage_layers != 0 ||
                    ctx.options.flags<PipelineFlags>().last_stage_layers != 0;
  const pipeline::Costs unit;
  const pipeline::SimResult sim = pipeline::simulate(
      *schedule, unit, ends ? pipeline::stage_work(l.layers) : std::vector<double>{});
  out += ends ? "\nsimulated with unit costs per block (F = B = W = 1 a block):\n"
              : "\nsimulated with unit costs (F = B = W = 1):\n";
  out += pipeline::format_timeline(*schedule, sim);
  out += pipeline::format_simulation(*schedule, unit, sim);
  // Each pipeline stage's memory estimate (of its first rank, TP index 0): its layers, its live
  // activations, and the language model's ends on the first and last.
  const Mesh mesh = Mesh::make(l.dp, l.cp, l.pp);
  cp::check_context_parallel(ctx, mesh);
  const CpMethod method = ctx.options.flags<cp::ContextParallelFlags>().method();
  const BlockConfig& c = ctx.options.config;
  out += "\nmemory estimate per pipeline stage (its first rank):\n";
  for (int p = 0; p < l.pp; ++p) {
    const PipelineMemory held = pipeline_memory(c, *schedule, l.layers, p);
    const MemoryEstimate e =
        estimate_training_memory(c, planned_sharding(mesh, method, 0, true, held));
    out += fmt::format("  stage {} ({} layer{}): {}\n", p, held.layers, held.layers == 1 ? "" : "s",
                       bytes_text(e.total()));
  }
  return out;
}

StagePlan plan_pipeline(const RunContext& ctx) {
  return plan_pipeline_with(ctx, {});
}

PipelineSize pipeline_size(const RunContext& ctx) {
  const Layout l = layout(ctx);
  return {.pp = l.pp, .dp = l.dp, .cp = l.cp, .microbatches = l.shape.microbatches};
}

StagePlan plan_pipeline_with(const RunContext& ctx, const SliceDimensions& slice) {
  const Layout l = layout(ctx);
  const auto schedule =
      pipeline::make_schedule(ctx.options.flags<PipelineFlags>().schedule, l.shape);
  const Mesh mesh = Mesh::make(l.dp, l.cp, l.pp);
  cp::check_context_parallel(ctx, mesh);
  const CpMethod method = ctx.options.flags<cp::ContextParallelFlags>().method();
  return pipeline_rank_plan(ctx.options.config, *schedule, l.layers, mesh, method, slice);
}

// --- the training loop ---------------------------------------------------------------------------

namespace {

using namespace training;
using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// Copies batch columns between t [rows, B, H] and part [rows, n, H]: part ← t[:, first:first+n]
/// (to_part) or the reverse.
void copy_batch_columns(const Tensor& t, const Tensor& part, std::int64_t first, bool to_part) {
  const std::int64_t rows = t.dim(0), batch = t.dim(1), hidden = t.dim(2), n = part.dim(1);
  const Tensor flat = t.reshape({rows * batch, hidden}),
               flat_part = part.reshape({rows * n, hidden});
  for (std::int64_t i = 0; i < rows; ++i) {
    const Tensor whole = flat.slice0(i * batch + first, i * batch + first + n);
    const Tensor mine = flat_part.slice0(i * n, (i + 1) * n);
    if (to_part)
      ops::copy(whole, mine);
    else
      ops::copy(mine, whole);
  }
}

/// Micro-batch j of t [rows, B/D, H]: its columns [j·n, (j+1)·n), a new tensor.
Tensor microbatch(const Tensor& t, int j, std::int64_t n) {
  Tensor part = Tensor::empty({t.dim(0), n, t.dim(2)}, t.dtype(), t.device());
  copy_batch_columns(t, part, j * n, /*to_part=*/true);
  return part;
}

/// The micro-batches side by side again: [rows, M·n, H].
Tensor join_microbatches(const std::vector<Tensor>& parts) {
  const Tensor& p0 = parts.front();
  const std::int64_t n = p0.dim(1);
  Tensor t = Tensor::empty({p0.dim(0), n * std::int64_t(parts.size()), p0.dim(2)}, p0.dtype(),
                           p0.device());
  for (std::size_t j = 0; j < parts.size(); ++j)
    copy_batch_columns(t, parts[j], std::int64_t(j) * n, /*to_part=*/false);
  return t;
}

/// Moves a host vector held by the first rank of pipeline stage `from` (job rank from · slice)
/// to job rank 0 (reporting only: the snapshot). Every rank calls it in the same order.
template <class T>
void to_rank0(std::vector<T>& v, int from, int slice_ranks, int rank) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, char>);
  const MPI_Datatype type = std::is_same_v<T, float> ? MPI_FLOAT : MPI_CHAR;
  const int src = from * slice_ranks;
  if (src == 0) return;
  if (rank == src) {
    auto n = static_cast<std::uint64_t>(v.size());
    TPX_MPI_CHECK(MPI_Send(&n, 1, MPI_UINT64_T, 0, 0, MPI_COMM_WORLD));
    TPX_MPI_CHECK(MPI_Send(v.data(), int(n), type, 0, 1, MPI_COMM_WORLD));
  } else if (rank == 0) {
    std::uint64_t n = 0;
    TPX_MPI_CHECK(MPI_Recv(&n, 1, MPI_UINT64_T, src, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    v.resize(n);
    TPX_MPI_CHECK(MPI_Recv(v.data(), int(n), type, src, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
  }
}

/// This rank's place in the job: its pipeline stage, the last one, the ranks of a slice.
struct Place {
  int me;           ///< this rank's pipeline stage
  int last;         ///< the pipeline stage that holds the last virtual stage
  int slice_ranks;  ///< D·C·T: the job ranks of one pipeline stage
  int rank;         ///< the job rank
};

Place place_of(const PipelineParallel& pp) {
  const Mesh& mesh = pp.mesh();
  const PipelineShape shape = pp.schedule().shape();
  Place place{.me = mesh.pp_index,
              .last = shape.rank_of(shape.stages() - 1),
              .slice_ranks = mesh.dp * mesh.cp * mesh.tp,
              .rank = 0};
  TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &place.rank));
  return place;
}

/// Named tensors held by the first rank of pipeline stage `from`, to job rank 0 (reporting): the
/// names and shapes as JSON text, the values as one run of floats. Every rank calls it in the
/// same order; rank 0 returns the stage's tensors, the others nothing.
NamedValues named_to_rank0(const NamedValues& mine, int from, const Place& place) {
  std::vector<char> head;
  std::vector<float> values;
  if (place.me == from) {
    nlohmann::json h = nlohmann::json::array();
    for (const NamedArray<float>& t : mine) {
      h.push_back({t.name, t.shape});
      values.insert(values.end(), t.values.begin(), t.values.end());
    }
    const std::string text = h.dump();
    head.assign(text.begin(), text.end());
  }
  to_rank0(head, from, place.slice_ranks, place.rank);
  to_rank0(values, from, place.slice_ranks, place.rank);
  NamedValues out;
  if (place.rank != 0) return out;
  std::size_t at = 0;
  for (const nlohmann::json& t : nlohmann::json::parse(head.begin(), head.end())) {
    NamedArray<float> a{.name = t[0], .shape = t[1], .values = {}};
    std::size_t n = 1;
    for (const std::int64_t d : a.shape) n *= std::size_t(d);
    TPX_CHECK(at + n <= values.size(), "{}: {} values past the {} sent", a.name, at + n,
              values.size());
    a.values.assign(values.begin() + std::ptrdiff_t(at), values.begin() + std::ptrdiff_t(at + n));
    at += n;
    out.push_back(std::move(a));
  }
  return out;
}

/// The language model's ends on the pipeline's ends: the embedding where stage 0 runs, the final
/// norm and the output layer where the last stage does; the other ranks let theirs go before the
/// slice shards what it holds.
void keep_held_ends(const BlockConfig& c, const Place& place, Model& model) {
  if (!c.lm()) return;
  if (place.me != 0) model.lm.embedding = model.lm_grads.embedding = Tensor();
  if (place.me != place.last)
    model.lm.norm_f = model.lm_grads.norm_f = model.lm.w_out = model.lm_grads.w_out = Tensor();
}

/// Stage 0 keeps the input's micro-batches (in the activations' dtype), the last stage the
/// target's; the whole tensors stay only where the snapshot reads them, and a rank lets go of
/// what it does not use before it splits what it does. Returns the micro-batch's rows B/(D·M).
std::int64_t split_microbatches(const BlockConfig& c, const Sharding& sh, const Place& place,
                                int microbatches, bool snapshot, Model& model, Executor& ex) {
  if (c.lm()) {
    const std::int64_t rows = c.batch / sh.dp / microbatches;
    ex.message_shape = {c.seq / sh.cp / (sh.sequence ? sh.world : 1), rows, c.hidden};
    return rows;
  }
  const std::int64_t rows = model.input.dim(1) / microbatches;
  ex.message_shape = {model.input.dim(0), rows, model.input.dim(2)};
  if (place.me != 0) model.input = Tensor();
  if (place.me != place.last) model.target = Tensor();
  if (place.me == 0) {
    const Tensor input = as_dtype(model.input, c.activations());
    if (!snapshot) model.input = Tensor();
    for (int j = 0; j < microbatches; ++j) ex.inputs.push_back(microbatch(input, j, rows));
  }
  if (place.me == place.last) {
    for (int j = 0; j < microbatches; ++j) ex.targets.push_back(microbatch(model.target, j, rows));
    if (!snapshot) model.target = Tensor();
  }
  return rows;
}

/// The step's token ids and targets [rows, B/D] cut into M micro-batches of `rows` columns.
std::vector<lm::RankTokens> microbatch_tokens(const lm::RankTokens& all, int microbatches,
                                              std::int64_t rows) {
  std::vector<lm::RankTokens> out;
  auto part = [&](const Tensor& t, int j) {
    const Tensor p = microbatch(t.reshape({t.dim(0), t.dim(1), 1}), j, rows);
    return p.reshape({t.dim(0), rows});
  };
  for (int j = 0; j < microbatches; ++j) out.push_back({part(all.tokens, j), part(all.targets, j)});
  return out;
}

/// The measured steps' times on this rank (steps 1 …; step 0 warms up, unless it is the only
/// one) and its peak of live activations.
struct StepTimes {
  double idle_ms = 0, busy_ms = 0, wall_ms = 0;
  int measured = 0, peak_live = 0;
};

/// The pipeline's part of the step, between two barriers of the pipeline group: its wall time
/// less the actions' own time is this rank's idle time (the bubble, and waits).
Executor::Result run_actions(PipelineParallel& pp, Executor& ex,
                             const std::vector<LayerParams>& params, bool keep, bool measured,
                             StepTimes& times) {
  pp.pipeline_barrier();
  const auto start = Clock::now();
  Executor::Result r = ex.run(params, keep);
  pp.synchronize();
  pp.pipeline_barrier();
  const double wall = ms_between(start, Clock::now());
  times.peak_live = std::max(times.peak_live, r.peak_live);
  if (measured) {
    times.idle_ms += wall - r.busy_ms;
    times.busy_ms += r.busy_ms;
    times.wall_ms += wall;
    ++times.measured;
  }
  return r;
}

/// `make()` on rank `from` of this rank's pipeline, sent to the pipeline's rank 0 (not counted:
/// reporting). Every rank of the pipeline calls it; the others' values are empty.
template <typename Make>
std::vector<float> gathered(const Place& place, int from, Make&& make) {
  std::vector<float> v;
  if (place.me == from) v = host_copy(make());
  to_rank0(v, from, place.slice_ranks, place.rank);
  return v;
}

/// On rank 0, into s.params and s.lm_params (with `grads`, s.grads and s.lm_grads too): the whole
/// model, each pipeline stage's slice gathering what it holds to its first rank, which sends it
/// on. Every rank calls it.
void gather_model(const BlockConfig& c, PipelineParallel& pp, const Place& place,
                  const Model& model, bool grads, Snapshot& snap) {
  Parallelism& slice = pp.slice();
  if (c.lm()) {
    const auto params = model.lm.all(), lm_grads = model.lm_grads.all();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const int owner = i == 0 ? 0 : place.last;
      const Split split = kLmSplits[i];
      snap.lm_params[i] = unpadded_vocab(
          c, split, gathered(place, owner, [&] { return slice.gather_vocab(split, *params[i]); }));
      if (grads)
        snap.lm_grads[i] = unpadded_vocab(c, split, gathered(place, owner, [&] {
                                            return slice.gather_vocab(split, *lm_grads[i]);
                                          }));
    }
  }
  snap.params.resize(std::size_t(c.layers));
  if (grads) snap.grads.resize(std::size_t(c.layers));
  const std::vector<std::int64_t> held = pp.held_layers();
  std::map<std::int64_t, std::size_t> local;
  for (std::size_t i = 0; i < held.size(); ++i) local[held[i]] = i;
  const PipelineShape shape = pp.schedule().shape();
  for (std::size_t stage = 0; stage < pp.layers().size(); ++stage) {
    const LayerRange& range = pp.layers()[stage];
    const int owner = shape.rank_of(int(stage));
    for (int l = range.first; l < range.first + range.count; ++l)
      for (Param p : kAllParams) {
        const auto i = static_cast<std::size_t>(p);
        snap.params[std::size_t(l)][i] = gathered(
            place, owner, [&] { return slice.gather_param(p, model.params[local.at(l)][p]); });
        if (grads)
          snap.grads[std::size_t(l)][i] = gathered(
              place, owner, [&] { return slice.gather_param(p, model.grads[local.at(l)][p]); });
      }
  }
}

/// On rank 0, into snap: the stage's extra parameters and their gradients (stage 10's experts),
/// each pipeline stage's slice gathering those of its layers, and the dump's extra tensors, each
/// stage's rows (one per layer) stacked in stage order; a layer whose MLP is the stage's branch
/// has no dense SwiGLU to report. Every rank calls it.
void gather_extra(const BlockConfig& c, PipelineParallel& pp, const Place& place,
                  ExtraParameters& extra, Snapshot& snap) {
  std::vector<NamedArray<float>> stacked;  // the dump's extra tensors, by name in first order
  for (int from = 0; from < pp.mesh().pp; ++from) {
    NamedValues params, grads, dump;
    if (place.me == from) {
      extra.snapshot(params, grads);
      for (const auto& [name, t] : pp.slice().dump_extra())
        dump.push_back({.name = name, .shape = t.shape(), .values = host_copy(t)});
    }
    for (NamedArray<float>& t : named_to_rank0(params, from, place))
      snap.extra_params.push_back(std::move(t));
    for (NamedArray<float>& t : named_to_rank0(grads, from, place))
      snap.extra_grads.push_back(std::move(t));
    for (NamedArray<float>& t : named_to_rank0(dump, from, place)) {
      auto it = std::ranges::find(stacked, t.name, &NamedArray<float>::name);
      if (it == stacked.end() || t.shape.empty()) {
        stacked.push_back(std::move(t));
        continue;
      }
      it->shape[0] += t.shape[0];
      it->values.insert(it->values.end(), t.values.begin(), t.values.end());
    }
  }
  for (const NamedArray<float>& t : stacked) {
    Tensor whole = Tensor::empty(t.shape, DType::f32, Device::cpu);
    std::ranges::copy(t.values, whole.f32().begin());
    snap.extra.emplace_back(t.name, whole);
  }
  for (std::size_t l = 0; l < snap.params.size(); ++l)
    if (c.moe.layer(std::int64_t(l)))
      for (Param p : {Param::w_gate, Param::w_up, Param::w_down}) {
        snap.params[l][std::size_t(p)].clear();
        snap.grads[l][std::size_t(p)].clear();
      }
}

/// On rank 0: the extra parameters' --json summary (ExtraParameters::summary()) of every pipeline
/// stage, joined (ExtraParameters::joined()). Every rank calls it.
nlohmann::json gather_summary(const Place& place, int stages, const ExtraParameters& extra) {
  std::vector<nlohmann::json> parts;
  for (int from = 0; from < stages; ++from) {
    std::vector<char> text;
    if (place.me == from) {
      const std::string mine = extra.summary().dump();
      text.assign(mine.begin(), mine.end());
    }
    to_rank0(text, from, place.slice_ranks, place.rank);
    if (place.rank == 0) parts.push_back(nlohmann::json::parse(text.begin(), text.end()));
  }
  return place.rank == 0 ? extra.joined(parts) : nlohmann::json();
}

/// The whole step 0 on rank 0: the model and its gradients (gather_model()), the input, output
/// and input gradient. Every rank calls it.
void take_snapshot(const BlockConfig& c, PipelineParallel& pp, const Place& place,
                   const Model& model, const Executor::Result& r, const TokenBatch& batch,
                   Snapshot& snap) {
  Parallelism& slice = pp.slice();
  const int last = place.last;
  if (c.lm()) {
    snap.input =
        gathered(place, 0, [&] { return slice.gather_activation(join_microbatches(r.x)); });
    snap.tokens = batch.tokens;
    snap.targets = batch.targets;
  } else {
    snap.input = gathered(place, 0, [&] { return slice.gather_activation(model.input); });
    snap.target = gathered(place, last, [&] { return slice.gather_activation(model.target); });
  }
  snap.output =
      gathered(place, last, [&] { return slice.gather_activation(join_microbatches(r.y)); });
  snap.input_grad =
      gathered(place, 0, [&] { return slice.gather_activation(join_microbatches(r.dx)); });
  gather_model(c, pp, place, model, /*grads=*/true, snap);
  if (ExtraParameters* extra = slice.extra_parameters()) gather_extra(c, pp, place, *extra, snap);
}

/// --json's "pipeline": the schedule, per pipeline stage its layers, live count and measured idle
/// time (the pipeline of rank 0: every pipeline runs the same schedule), and the bubble the
/// simulation gives with each virtual stage's actions costing its blocks, the output layer and
/// loss (--task lm) adding their FLOPs in blocks to the last stage's.
nlohmann::json pipeline_report(const BlockConfig& c, const PipelineParallel& pp,
                               const StepTimes& times, std::int64_t microbatch_rows) {
  const Schedule& schedule = pp.schedule();
  const PipelineShape shape = schedule.shape();
  std::vector<int> stage_layers(std::size_t(shape.ranks), 0);
  for (std::size_t s = 0; s < pp.layers().size(); ++s)
    stage_layers[std::size_t(shape.rank_of(int(s)))] += pp.layers()[s].count;
  const std::vector<double> blocks = pipeline::stage_work(pp.layers(), 0.0, head_in_blocks(c));
  const double steps = times.measured > 0 ? double(times.measured) : 1.0;
  const std::vector<double> idle = pp.gather_over_pipeline(times.idle_ms / steps);
  const std::vector<double> busy = pp.gather_over_pipeline(times.busy_ms / steps);
  const std::vector<double> wall = pp.gather_over_pipeline(times.wall_ms / steps);
  const std::vector<double> live = pp.gather_over_pipeline(double(times.peak_live));
  double idle_all = 0, wall_all = 0;
  for (std::size_t p = 0; p < idle.size(); ++p) {
    idle_all += idle[p];
    wall_all += wall[p];
  }
  std::vector<int> live_counts(live.begin(), live.end());
  return {
      {"schedule", schedule.name()},
      {"pp", shape.ranks},
      {"microbatches", shape.microbatches},
      {"stages_per_rank", shape.stages_per_rank},
      {"microbatch_rows", microbatch_rows},
      {"split_backward", schedule.split_backward()},
      {"stage_layers", stage_layers},
      {"live_peak", live_counts},
      {"schedule_live_peak", pipeline::peak_live(schedule)},
      {"idle_ms", idle},
      {"busy_ms", busy},
      {"wall_ms", wall},
      {"bubble_measured", wall_all > 0 ? idle_all / wall_all : 0.0},
      {"bubble_formula", schedule.formula_bubble(pipeline::Costs{})},
      {"bubble_simulated", pipeline::simulate(schedule, {}, blocks).bubble()},
      {"measured_steps", times.measured},
  };
}

}  // namespace

TrainResult train_pipeline(const BlockConfig& c, Parallelism& par, bool snapshot, Trace& trace,
                           const std::function<void(const StepRow&)>& on_row) {
  auto& pp = static_cast<PipelineParallel&>(par);
  const Place place = place_of(pp);
  const Sharding sh = pp.slice().sharding();
  Model model = make_model(c, sh, pp.held_layers());
  keep_held_ends(c, place, model);
  pp.slice().shard_model(model);  // this rank's tokens and batch part; its layers' shards
  Executor ex(c, pp, model, trace);
  const std::int64_t microbatch_rows =
      split_microbatches(c, sh, place, pp.schedule().shape().microbatches, snapshot, model, ex);
  // --task lm: the token stream, and the positions this rank's slice looks up and scores.
  const std::optional<TokenStream> stream =
      c.lm() ? std::optional<TokenStream>(std::in_place, c) : std::nullopt;
  const TokenCut cut = c.lm() ? pp.slice().token_cut(c) : TokenCut{};
  TokenBatch batch;
  const double positions = double(c.seq) * double(c.batch);

  std::vector<LayerParams> params;
  // --eval-every: the model's loss on the held-out split's batch of this step, forward only
  // through the pipeline with the parameters the step trained with (before its update), cut
  // into the step's micro-batches; its traffic is not the step's.
  auto held_out_loss = [&](int step) {
    TraceScope scope(trace, "held-out loss", Lane::phase);
    par.take_comm_stats();
    const std::vector<lm::RankTokens> valid =
        microbatch_tokens(lm::cut_tokens(stream->batch(step, DataSplit::valid), cut, c.device),
                          pp.schedule().shape().microbatches, microbatch_rows);
    const double mine = ex.evaluate(params, valid);
    par.synchronize();  // its messages are through before the sum's collective
    const double loss = par.sum_over_ranks(mine) / positions;
    par.synchronize();
    par.take_comm_stats();
    return loss;
  };
  Moments moments = make_moments(c, model);
  // Checkpoints: the slice's cut of the layers and ends this pipeline stage holds.
  Sharding held = sh;
  held.layers = pp.held_layers();
  held.embedding = place.me == 0;
  held.head = place.me == place.last;
  Checkpoints checkpoints(c, held, model, moments);
  const int first = checkpoints.first_step();
  TrainResult result;
  par.synchronize();
  ops::synchronize(c.device);
  par.take_comm_stats();

  StepTimes times;
  for (int step = first; step < c.steps; ++step) {
    const auto start = Clock::now();
    StepRow row;
    row.step = step;
    {
      std::optional<TraceScope> op;
      if (c.bf16_weight_copies()) op.emplace(trace, "bf16 weight copies");
      make_compute_copies(c, model, params);
      lm_compute_copies(c, model, ex.lm_params);
    }
    if (stream) {
      batch = stream->batch(step);
      ex.tokens = microbatch_tokens(lm::cut_tokens(batch, cut, c.device),
                                    pp.schedule().shape().microbatches, microbatch_rows);
    }
    const bool keep = snapshot && step == first;
    const Executor::Result r =
        run_actions(pp, ex, params, keep, /*measured=*/step > first || c.steps == first + 1, times);
    if (step == first) result.saved_activation_bytes = r.peak_saved;
    row.loss = c.lm() ? par.sum_over_ranks(r.loss_sum) / positions
                      : 0.5 * par.sum_over_ranks(r.loss_sum) / (positions * double(c.hidden));
    if (const ExtraParameters* extra = pp.extra_parameters())
      row.loss += par.sum_over_ranks(extra->loss_part());  // the experts' auxiliary losses
    row.grad_norm = grad_norm(par, model, sh, trace);
    if (result.diverged = divergence(row, c.lr); !result.diverged.empty()) {
      par.synchronize();
      ops::synchronize(c.device);
      break;  // no update from a non-finite gradient; the rows so far stay
    }
    par.synchronize();
    ops::synchronize(c.device);
    double ms = ms_between(start, Clock::now());
    add(row.comm, r.comm);
    add(row.comm, par.take_comm_stats());
    add(row.comm, r.recompute_comm);  // the step's traffic includes the recompute's
    row.recompute_comm = r.recompute_comm;
    row.exposed_comm_ms = trace.exposed_comm_ms(start, Clock::now());
    if (keep) {
      result.first.loss = row.loss;
      take_snapshot(c, pp, place, model, r, batch, result.first);
      par.take_comm_stats();
      model.input = Tensor();
      model.target = Tensor();
    }
    if (c.evaluates(step)) row.eval_loss = held_out_loss(step);
    finish_step(c, par, model, moments, params, ex.lm_params, trace, row, ms);
    checkpoints.after_step(row, trace);
    result.rows.push_back(row);
    if (on_row) on_row(row);
  }
  checkpoints.finish(result);
  if (c.generate.tokens > 0 && result.diverged.empty()) {
    gather_model(c, pp, place, model, /*grads=*/false, result.trained);  // reporting
    par.take_comm_stats();
  }
  if (const ExtraParameters* extra = pp.extra_parameters())
    result.extra = gather_summary(place, pp.mesh().pp, *extra);
  result.extra["pipeline"] = pipeline_report(c, pp, times, microbatch_rows);
  return result;
}

}  // namespace tpx::pp
