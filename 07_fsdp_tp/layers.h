// Stage 07, FSDP × TP: the job's ranks form a D × T mesh (common/mesh.h, TP innermost). Inside
// each TP group of T ranks the block runs exactly as stage 05 (copy-engine async TP with sequence
// parallelism: the linear layers are stage 05's, linked, not copied). Across the D groups the
// data is split and the parameters are sharded, as FSDP2 / ZeRO-3 / Transformer Engine's GTP do:
//
//   data        each DP replica trains B / D of the global batch; the loss is the global mean
//   parameters  every TP shard of every parameter, norm gains included, is split along dim 0
//               over the DP group, padded to a multiple of D (FSDP2's rule): a rank keeps 1/(T·D)
//               of the master weights, the gradients and the optimizer state
//   forward     before layer l, one all-gather of its parameters (one flat buffer; the bf16
//               compute copies under --dtype bf16) on a DP-comm stream, issued for layer l+1
//               while layer l computes; the unsharded copy is freed after the layer (reshard)
//   backward    the same gather again, prefetching layer l−1; when layer l's weight gradients
//               are complete, one fp32 reduce-scatter over the DP group on a stream of its own,
//               while layer l−1's backward runs
//   update      the optimizer steps the local shards only
//
// defines: tpx::fsdp::FlatLayout, tpx::fsdp::flat_layout(), tpx::fsdp::FsdpTp,
//          tpx::fsdp::make_fsdp_tp(), tpx::fsdp::plan_fsdp_tp()
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/mesh.h"
#include "common/parallel.h"
#include "common/stage.h"
#include "common/stream.h"

namespace tpx::fsdp {

/// Where each of a layer's nine parameters sits in one rank's flat shard. A TP-local parameter
/// [rows, ...] (cols = the product of the rest; 1 for a norm gain) is split along dim 0 into D
/// shards of `shard_rows` = ⌈rows / D⌉ rows, the last ones padded with zeros.
struct FlatLayout {
  struct Entry {
    Tensor::Shape shape;  ///< the TP-local (unsharded) shape
    std::int64_t rows = 0, cols = 1;
    std::int64_t shard_rows = 0;  ///< ⌈rows / D⌉
    std::int64_t offset = 0;      ///< elements into the flat shard
    std::int64_t shard_numel() const { return shard_rows * cols; }
    Tensor::Shape shard_shape() const;
  };
  std::array<Entry, kNumParams> entries{};
  std::int64_t numel = 0;  ///< of one rank's flat shard (the sum of the shards)
  const Entry& operator[](Param p) const { return entries[static_cast<std::size_t>(p)]; }
};

/// The layout of a layer whose TP-local parameters have the shapes of `tp_local`, over D ranks.
FlatLayout flat_layout(const LayerParams& tp_local, int d);

class FsdpTp final : public Parallelism {
 public:
  /// `mesh` has been made (collectively) for ctx's job; ctx.options.config is the global config.
  FsdpTp(const RunContext& ctx, Mesh mesh);
  ~FsdpTp() override;

  Sharding sharding() const override;
  std::string comm_name() const override;
  std::vector<MeshGroup> mesh_groups() const override { return mesh_.groups(); }

  // The linear layers: stage 05's, over the TP group.
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override {
    return tp_->column_forward(h, w, role);
  }
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override {
    return tp_->column_backward(saved, w, dy, dw, role);
  }
  Tensor column_saved(const Tensor& h, const Tensor& scale) override {
    return tp_->column_saved(h, scale);
  }
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override {
    return tp_->row_forward(a, w, role);
  }
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override {
    return tp_->row_backward(a, w, dy, dw, role);
  }
  bool defer_weight_grads(WeightGradWork* work) override { return tp_->defer_weight_grads(work); }
  void reduce_replicated_grad(const Tensor& grad) override { tp_->reduce_replicated_grad(grad); }

