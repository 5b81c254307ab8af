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
//   lm ends     the language model's embedding and its head (the final gain with the output
//               layer) are two more such units: each TP rank's vocabulary part split along dim 0
//               over the DP group, gathered before the lookup (fp32 rows) and before the head
//               (the output layer's bf16 compute copy under --dtype bf16), their gradients
//               reduce-scattered as soon as each end's backward is done
//
// defines: tpx::fsdp::FlatLayout, tpx::fsdp::flat_layout(), tpx::fsdp::FsdpTp, tpx::fsdp::make_mesh(),
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
#include <utility>
#include <vector>

#include "06_fp8/flags.h"
#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/mesh.h"
#include "common/parallel.h"
#include "common/stage.h"
#include "common/stream.h"

namespace tpx::fsdp {

/// Where each tensor of an FSDP unit (a layer's nine parameters, or one end of the language
/// model) sits in one rank's flat shard. A TP-local tensor [rows, ...] (cols = the product of
/// the rest; 1 for a norm gain) is split along dim 0 into D shards of `shard_rows` = ⌈rows / D⌉
/// rows, the last ones padded with zeros.
struct FlatLayout {
  struct Entry {
    Tensor::Shape shape;  ///< the TP-local (unsharded) shape
    std::int64_t rows = 0, cols = 1;
    std::int64_t shard_rows = 0;  ///< ⌈rows / D⌉
    std::int64_t offset = 0;      ///< elements into the flat shard
    std::int64_t shard_numel() const { return shard_rows * cols; }
    Tensor::Shape shard_shape() const;
  };
  std::vector<Entry> entries;  ///< in the unit's order (a layer's: Param's)
  std::int64_t numel = 0;      ///< of one rank's flat shard (the sum of the shards)
  const Entry& operator[](std::size_t i) const { return entries[i]; }
  const Entry& operator[](Param p) const { return entries[static_cast<std::size_t>(p)]; }
};

/// The layout of a unit whose TP-local tensors have the shapes of `tp_local`, over D ranks.
FlatLayout flat_layout(std::span<const Tensor> tp_local, int d);

class FsdpTp : public Parallelism {
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
  /// Stage 06's FP8 operands of layer 0 under --dtype fp8 (this TP group's: replica 0's are
  /// what rank 0 writes); nothing otherwise.
  std::vector<std::pair<std::string, Tensor>> dump_extra() override { return tp_->dump_extra(); }

  // The language model's ends: cut over the vocabulary within the TP group (stage 05's), and
  // sharded over the DP×CP group as every layer is (an FSDP unit each).
  TokenCut token_cut(const BlockConfig& c) const override;
  Tensor vocab_reduce(const Tensor& partial) override { return tp_->vocab_reduce(partial); }
  Tensor vocab_reduce_backward(const Tensor& dx) override { return tp_->vocab_reduce_backward(dx); }
  void vocab_all_reduce(const Tensor& t, VocabReduce op) override { tp_->vocab_all_reduce(t, op); }
  LmParams lm_params(const LmParams& stored) override;
  LmParams lm_grads(const LmParams& stored) override;
  void reduce_lm_grads(const LmParams& full, const LmParams& stored) override;
  Tensor gather_vocab(Split split, const Tensor& local) override;

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
  struct Gather {
    Tensor full;  ///< every rank's part, [D · bytes] (see ByteLayout in layers.cc)
    Event done;   ///< the gather has landed
    std::vector<std::int64_t> offset;  ///< each tensor's byte offset in a part
    std::int64_t bytes = 0;            ///< one rank's part
    /// Each tensor's dtype as gathered, and its FP8 scale (--fp8-weight-gather: the weight
    /// matrices' E4M3 codes; undefined for the tensors gathered as they are stored).
    std::vector<DType> dtypes;
    std::vector<Tensor> scales;
  };
  struct Reduction {
    Tensor flat;  ///< [D, numel] fp32 gradients being reduce-scattered
    Event done;
  };
  /// One of the language model's ends as an FSDP unit: its tensors (indices into
  /// LmParams::all()), their layout, and the flat fp32 gradient shard the model's views are of.
  struct LmUnit {
    std::string name;  ///< "embedding", "head"
    std::vector<std::size_t> members;
    FlatLayout layout;
    Tensor grad_shard;
  };

