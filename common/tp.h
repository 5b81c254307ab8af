// What every tensor-parallel stage needs besides its own idea: the check that the ranks can split
// the model, and the rank group it communicates over, with traced collectives, per-step
// accounting and the gathers that --check / --dump read.
//
// Accounting rule: the step's comm bytes are the traffic of training (forward, backward and the
// gradient reductions). Reporting-only traffic (the loss and grad-norm scalars, the first-step
// snapshot gathers) goes through the same communicator but is left out of the step's numbers, so
// the step table equals the formulas in the stage chapters.
//
// defines: tpx::check_tp_split(), tpx::tp_plan(), tpx::TpGroup
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "comm/communicator.h"
#include "config.h"
#include "model.h"
#include "parallel.h"
#include "ring.h"
#include "stage.h"
#include "stream.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {

/// Throws ConfigError (one line, identical on every rank) unless `world` divides what a
/// tensor-parallel stage splits: NKV (whole KV heads per rank, each with its query group, hence
/// also NH and H), F, and with sequence parallelism S.
void check_tp_split(const BlockConfig& c, int world, bool sequence);

/// A stage's bytes per rank and step at N ranks (its traffic.h: megatron::traffic, ...).
using StageTraffic = Traffic (*)(const BlockConfig& c, int n, int act_bytes);

/// --dry-run's plan of a tensor-parallel stage over all of ctx's ranks: the split check of its
/// factory, its sharding (weights; with `sequence`, from stage 03 on, the sequence too) and a
/// step's bytes, the stage's `traffic` formula.
StagePlan tp_plan(const RunContext& ctx, bool sequence, StageTraffic traffic);

/// The tensor-parallel group: every rank of the job, in rank order.
class TpGroup {
 public:
  /// Makes the communicator for ctx.options (collective: every rank must call it).
  explicit TpGroup(const RunContext& ctx);

  int rank() const { return rank_; }
  int world() const { return world_; }
  std::string name() const { return comm_->name(); }

  // Collectives of the training step, each recorded on the trace's comm lane as `what`.
  /// t = Σ_ranks t, in place.
  void all_reduce(const Tensor& t, std::string_view what);
  /// t = max over ranks of t, element-wise, in place.
  void all_reduce_max(const Tensor& t, std::string_view what);
  /// [N·n, ...] = the ranks' [n, ...] concatenated along dim 0 in rank order.
  Tensor all_gather(const Tensor& local, std::string_view what);
  /// [n, ...] = this rank's dim-0 slice of Σ_ranks full [N·n, ...].
  Tensor reduce_scatter(const Tensor& full, std::string_view what);

  /// Σ_ranks local in double, identical on every rank, for reporting (loss, grad norm): not
  /// counted in the step's traffic.
  double sum_for_report(double local);
  /// The full parameter (or gradient) from this rank's shard, split as param_split(p) says
  /// (collective; not counted). Column shards [in, out/N] are interleaved into [in, out].
  Tensor gather_param(Param p, const Tensor& local);
  /// The same for a tensor split as `split` says (the language model's: the embedding's rows,
  /// the output layer's columns).
  Tensor gather_split(Split split, const Tensor& local);
  /// The full [S, B, H] tensor from this rank's sequence shard (collective; not counted).
  Tensor gather_sequence(const Tensor& local);

  /// The group's communicator (stage 04's ring of send/recv runs on it).
  Communicator& communicator() { return *comm_; }
  /// Takes the transport of the overlap primitives (common/ring.h) that the stage made for this
  /// group (stage 04: a ring of send/recv; stage 05: its copy-engine pulls) and returns it. The
  /// group owns it (destroyed before the communicator), counts the traffic it moves itself in
  /// take_stats() and waits for it in synchronize().
  ChunkTransport& adopt_transport(std::unique_ptr<ChunkTransport> transport);
  Trace& trace() const { return trace_; }

  /// The step's traffic since the last call; resets the counters.
  CommStats take_stats();
  /// Waits for everything issued on the group's stream.
  void synchronize() {
    stream_.synchronize();
    if (transport_) transport_->synchronize();
  }

 private:
  /// Moves the communicator's counters into the step's (call before reporting-only traffic).
  void bank_step_stats();
  /// Drops the communicator's counters (call after reporting-only traffic).
  void drop_report_stats() { comm_->take_stats(); }

  int rank_, world_;
  Device device_;
  Trace& trace_;
  Stream stream_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<ChunkTransport> transport_;  // after comm_: destroyed (its streams drained) first
  CommStats step_;
};

}  // namespace tpx