  // The language model's ends: cut over the vocabulary within the TP group (stage 05's), and
  // replicated over the DP×CP group, whose ranks all-reduce their gradients (as DDP would).
  TokenCut token_cut(const BlockConfig& c) const override;
  Tensor vocab_reduce(const Tensor& partial) override { return tp_->vocab_reduce(partial); }
  Tensor vocab_reduce_backward(const Tensor& dx) override { return tp_->vocab_reduce_backward(dx); }
  void vocab_all_reduce(const Tensor& t, VocabReduce op) override { tp_->vocab_all_reduce(t, op); }
  void reduce_lm_grads(const LmParams& grads) override;
  bool counts_lm_replica() const override { return mesh_.dp_cp_index() == 0; }
  Tensor gather_vocab(Split split, const Tensor& local) override {
    return tp_->gather_vocab(split, local);
  }

  // Across the whole mesh.
  double sum_over_ranks(double local) override;
  Tensor gather_activation(const Tensor& local) override;
  Tensor gather_param(Param p, const Tensor& local) override;
  CommStats take_comm_stats() override;
  void synchronize() override;

  // The FSDP hooks (common/parallel.h).
  void shard_model(Model& m) override;
  LayerParams layer_params(const std::vector<LayerParams>& stored, std::size_t l,
                           int next) override;
  void release_layer(std::size_t l) override;
  LayerParams layer_grads(std::size_t l, const LayerParams& stored) override;
  void grads_done(std::size_t l, const LayerParams& full, const LayerParams& stored) override;
  void finish_grads() override;

  const Mesh& mesh() const { return mesh_; }

 private:
  /// Issues layer l's weight all-gather on the DP-comm lane (once per forward or backward use).
  void issue_gather(const std::vector<LayerParams>& stored, std::size_t l);
  /// dst (host, [n·G]) ← every rank's src (host, [n]) of `comm`'s group (G ranks: the DP group,
  /// or the DP×CP group the parameters are sharded over), in group order: a report gather
  /// (Communicator::all_gather_report), watched by the flight recorder and not counted in the
  /// step's traffic.
  void dp_gather_for_report(Communicator& comm, const Tensor& src, const Tensor& dst) const;
  /// The communicator over the DP group alone (dp_comm_ spans the DP×CP group).
  Communicator& dp_comm_for_report();

  struct Gather {
    Tensor full;  ///< every rank's part, [D · bytes] (see ByteLayout in layers.cc)
    Event done;   ///< the gather has landed
    std::array<std::int64_t, kNumParams> offset{};  ///< each parameter's byte offset in a part
    std::int64_t bytes = 0;                         ///< one rank's part
  };
  struct Reduction {
    Tensor flat;  ///< [D, numel] fp32 gradients being reduce-scattered
    Event done;
  };

  StageOptions tp_options_;  // the options with the TP group's communicator
  Mesh mesh_;
  RunContext tp_ctx_;
  std::unique_ptr<Parallelism> tp_;  // stage 05 over the TP group
  Trace& trace_;
  Device device_;
  std::unique_ptr<Communicator> dp_comm_;
  std::unique_ptr<Communicator> dp_report_comm_;  // over the DP group, when C > 1
  Stream gather_lane_, reduce_lane_;              // the DP-comm lane's two streams
  std::vector<FlatLayout> layout_;                // per layer
  std::vector<Tensor> grad_shards_;               // per layer: the flat fp32 gradient shard [numel]
  std::map<std::size_t, Gather> gathers_;
  std::vector<Reduction> reductions_;  // in flight until finish_grads()
};

/// The stage's factory: lays out the mesh (--dp, default_dp()), checks that D divides B and T
/// divides what tensor parallelism splits (ConfigError, one line on every rank), then builds.
std::unique_ptr<Parallelism> make_fsdp_tp(const RunContext& ctx);

/// --dry-run's plan: the same mesh and checks as make_fsdp_tp, stage 05's bytes on B / D over
/// the TP group plus the FSDP gathers and reduce-scatters over DP (fsdp_traffic()).
StagePlan plan_fsdp_tp(const RunContext& ctx);

}  // namespace tpx::fsdp
