// Stage 09, pipeline parallelism (PP): the ranks form a P × D × C × T mesh (common/mesh.h, PP
// outermost) and the layers are split over the P pipeline stages. Each stage's ranks (a "slice"
// of D × C × T) run stage 08 on their layers (linked, not copied: FSDP over DP×CP, CP attention,
// async TP), and the activations flow from stage to stage by point-to-point messages.
//
//   layers        contiguous: the first L mod (P·V) virtual stages take one more layer; rank p
//                 holds the virtual stages p, p+P, … (V = --stages-per-rank, interleaved-1f1b)
//   micro-batches the local batch B / D cut into M parts of B / (D·M) sequences (M at most
//                 kMaxMicrobatches); each boundary sends the SP-sharded activation
//                 [S/(C·T), B/(D·M), H] from a TP rank to the same TP rank of the next stage,
//                 and its gradient back
//   schedule      schedule.h (tpx_schedules): one list of (micro-batch, virtual stage, F|B|W)
//                 actions per rank, which this executor runs in order; receives are posted one
//                 action ahead and sends queued behind the action that made them, each on a lane
//                 thread of its own, so a stage computes while its neighbour's message is in
//                 flight
//   gradients     each micro-batch's loss is part of the global mean (the 1/(S·B·H) of the loss
//                 gradient is the 1/M); each layer's gradients accumulate over the M
//                 micro-batches and go to stage 07's reduction over DP×CP after the last one;
//                 the optimizer steps once per step
//   zb-h1         the backward split: B runs the block backward with the linear layers' dW
//                 GEMMs set aside (Parallelism::defer_weight_grads), W runs them later
//
// defines: tpx::pp::PipelineParallel, tpx::pp::make_pipeline(), tpx::pp::plan_pipeline(),
//          tpx::pp::describe_pipeline(),
//          tpx::pp::train_pipeline(), tpx::pp::SliceFactory,
//          tpx::pp::make_pipeline_with(), tpx::pp::PipelineSize, tpx::pp::pipeline_size(),
//          tpx::pp::plan_pipeline_with() (SliceDimensions, the plan's arithmetic: plan.h)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "09_pipeline_parallel/plan.h"
#include "09_pipeline_parallel/schedule.h"
#include "common/comm/communicator.h"
#include "common/memory_terms.h"
#include "common/mesh.h"
#include "common/parallel.h"
#include "common/stage.h"
#include "common/stream.h"
#include "common/trainer.h"

namespace tpx::pp {

/// The most micro-batches a step takes (--microbatches): a limit of the stage, not of memory.
/// Each micro-batch costs every rank its books and a step its messages, and the bubble
/// (P−1)/(M+P−1) is below 0.1 % at this M for P ≤ 64.
inline constexpr int kMaxMicrobatches = 65536;

class PipelineParallel final : public Parallelism {
 public:
  /// `mesh` has been made (collectively) for ctx's job; `slice` is stage 08 (or 07) on this
  /// rank's pipeline stage; `layers` the layer range of each virtual stage.
  PipelineParallel(const RunContext& ctx, Mesh mesh, std::unique_ptr<Parallelism> slice,
                   std::unique_ptr<pipeline::Schedule> schedule,
                   std::vector<pipeline::LayerRange> layers);
  ~PipelineParallel() override;

  Sharding sharding() const override;
  std::string comm_name() const override;
  /// The slice's groups (on the same mesh, so the pipeline's among them; stage 10's EP group too).
  std::vector<MeshGroup> mesh_groups() const override { return slice_->mesh_groups(); }

  // The block's calls go to the slice (train_pipeline calls slice() directly); these forward so
  // that the object is a whole Parallelism.
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override {
    return slice_->column_forward(h, w, role);
  }
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override {
    return slice_->column_backward(saved, w, dy, dw, role);
  }
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override {
    return slice_->row_forward(a, w, role);
  }
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override {
    return slice_->row_backward(a, w, dy, dw, role);
  }

  /// The slice's (stage 10's experts on this rank's layers).
  ExtraParameters* extra_parameters() override { return slice_->extra_parameters(); }
  /// The slice's, with the micro-batches as the experts' routing groups (MoeConfig::microbatches:
  /// each micro-batch of the D replicas is routed on its own).
  BlockConfig reference_config(const BlockConfig& c) const override;

