#include "09_pipeline_parallel/pipeline.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "08_context_parallel/layers.h"
#include "common/block.h"
#include "common/check.h"
#include "common/ops.h"

namespace tpx::pp {

using pipeline::Action;
using pipeline::LayerRange;
using pipeline::Payload;
using pipeline::Phase;
using pipeline::PipelineShape;
using pipeline::Schedule;
using pipeline::Transfer;

// --- the pipeline's point-to-point lanes ---------------------------------------------------------

/// One payload's messages (activations forward, or gradients back): a communicator over the
/// pipeline group and two lanes, one sending and one receiving. A lane runs its transfers in the
/// order they were queued, and between two ranks every schedule receives in the order it sends
/// (tested in tests/test_schedule.cc), so each lane pair is a FIFO channel: a send waits only for
/// its own receive to be posted, never for another message. The compute thread never waits for a
/// send, only for the receives its next action needs.
struct PipelineParallel::Channel {
  std::unique_ptr<Communicator> comm;
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
      trace_(ctx.trace),
      device_(ctx.options.config.device) {
  if (mesh_.pp == 1) return;
  CommOptions o = ctx.options.comm;
  o.group = mesh_.pp_group;
  // The two channels order their messages apart: two lanes of the group in the flight recorder.
  for (auto [c, payload] : {std::pair{&activations_, "act"}, std::pair{&gradients_, "grad"}}) {
    o.group_label = fmt::format("{} {}", mesh_.pp_group.name(), payload);
    *c = std::make_unique<Channel>(
        Channel{make_communicator(o, device_), Stream::create(device_), Stream::create(device_)});
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

namespace {

/// `slice` (a pipeline stage's ranks' sharding) with what rank `pp_index` of the pipeline holds:
/// its layers, and the peaks of the schedule's live activations and waiting loss gradients.
Sharding pipeline_sharding(Sharding s, const Schedule& schedule,
                           const std::vector<LayerRange>& layers, int pp_index) {
  const PipelineShape& shape = schedule.shape();
  s.pp = shape.ranks;
  s.microbatches = shape.microbatches;
  s.pp_layers = 0;
  for (const int stage : shape.stages_of(pp_index)) s.pp_layers += layers[std::size_t(stage)].count;
  // The schedule's peaks on this rank: live (micro-batch, layer) activations, and loss
  // gradients waiting for the last stage's backward.
  const int last = shape.stages() - 1;
  std::int64_t live = 0, peak = 0, passes = 0, peak_passes = 0, losses = 0, peak_losses = 0;
  for (const Action& a : schedule.actions(pp_index)) {
    const std::int64_t n = layers[std::size_t(a.stage)].count;
    if (a.phase == Phase::forward) {
      live += n;
      ++passes;
      if (a.stage == last) ++losses;
    } else if (a.phase == Phase::weight || !schedule.split_backward()) {
      live -= n;
      --passes;
    }
    if (a.phase == Phase::backward && a.stage == last) --losses;
    peak = std::max(peak, live);
    peak_passes = std::max(peak_passes, passes);
    peak_losses = std::max(peak_losses, losses);
  }
  s.pp_live_layers = peak;
  s.pp_live_passes = peak_passes;
  s.pp_loss_grads = peak_losses;
  s.pp_split_backward = schedule.split_backward();
  s.pp_holds_input = pp_index == shape.rank_of(0);
  s.pp_holds_target = pp_index == shape.rank_of(last);
  return s;
}

}  // namespace

Sharding PipelineParallel::sharding() const {
  return pipeline_sharding(slice_->sharding(), *schedule_, layers_, mesh_.pp_index);
}

std::string PipelineParallel::comm_name() const {
  // The slice's words without its own mesh (this one names every dimension).
  std::string slice = slice_->comm_name();
  if (slice.starts_with("mesh ")) slice = slice.substr(slice.find("; ") + 2);
  return fmt::format("mesh P {} × D {} × CP {} × TP {}; pp: {}; {}", mesh_.pp, mesh_.dp, mesh_.cp,
                     mesh_.tp, activations_ ? activations_->comm->name() : "none (P = 1)", slice);
}

std::vector<std::int64_t> PipelineParallel::held_layers() const {
  std::vector<std::int64_t> held;
  for (const int s : schedule_->shape().stages_of(mesh_.pp_index)) {
    const LayerRange& r = layers_[std::size_t(s)];
    for (int l = r.first; l < r.first + r.count; ++l) held.push_back(l);
  }
  return held;
}

PipelineParallel::Channel& PipelineParallel::channel(Payload p) {
  TPX_CHECK(activations_, "pipeline transfer with a single stage");
  return p == Payload::activation ? *activations_ : *gradients_;
}

Event PipelineParallel::send(const Transfer& x, const Tensor& t, const std::string& what) {
  Channel& ch = channel(x.payload);
  const Stream compute(device_);
  Event ready(device_);
  ready.record(compute);  // t has been written
  ready.wait(ch.send_lane);
  record_stream(t, ch.send_lane);
  const std::uint64_t booked = ch.comm->book(CommOp::sendrecv, what, x.peer, -1);
  ch.send_lane.run([this, &ch, t, peer = x.peer, what, booked] {
    TraceScope span(trace_, what, Lane::pp_comm);
    ch.comm->sendrecv(t, peer, Tensor(), peer, ch.send_lane, what, booked);
  });
  Event done(device_);
  done.record(ch.send_lane);
  return done;
}

Event PipelineParallel::receive(const Transfer& x, const Tensor& buf, const std::string& what) {
  Channel& ch = channel(x.payload);
  const Stream compute(device_);
  Event ready(device_);
  ready.record(compute);  // buf is free to be written
  ready.wait(ch.recv_lane);
  record_stream(buf, ch.recv_lane);
  const std::uint64_t booked = ch.comm->book(CommOp::sendrecv, what, -1, x.peer);
  ch.recv_lane.run([this, &ch, buf, peer = x.peer, what, booked] {
    TraceScope span(trace_, what, Lane::pp_comm);
    ch.comm->sendrecv(Tensor(), peer, buf, peer, ch.recv_lane, what, booked);
  });
  Event done(device_);
  done.record(ch.recv_lane);
  return done;
}

// The report's collectives over the pipeline go through the activation channel's communicator,
// so the flight recorder has them and the watchdog diagnoses a pipeline stage that never joins
// (a bare MPI call would leave its peers waiting forever).
std::vector<double> PipelineParallel::gather_over_pipeline(double mine) const {
  if (mesh_.pp == 1) return {mine};
  return activations_->comm->all_gather_report(mine, "report gather");
}

void PipelineParallel::pipeline_barrier() const {
  if (mesh_.pp > 1) (void)activations_->comm->all_gather_report(0.0, "step barrier");
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
      s.add_group(c->comm->take_stats(), &CommStats::pp_payload_bytes, &CommStats::pp_bus_bytes);
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

Layout layout(const RunContext& ctx) {
  const StageOptions& o = ctx.options;
  const BlockConfig& c = o.config;
  Layout l;
  l.pp = o.pp != 0 ? o.pp : mesh_default(MeshFlag::pp, MeshFlag::pp, ctx.world);
  l.dp = o.dp != 0 ? o.dp : mesh_default(MeshFlag::pp, MeshFlag::dp, ctx.world);
  l.cp = o.cp != 0 ? o.cp : mesh_default(MeshFlag::pp, MeshFlag::cp, ctx.world);
  if (l.pp < 1)
    throw ConfigError(fmt::format("--pp must be a positive number of stages (got {})", l.pp));
  if (l.dp < 1)
    throw ConfigError(
        fmt::format("--dp must be a positive number of data-parallel replicas (got {})", l.dp));
  if (l.cp < 1)
    throw ConfigError(
        fmt::format("--cp must be a positive number of sequence parts (got {})", l.cp));
  if (ctx.world % (l.pp * l.dp * l.cp) != 0)
    throw ConfigError(fmt::format(
        "--pp {} × --dp {} × --cp {} must divide the {} ranks of the job (the mesh is P × D × C "
        "× TP, TP = ranks / (P·D·C))",
        l.pp, l.dp, l.cp, ctx.world));
  if (o.stages_per_rank < 1)
    throw ConfigError(
        fmt::format("--stages-per-rank must be at least 1 (got {})", o.stages_per_rank));
  if (c.batch % l.dp != 0)
    throw ConfigError(fmt::format(
        "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", l.dp,
        c.batch));
  const int local_batch = int(c.batch / l.dp);
  const int v = o.stages_per_rank;
  int m = o.microbatches;
  // The default: as many as keep every stage busy in the steady state, if they fit (the
  // interleaved schedule takes only multiples of P).
  const bool interleaved = o.schedule == "interleaved-1f1b";
  if (m == 0) {
    for (const int candidate : {l.pp * v, l.pp, 1})
      if (local_batch % candidate == 0 && (!interleaved || candidate % l.pp == 0)) {
        m = candidate;
        break;
      }
    if (m == 0)
      throw ConfigError(fmt::format(
          "--schedule interleaved-1f1b needs a number of micro-batches that is a multiple of "
          "--pp {}, and the default --microbatches (the largest of P·V {}, P {} and 1 that "
          "divides B / D) finds none that divides the local batch of {}: give --batch a "
          "multiple of {}, or --microbatches",
          l.pp, l.pp * v, l.pp, local_batch, std::int64_t(l.pp) * l.dp));
  }
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
  l.layers =
      pipeline::split_layers(int(c.layers), l.shape.stages(),
                             v == 1 ? fmt::format("--pp {}", l.pp)
                                    : fmt::format("--pp {} × --stages-per-rank {}", l.pp, v));
  if (c.recompute != Recompute::none)
    throw ConfigError(
        "--recompute is not offered by 09_pipeline_parallel yet: a pipeline keeps the "
        "activations of several micro-batches, and its memory estimate counts them whole");
  if (l.pp > 1 && c.device != Device::cpu)
    throw ConfigError(
        "--pp > 1 runs on --device cpu in this build: the pipeline's send and receive lanes are "
        "host threads on the cpu backend, and a cuda stream would block its host thread in each "
        "host-staged transfer");
  return l;
}

}  // namespace

std::unique_ptr<Parallelism> make_pipeline(const RunContext& ctx) {
  Layout l = layout(ctx);
  auto schedule = pipeline::make_schedule(ctx.options.schedule, l.shape);  // its own checks
  Mesh mesh = Mesh::make(l.dp, l.cp, l.pp);
  auto slice = cp::make_context_parallel_on(ctx, mesh);
  return std::make_unique<PipelineParallel>(ctx, std::move(mesh), std::move(slice),
                                            std::move(schedule), std::move(l.layers));
}

std::string describe_pipeline(const RunContext& ctx) {
  const Layout l = layout(ctx);
  const auto schedule = pipeline::make_schedule(ctx.options.schedule, l.shape);
  std::string out = pipeline::format_schedule(*schedule);
  out += "layers:";
  for (std::size_t s = 0; s < l.layers.size(); ++s)
    out += fmt::format(" stage {} {}-{}{}", s, l.layers[s].first,
                       l.layers[s].first + l.layers[s].count - 1,
                       s + 1 < l.layers.size() ? "," : "\n");
  const pipeline::Costs unit;
  const pipeline::SimResult sim = pipeline::simulate(*schedule, unit);
  out += "\nsimulated with unit costs (F = B = W = 1):\n";
  out += pipeline::format_timeline(*schedule, sim);
  out += pipeline::format_simulation(*schedule, unit, sim);
  return out;
}

StagePlan plan_pipeline(const RunContext& ctx) {
  const BlockConfig& c = ctx.options.config;
  const Layout l = layout(ctx);
  const auto schedule = pipeline::make_schedule(ctx.options.schedule, l.shape);
  const Mesh mesh = Mesh::make(l.dp, l.cp, l.pp);
  cp::check_context_parallel(ctx, mesh);
  const CpMethod method = ctx.options.cp_method;
  const Sharding slice{.rank = mesh.tp_index,
                       .world = mesh.tp,
                       .weights = true,
                       .sequence = true,
                       .dp = mesh.dp,
                       .cp = mesh.cp,
                       .cp_method = mesh.cp > 1 ? method : CpMethod::ring};
  StagePlan p;
  p.sharding = pipeline_sharding(slice, *schedule, l.layers, mesh.pp_index);
  // The slice's traffic on this rank's layers, once per micro-batch (the TP and CP bytes of a
  // micro-batch, M times; FSDP's gathers for every micro-batch, its reduce-scatter once).
  BlockConfig mine = c;
  mine.layers = p.sharding.pp_layers;
  BlockConfig micro = mine;
  micro.batch = c.batch / l.shape.microbatches;
  const MeshTraffic t = mesh_traffic(micro, mesh.dp, mesh.cp, mesh.tp, method);
  const auto m = std::uint64_t(l.shape.microbatches);
  const Traffic tp{t.tp.payload * m, t.tp.bus * m, t.tp.calls * m};
  p.cp_traffic = {t.cp.payload * m, t.cp.bus * m, t.cp.calls * m};
  p.dp_traffic = mesh.dp * mesh.cp > 1
                     ? fsdp_traffic(mine, mesh.tp, mesh.dp * mesh.cp, l.shape.microbatches)
                     : Traffic{};
  // The pipeline's messages: every send of the schedule on this rank carries one micro-batch's
  // [S/(C·T), B/(D·M), H] activation (or its gradient); a receive is a call that sends nothing.
  const std::uint64_t message = std::uint64_t(c.seq / (mesh.cp * mesh.tp)) *
                                std::uint64_t(micro.batch / mesh.dp) * std::uint64_t(c.hidden) *
                                std::uint64_t(dtype_size(c.activations()));
  for (const Transfer& x : pipeline::transfers(*schedule, mesh.pp_index)) {
    p.pp_traffic.calls += 1;
    if (x.send) {
      p.pp_traffic.payload += message;
      p.pp_traffic.bus += message;
    }
  }
  p.traffic = tp;
  for (const Traffic* part : {&p.cp_traffic, &p.dp_traffic, &p.pp_traffic}) p.traffic += *part;
  p.comm = fmt::format("mesh P {} × D {} × CP {} × TP {}, {} with M {} (dry run)", mesh.pp, mesh.dp,
                       mesh.cp, mesh.tp, schedule->name(), l.shape.microbatches);
  return p;
}

// --- the executor --------------------------------------------------------------------------------

namespace {

using namespace training;
using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// Copies batch columns between t [rows, B, H] and part [rows, n, H]: part ← t[:, first:first+n]
/// (to_part) or the reverse.
void copy_batch_columns(const Tensor& t, const Tensor& part, std::int64_t first, bool to_part) {
  const std::int64_t rows = t.dim(0), b = t.dim(1), h = t.dim(2), n = part.dim(1);
  const Tensor flat = t.reshape({rows * b, h}), flat_part = part.reshape({rows * n, h});
  for (std::int64_t i = 0; i < rows; ++i) {
    const Tensor whole = flat.slice0(i * b + first, i * b + first + n);
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
void to_rank0(std::vector<float>& v, int from, int slice_ranks, int rank) {
  const int src = from * slice_ranks;
  if (src == 0) return;
  if (rank == src) {
    auto n = static_cast<std::uint64_t>(v.size());
    TPX_MPI_CHECK(MPI_Send(&n, 1, MPI_UINT64_T, 0, 0, MPI_COMM_WORLD));
    TPX_MPI_CHECK(MPI_Send(v.data(), int(n), MPI_FLOAT, 0, 1, MPI_COMM_WORLD));
  } else if (rank == 0) {
    std::uint64_t n = 0;
    TPX_MPI_CHECK(MPI_Recv(&n, 1, MPI_UINT64_T, src, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    v.resize(n);
    TPX_MPI_CHECK(MPI_Recv(v.data(), int(n), MPI_FLOAT, src, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
  }
}

/// What one (micro-batch, virtual stage) pair holds between its actions.
struct Pass {
  Tensor x;                            ///< the stage's input
  std::vector<BlockActivations> acts;  ///< per layer of the stage
  Tensor y;                            ///< the stage's output (forward)
  Tensor dy;                           ///< the gradient of y (backward's input)
  Tensor dx;                           ///< the gradient of x (backward's output)
  std::vector<LayerParams> grads;      ///< zb-h1: the gradients W completes, per layer
  WeightGradWork work;                 ///< zb-h1: the dW GEMMs B set aside
};

/// A rank's sends (or receives) grouped by the action that makes (or reads) them: one list, and
/// where each action's part begins (a map from action to list would cost a node per action).
class ByAction {
 public:
  ByAction() = default;
  /// `xs` in any order; `actions` the length of the rank's action list.
  ByAction(std::vector<Transfer> xs, std::size_t actions)
      : xs_(std::move(xs)), first_(actions + 1) {
    std::ranges::stable_sort(xs_, {}, &Transfer::action);
    std::size_t k = 0;
    for (std::size_t i = 0; i <= actions; ++i) {
      first_[i] = k;
      while (k < xs_.size() && xs_[k].action == i) ++k;
    }
    TPX_CHECK(k == xs_.size(), "a transfer of an action past the schedule's end");
  }
  std::span<const Transfer> at(std::size_t i) const {
    return std::span(xs_).subspan(first_[i], first_[i + 1] - first_[i]);
  }

 private:
  std::vector<Transfer> xs_;
  std::vector<std::size_t> first_;
};

/// One step's actions on this rank, and what they leave behind.
class Executor {
 public:
  Executor(const BlockConfig& c, PipelineParallel& pp, Model& m, Trace& trace)
      : c_(c),
        pp_(pp),
        slice_(pp.slice()),
        m_(m),
        trace_(trace),
        shape_(pp.schedule().shape()),
        me_(pp.mesh().pp_index),
        actions_(pp.schedule().actions(me_)),
        split_(pp.schedule().split_backward()) {
    const std::vector<std::int64_t> held = pp.held_layers();
    for (std::size_t i = 0; i < held.size(); ++i) local_[held[i]] = i;
    std::vector<Transfer> sends, receives;
    for (const Transfer& x : pipeline::transfers(pp.schedule(), me_))
      (x.send ? sends : receives).push_back(x);
    sends_ = ByAction(std::move(sends), actions_.size());
    receives_ = ByAction(std::move(receives), actions_.size());
  }

  /// The micro-batches of the block's input (stage 0) and of the target (the last stage).
  std::vector<Tensor> inputs, targets;

  struct Result {
    double loss_sum = 0;         ///< this rank's part of Σ (y − T)² (last stage)
    double busy_ms = 0;          ///< the actions' own time
    int peak_live = 0;           ///< the most (micro-batch, stage) activations alive at once
    std::size_t peak_saved = 0;  ///< the most bytes of saved activations alive at once
    std::vector<Tensor> y, dx;   ///< per micro-batch: the last stage's output, stage 0's dx
  };

  Result run(const std::vector<LayerParams>& params, bool keep) {
    Result r;
    saved_ = 0;
    passes_.clear();
    buffers_.clear();
    local_messages_.clear();
    acc_.clear();
    done_.clear();
    // Each payload's sends run in order on its lane: the last one's end is the end of all.
    std::optional<Event> sent[2];
    int live = 0;
    if (keep) {
      r.y.resize(std::size_t(shape_.microbatches));
      r.dx.resize(std::size_t(shape_.microbatches));
    }
    for (std::size_t i = 0; i < actions_.size(); ++i) {
      post_receives(i);
      if (i + 1 < actions_.size()) post_receives(i + 1);  // one action ahead
      const Action& a = actions_[i];
      for (const Transfer& x : receives_.at(i)) buffers_.at(x.tag).second.synchronize();
      const auto t0 = Clock::now();
      {
        TraceScope phase(trace_, pipeline::to_string(a, shape_.stages_per_rank > 1), Lane::phase);
        if (a.phase == Phase::forward)
          forward(i, params, r, keep);
        else if (a.phase == Phase::backward)
          backward(i, params, r, keep);
        else
          weights(a);
      }
      r.busy_ms += ms_between(t0, Clock::now());
      if (a.phase == Phase::forward) ++live;
      if (a.phase == Phase::weight || (a.phase == Phase::backward && !split_)) --live;
      r.peak_live = std::max(r.peak_live, live);
      if (a.phase == Phase::forward) r.peak_saved = std::max(r.peak_saved, saved_);
      // What the action made for the next (forward) or previous (backward) virtual stage: sent,
      // or left here when this rank holds that stage too.
      if (a.phase != Phase::weight) {
        const bool fwd = a.phase == Phase::forward;
        const int to = fwd ? a.stage + 1 : a.stage - 1;
        if (to >= 0 && to < shape_.stages()) {
          const Pass& p = passes_.at({a.microbatch, a.stage});
          const Tensor& t = fwd ? p.y : p.dx;
          if (shape_.rank_of(to) == me_)
            local_messages_[{a.microbatch, to, fwd ? Payload::activation : Payload::gradient}] = t;
          for (const Transfer& x : sends_.at(i))
            sent[std::size_t(x.payload)] = pp_.send(x, t, name(x));
        }
      }
      // The pass keeps only what its later actions read: the send lane holds what it sends
      // until it is gone, and the stage input is the first layer's saved x.
      if (const auto it = passes_.find({a.microbatch, a.stage}); it != passes_.end())
        it->second.x = it->second.y = it->second.dx = Tensor();
      // A pass whose last use is over lets go of what it holds.
      if (a.phase == Phase::weight || (a.phase == Phase::backward && !split_))
        passes_.erase({a.microbatch, a.stage});
    }
    for (const std::optional<Event>& e : sent)
      if (e) e->synchronize();
    scratch_ = {};
    slice_.finish_grads();
    return r;
  }

 private:
  static std::string name(const Transfer& x) {
    return fmt::format("{} {} stage {}→{}", x.payload == Payload::activation ? "act" : "grad",
                       x.microbatch, x.from_stage, x.to_stage);
  }

  void post_receives(std::size_t i) {
    for (const Transfer& x : receives_.at(i))
      if (!buffers_.contains(x.tag)) {
        Tensor buf = Tensor::empty(message_shape, c_.activations(), c_.device);
        buffers_.emplace(x.tag, std::make_pair(buf, pp_.receive(x, buf, name(x))));
      }
  }

 public:
  /// [S/(C·T), B/(D·M), H]: every message between stages.
  Tensor::Shape message_shape;

 private:
  /// The input of action i (a forward's activation, a backward's output gradient): received,
  /// or left on this rank by the neighbouring virtual stage.
  Tensor incoming(std::size_t i, Payload payload) {
    const Action& a = actions_[i];
    for (const Transfer& x : receives_.at(i))
      if (x.payload == payload) {
        Tensor t = buffers_.at(x.tag).first;
        buffers_.erase(x.tag);
        return t;
      }
    const auto it = local_messages_.find({a.microbatch, a.stage, payload});
    TPX_CHECK(it != local_messages_.end(), "no {} for {}",
              payload == Payload::activation ? "activation" : "gradient", to_string(a, true));
    Tensor t = it->second;
    local_messages_.erase(it);
    return t;
  }

  void forward(std::size_t i, const std::vector<LayerParams>& params, Result& r, bool keep) {
    const Action& a = actions_[i];
    Pass& p = passes_[{a.microbatch, a.stage}];
    p.x = a.stage == 0 ? inputs[std::size_t(a.microbatch)] : incoming(i, Payload::activation);
    const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
    p.acts.resize(std::size_t(range.count));
    Tensor h = p.x;
    for (int k = 0; k < range.count; ++k) {
      const std::size_t l = local_.at(range.first + k);
      const int next = k + 1 < range.count ? int(l + 1) : -1;
      const LayerParams w = slice_.layer_params(params, l, next);
      h = block_forward(c_, w, h, slice_, p.acts[std::size_t(k)], trace_);
      saved_ += p.acts[std::size_t(k)].bytes();
      slice_.release_layer(l);
    }
    p.y = h;
    if (a.stage == shape_.stages() - 1) {
      // The loss of this micro-batch, as part of the mean over the whole batch: its gradient is
      // scaled by 1 / (S·B·H), which is 1/M of the micro-batch's own mean.
      TraceScope op(trace_, "mse loss");
      const Tensor& target = targets[std::size_t(a.microbatch)];
      r.loss_sum += ops::mse_loss_sum(h, target);
      p.dy = Tensor::empty(h.shape(), h.dtype(), h.device());
      const double count = double(c_.seq) * double(c_.batch) * double(c_.hidden);
      ops::mse_loss_backward(h, target, 1.0 / count, p.dy);
      if (keep) r.y[std::size_t(a.microbatch)] = h;
    }
  }

  void backward(std::size_t i, const std::vector<LayerParams>& params, Result& r, bool keep) {
    const Action& a = actions_[i];
    Pass& p = passes_.at({a.microbatch, a.stage});
    Tensor dy = a.stage == shape_.stages() - 1 ? p.dy : incoming(i, Payload::gradient);
    const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
    if (split_) {
      TPX_CHECK(slice_.defer_weight_grads(&p.work), "the stage cannot split its backward");
      p.grads.resize(std::size_t(range.count));
    }
    for (int k = range.count - 1; k >= 0; --k) {
      const std::size_t l = local_.at(range.first + k);
      const int next = k > 0 ? int(l - 1) : -1;
      const LayerParams w = slice_.layer_params(params, l, next);
      LayerParams g = fresh_grads(l);
      dy = block_backward(c_, w, p.acts[std::size_t(k)], dy, slice_, g, trace_);
      slice_.release_layer(l);
      saved_ -= p.acts[std::size_t(k)].bytes();
      p.acts[std::size_t(k)] = {};
      if (split_)
        p.grads[std::size_t(k)] = g;
      else
        accumulate(l, g);
    }
    if (split_) slice_.defer_weight_grads(nullptr);
    p.dx = dy;
    if (keep && a.stage == 0) r.dx[std::size_t(a.microbatch)] = dy;
  }

  void weights(const Action& a) {
    Pass& p = passes_.at({a.microbatch, a.stage});
    p.work.run();  // the dW GEMMs, writing p.grads
    const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
    for (int k = 0; k < range.count; ++k)
      accumulate(local_.at(range.first + k), p.grads[std::size_t(k)]);
  }

  /// Buffers for one micro-batch's gradients of layer l (the slice's full-layer shapes). Without
  /// the split they are added to the step's at once, so every layer and micro-batch reuses one
  /// set (in stream order: its adds are issued before the next backward's GEMMs overwrite it);
  /// zb-h1's live from B to W, a set per (micro-batch, layer) between them.
  LayerParams fresh_grads(std::size_t l) {
    LayerParams& acc = accumulator(l);
    const bool reuse = !split_ && scratch_[Param::norm1].defined() &&
                       std::ranges::all_of(kAllParams, [&](Param q) {
                         return scratch_[q].shape() == acc[q].shape();
                       });
    if (reuse) return scratch_;
    LayerParams g;
    for (Param q : kAllParams) g[q] = Tensor::empty(acc[q].shape(), DType::f32, c_.device);
    if (!split_) scratch_ = g;
    return g;
  }

  /// The gradients layer l accumulates over the step's micro-batches (the slice's buffers:
  /// the stored ones, or FSDP's unsharded ones), zero at the first.
  LayerParams& accumulator(std::size_t l) {
    auto it = acc_.find(l);
    if (it == acc_.end()) {
      it = acc_.emplace(l, slice_.layer_grads(l, m_.grads[l])).first;
      for (Param q : kAllParams) ops::fill(it->second[q], 0.0f);
    }
    return it->second;
  }

  /// Adds one micro-batch's gradients of layer l; after the M-th, the slice reduces them.
  void accumulate(std::size_t l, const LayerParams& g) {
    LayerParams& acc = accumulator(l);
    {
      TraceScope op(trace_, "grad accumulate");
      for (Param q : kAllParams) ops::accumulate(g[q], acc[q]);
    }
    if (++done_[l] == shape_.microbatches) {
      slice_.grads_done(l, acc, m_.grads[l]);
      acc_.erase(l);
    }
  }

  const BlockConfig& c_;
  PipelineParallel& pp_;
  Parallelism& slice_;
  Model& m_;
  Trace& trace_;
  PipelineShape shape_;
  int me_;
  const std::vector<Action>& actions_;
  bool split_;
  std::map<std::int64_t, std::size_t> local_;  // global layer → index in m_
  ByAction sends_, receives_;
  std::map<std::pair<int, int>, Pass> passes_;                      // (micro-batch, stage)
  std::map<int, std::pair<Tensor, Event>> buffers_;                 // posted receives, by tag
  std::map<std::tuple<int, int, Payload>, Tensor> local_messages_;  // (micro-batch, to stage)
  std::map<std::size_t, LayerParams> acc_;                          // by local layer
  std::map<std::size_t, int> done_;                                 // micro-batches accumulated
  /// What every live pass keeps for its backward now: added by each layer's forward, taken
  /// away by its backward, so that the peak costs O(1) per action.
  std::size_t saved_ = 0;
  LayerParams scratch_;  // one micro-batch's gradients of a layer, reused (no split)
};

}  // namespace

TrainResult train_pipeline(const BlockConfig& c, Parallelism& par, bool snapshot, Trace& trace,
                           const std::function<void(const StepRow&)>& on_row) {
  auto& pp = static_cast<PipelineParallel&>(par);
  Parallelism& slice = pp.slice();
  const Mesh& mesh = pp.mesh();
  const Schedule& schedule = pp.schedule();
  const PipelineShape shape = schedule.shape();
  const int me = mesh.pp_index, last = shape.rank_of(shape.stages() - 1);
  const int slice_ranks = mesh.dp * mesh.cp * mesh.tp;
  int rank = 0;
  TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));

  const Sharding sh = slice.sharding();
  const std::vector<std::int64_t> held = pp.held_layers();
  Model m = make_model(c, sh, held);
  slice.shard_model(m);  // this rank's tokens and batch part; its layers' shards
  Executor ex(c, pp, m, trace);
  const std::int64_t n = m.input.dim(1) / shape.microbatches;
  ex.message_shape = {m.input.dim(0), n, m.input.dim(2)};
  // Stage 0 keeps the input's micro-batches (in the activations' dtype), the last stage the
  // target's; the whole tensors stay only where the snapshot reads them, and a rank lets go of
  // what it does not use before it splits what it does.
  if (me != 0) m.input = Tensor();
  if (me != last) m.target = Tensor();
  if (me == 0) {
    const Tensor input = as_dtype(m.input, c.activations());
    if (!snapshot) m.input = Tensor();
    for (int j = 0; j < shape.microbatches; ++j) ex.inputs.push_back(microbatch(input, j, n));
  }
  if (me == last) {
    for (int j = 0; j < shape.microbatches; ++j) ex.targets.push_back(microbatch(m.target, j, n));
    if (!snapshot) m.target = Tensor();
  }

  std::vector<LayerParams> params;
  Moments moments = make_moments(c, m);
  TrainResult result;
  par.synchronize();
  ops::synchronize(c.device);
  par.take_comm_stats();

  double idle_sum = 0, busy_sum = 0, wall_sum = 0;
  int measured = 0, peak_live = 0;
  for (int step = 0; step < c.steps; ++step) {
    const auto t0 = Clock::now();
    StepRow row;
    row.step = step;
    {
      std::optional<TraceScope> op;
      if (c.bf16_weight_copies()) op.emplace(trace, "bf16 weight copies");
      make_compute_copies(c, m, params);
    }
    // The pipeline's part of the step, between two barriers of the pipeline group: its wall
    // time less the actions' own time is this rank's idle time (the bubble, and waits).
    pp.pipeline_barrier();
    const auto p0 = Clock::now();
    const bool keep = snapshot && step == 0;
    Executor::Result r = ex.run(params, keep);
    par.synchronize();
    pp.pipeline_barrier();
    const double wall = ms_between(p0, Clock::now());
    peak_live = std::max(peak_live, r.peak_live);
    if (step == 0) result.saved_activation_bytes = r.peak_saved;
    if (step > 0 || c.steps == 1) {
      idle_sum += wall - r.busy_ms;
      busy_sum += r.busy_ms;
      wall_sum += wall;
      ++measured;
    }
    row.loss =
        0.5 * par.sum_over_ranks(r.loss_sum) / (double(c.seq) * double(c.batch) * double(c.hidden));
    row.grad_norm = grad_norm(par, m, sh, trace);
    if (result.diverged = divergence(row, c.lr); !result.diverged.empty()) {
      par.synchronize();
      ops::synchronize(c.device);
      break;  // no update from a non-finite gradient; the rows so far stay
    }
    par.synchronize();
    ops::synchronize(c.device);
    double ms = ms_between(t0, Clock::now());
    add(row.comm, par.take_comm_stats());
    row.exposed_comm_ms = trace.exposed_comm_ms(t0, Clock::now());

    if (keep) {
      // The whole model on rank 0: each pipeline stage's slice gathers what it holds to its
      // first rank, which sends it on (not counted: reporting).
      Snapshot& s = result.first;
      s.loss = row.loss;
      auto gathered = [&](int from, auto&& make) {
        std::vector<float> v;
        if (me == from) v = host_copy(make());
        to_rank0(v, from, slice_ranks, rank);
        return v;
      };
      s.input = gathered(0, [&] { return slice.gather_activation(m.input); });
      s.target = gathered(last, [&] { return slice.gather_activation(m.target); });
      s.output = gathered(last, [&] { return slice.gather_activation(join_microbatches(r.y)); });
      s.input_grad = gathered(0, [&] { return slice.gather_activation(join_microbatches(r.dx)); });
      s.params.resize(std::size_t(c.layers));
      s.grads.resize(std::size_t(c.layers));
      std::map<std::int64_t, std::size_t> local;
      for (std::size_t i = 0; i < held.size(); ++i) local[held[i]] = i;
      for (std::size_t s_ = 0; s_ < pp.layers().size(); ++s_) {
        const LayerRange& range = pp.layers()[s_];
        const int owner = shape.rank_of(int(s_));
        for (int l = range.first; l < range.first + range.count; ++l)
          for (Param p : kAllParams) {
            const auto i = static_cast<std::size_t>(p);
            s.params[std::size_t(l)][i] =
                gathered(owner, [&] { return slice.gather_param(p, m.params[local.at(l)][p]); });
            s.grads[std::size_t(l)][i] =
                gathered(owner, [&] { return slice.gather_param(p, m.grads[local.at(l)][p]); });
          }
      }
      par.take_comm_stats();
      m.input = Tensor();
      m.target = Tensor();
    }

    finish_step(c, par, m, moments, trace, row, ms);
    result.rows.push_back(row);
    if (on_row) on_row(row);
  }

  // --json: the schedule, and per pipeline stage its live count and measured idle time (the
  // pipeline of rank 0: every pipeline runs the same schedule).
  const double k = measured > 0 ? double(measured) : 1.0;
  const std::vector<double> idle = pp.gather_over_pipeline(idle_sum / k);
  const std::vector<double> busy = pp.gather_over_pipeline(busy_sum / k);
  const std::vector<double> wall = pp.gather_over_pipeline(wall_sum / k);
  const std::vector<double> live = pp.gather_over_pipeline(double(peak_live));
  double idle_all = 0, wall_all = 0;
  for (std::size_t p = 0; p < idle.size(); ++p) {
    idle_all += idle[p];
    wall_all += wall[p];
  }
  std::vector<int> live_counts(live.begin(), live.end());
  result.extra["pipeline"] = {
      {"schedule", schedule.name()},
      {"pp", shape.ranks},
      {"microbatches", shape.microbatches},
      {"stages_per_rank", shape.stages_per_rank},
      {"microbatch_rows", n},
      {"split_backward", schedule.split_backward()},
      {"live_peak", live_counts},
      {"schedule_live_peak", pipeline::peak_live(schedule)},
      {"idle_ms", idle},
      {"busy_ms", busy},
      {"wall_ms", wall},
      {"bubble_measured", wall_all > 0 ? idle_all / wall_all : 0.0},
      {"bubble_formula", schedule.formula_bubble(pipeline::Costs{})},
      {"measured_steps", measured},
  };
  return result;
}

}  // namespace tpx::pp