  /// Shards `tensors` (TP-local, a unit laid out as `f`) in place: each becomes this rank's
  /// dim-0 shard, a view into one flat fp32 tensor, and `grads` likewise into a zero one, which
  /// is returned (what the unit's reduce-scatter writes).
  Tensor shard_unit(const FlatLayout& f, std::span<Tensor> tensors, std::span<Tensor> grads) const;
  /// Issues the all-gather of a unit's shards `stored` (compute copies, laid out as `f`) on the
  /// DP-comm lane, named `what`.
  Gather issue_gather(const FlatLayout& f, std::span<const Tensor> stored, const std::string& what);
  /// Issues layer l's weight all-gather (once per forward or backward use); under
  /// --fp8-weight-gather its weight matrices' shards cast to E4M3 first (fp8_shards).
  void issue_gather(const std::vector<LayerParams>& stored, std::size_t l);
  /// --fp8-weight-gather: layer l's shards with each weight matrix cast to E4M3 under one scale
  /// per matrix, from its amax agreed over every rank that holds a part of it (one MAX
  /// all-reduce of the seven amaxes over the mesh); the norm gains as they are.
  std::vector<Tensor> fp8_shards(const LayerParams& stored, std::size_t l);
  /// The unit's TP-local tensors from gather `g` once it has landed (in `stored`'s dtypes).
  std::vector<Tensor> copy_out(const Gather& g, const FlatLayout& f,
                               std::span<const Tensor> stored) const;
  /// Packs a unit's complete gradients `full` (laid out as `f`) and issues their fp32
  /// reduce-scatter into `shard` on its own stream, named `what`; finish_grads() waits for it.
  void issue_reduction(const FlatLayout& f, std::span<const Tensor> full, const Tensor& shard,
                       const std::string& what);
  /// The language model's unit that holds tensor i of LmParams::all(), and i's place in it.
  std::pair<const LmUnit*, std::size_t> lm_unit_of(std::size_t i) const;
  /// dst (host, [n·G]) ← every rank's src (host, [n]) of `comm`'s group (G ranks: the DP group,
  /// or the DP×CP group the parameters are sharded over), in group order: a report gather
  /// (Communicator::all_gather_report), watched by the flight recorder and not counted in the
  /// step's traffic.
  void dp_gather_for_report(Communicator& comm, const Tensor& src, const Tensor& dst) const;
  /// On every rank: the TP-local tensor of `rows` rows (padding dropped) from this rank's DP×CP
  /// shard `local` and the others' (a report gather, as dp_gather_for_report()).
  Tensor unshard_for_report(const Tensor& local, std::int64_t rows) const;
  /// The communicator over the DP group alone (dp_comm_ spans the DP×CP group).
  Communicator& dp_comm_for_report();

  StageOptions tp_options_;  // the options with the TP group's communicator
  Mesh mesh_;
  RunContext tp_ctx_;
  std::unique_ptr<Parallelism> tp_;  // stage 05 over the TP group
  Trace& trace_;
  Device device_;
  std::unique_ptr<Communicator> dp_comm_;
  std::unique_ptr<Communicator> dp_report_comm_;  // over the DP group, when C > 1
  bool fp8_gather_ = false;                       // --fp8-weight-gather
  async_fp8::Fp8RecipeFlags keep_;                // --fp8-keep-last: which layers skip it
  std::unique_ptr<Communicator> amax_comm_;       // over the mesh, under --fp8-weight-gather
  Stream gather_lane_, reduce_lane_;              // the DP-comm lane's two streams
  std::vector<FlatLayout> layout_;                // per layer
  std::vector<Tensor> grad_shards_;               // per layer: the flat fp32 gradient shard [numel]
  std::vector<LmUnit> lm_units_;                  // the ends this rank holds (--task lm)
  std::map<std::size_t, Gather> gathers_;
  std::vector<Reduction> reductions_;  // in flight until finish_grads()
};

/// The stage's factory: lays out the mesh (--dp, default_dp()), checks that D divides B and T
/// divides what tensor parallelism splits (ConfigError, one line on every rank), then builds.
/// The mesh of ctx's job (--dp, default_dp()), once D divides B and T divides what tensor
/// parallelism splits (ConfigError, one line on every rank). Collective.
Mesh make_mesh(const RunContext& ctx);
std::unique_ptr<Parallelism> make_fsdp_tp(const RunContext& ctx);

/// --dry-run's plan: the same mesh and checks as make_fsdp_tp, stage 05's bytes on B / D over
/// the TP group plus the FSDP gathers and reduce-scatters over DP (fsdp_traffic(), and the
/// language model's ends': lm_grads_traffic()).
StagePlan plan_fsdp_tp(const RunContext& ctx);

}  // namespace tpx::fsdp