  /// Σ over every rank of the job: the slice's sum, then the pipeline's (each stage holds other
  /// layers; only the last computes the loss).
  double sum_over_ranks(double local) override;
  CommStats take_comm_stats() override;
  void synchronize() override;

  Parallelism& slice() { return *slice_; }
  const Mesh& mesh() const { return mesh_; }
  const pipeline::Schedule& schedule() const { return *schedule_; }
  /// The layers of each virtual stage.
  const std::vector<pipeline::LayerRange>& layers() const { return layers_; }
  /// This rank's layers (indices into the whole model), its virtual stages' in order.
  std::vector<std::int64_t> held_layers() const;

  /// Queues `t` to go to this rank's pipeline neighbour `x.peer` (x: a send of transfers()) on
  /// the lane of its payload, booked in the flight recorder now; returns the event of its end.
  Event send(const pipeline::Transfer& x, const Tensor& t, const std::string& what);
  /// Posts the receive of `x` into `buf` on the lane of its payload; returns its arrival.
  Event receive(const pipeline::Transfer& x, const Tensor& buf, const std::string& what);

  /// The P values of `mine` from every stage of this rank's pipeline, in pp order (reporting).
  std::vector<double> gather_over_pipeline(double mine) const;
  /// Waits for every rank of this rank's pipeline (reporting: the measured step's edges).
  void pipeline_barrier() const;

 private:
  struct Channel;  // one payload's communicator and its send and receive lanes
  Channel& channel(pipeline::Payload p);

  Mesh mesh_;
  std::unique_ptr<Parallelism> slice_;
  std::unique_ptr<pipeline::Schedule> schedule_;
  std::vector<pipeline::LayerRange> layers_;
  BlockConfig config_;  // the run's block (--recompute decides what each layer keeps)
  Trace& trace_;
  Device device_;
  std::unique_ptr<Channel> activations_, gradients_;  // null when P = 1
};

/// The stage's factory: lays out the mesh (--pp default 2 when the ranks are even, --dp and
/// --cp default 1), splits the layers, sizes the micro-batches and makes the schedule
/// (ConfigError, one line on every rank, for what does not split), then stage 08 on the slice.
std::unique_ptr<Parallelism> make_pipeline(const RunContext& ctx);

/// What runs on each pipeline stage's ranks: made (collectively) on the P × D × C × T mesh for
/// the model's layers `held` (this rank's, as Model holds them).
using SliceFactory = std::function<std::unique_ptr<Parallelism>(
    const RunContext& ctx, const Mesh& mesh, const std::vector<std::int64_t>& held)>;

/// make_pipeline() with `slice` on each stage's ranks (stage 10: its experts beside stage 07).
/// The mesh's newest dimension, whose flag defaults to 2 where the ranks allow, is the stage's
/// (cli.h's newest_mesh_flag()): --pp in stage 09, --dp in stage 10.
std::unique_ptr<Parallelism> make_pipeline_with(const RunContext& ctx, const SliceFactory& slice);

/// The mesh and micro-batches of ctx's flags as make_pipeline() lays them out (the flags or their
/// defaults; ConfigError as make_pipeline's for what does not split).
struct PipelineSize {
  int pp = 1, dp = 1, cp = 1, microbatches = 1;
};
PipelineSize pipeline_size(const RunContext& ctx);

/// --dry-run's plan of this rank: the checks of make_pipeline, its sharding (its layers, the
/// schedule's peak of live activations) and a step's bytes per group (the formulas of
/// 08_context_parallel/traffic.h on the rank's layers, once per micro-batch, and the pipeline's
/// messages).
StagePlan plan_pipeline(const RunContext& ctx);

/// plan_pipeline() with `slice` in the sharding (the bytes stay stage 09's: a stage adds its own).
StagePlan plan_pipeline_with(const RunContext& ctx, const SliceDimensions& slice);

/// --print-schedule: the schedule of ctx's config as text (format_schedule(), the layers of each
/// stage, the simulated timeline with unit costs and its bubble against the formula); nothing
/// when the flag is not given. Makes no mesh and no communicator; the same checks as
/// make_pipeline.
std::optional<std::string> describe_pipeline(const RunContext& ctx);

/// The training loop of a pipeline: train() with the step's forward and backward replaced by
/// the schedule's actions over micro-batches. `par` is make_pipeline()'s.
TrainResult train_pipeline(const BlockConfig& c, Parallelism& par, bool snapshot, Trace& trace,
                           const std::function<void(const StepRow&)>& on_row);

}  // namespace tpx::pp
