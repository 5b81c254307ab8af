// The seam between the shared block and a stage: how a stage splits the block's linear layers
// and what it must do to reduce, gather and account for data across its ranks.
//
// Stage 01 implements it with plain GEMMs and no communication; stage 02 with Megatron's f/g
// all-reduces; stage 03 with sequence-parallel all-gather / reduce-scatter; later stages overlap
// those transfers with the GEMMs. The block (block.h) is written once against this interface.
//
// defines: tpx::ColumnResult, tpx::GroupTraffic, tpx::StepTime, tpx::CommStats, tpx::SequenceRun,
//          tpx::linear_output(), tpx::WeightGradWork, tpx::Parallelism
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "config.h"
#include "mesh.h"
#include "model.h"
#include "tensor.h"

namespace tpx {

class ExtraParameters;  // common/mlp_branch.h

/// Outputs of a column-parallel group, plus the input copy backward needs (the stage decides:
/// the local input, or the gathered one).
struct ColumnResult {
  std::vector<Tensor> y;
  Tensor saved;
};

/// One mesh group's part of a step's communication, under the name of the group its stage adds
/// (stage 07 "dp", stage 08 "cp", stage 09 "pp": CommStats::add_group).
struct GroupTraffic {
  std::string name;
  std::uint64_t payload_bytes = 0;
  std::uint64_t bus_bytes = 0;
};

/// A host-clock time a stage counts in its step under a name, summed over `blocks` timed pieces
/// (stage 08's "cp_attention": its attention blocks, forward and backward).
struct StepTime {
  std::string name;
  double ms = 0;
  std::uint64_t blocks = 0;
};

/// Communication of one step on this rank (nccl-tests convention for bus bytes), plus the named
/// counters a stage adds: the part of it each of the stage's mesh groups carried, and its timers.
/// common/ reads them only by name.
struct CommStats {
  std::uint64_t payload_bytes = 0;
  std::uint64_t bus_bytes = 0;
  std::uint64_t calls = 0;
  std::vector<GroupTraffic> groups;  ///< in the order first added; a name at most once
  std::vector<StepTime> times;       ///< likewise

  /// Adds one mesh group's traffic (its communicator's stats) to the totals and to the counter
  /// named `name`: `s.add_group("dp", dp_comm->take_stats())`.
  void add_group(std::string_view name, const CommStats& group) {
    payload_bytes += group.payload_bytes;
    bus_bytes += group.bus_bytes;
    calls += group.calls;
    GroupTraffic& g = named(groups, name);
    g.payload_bytes += group.payload_bytes;
    g.bus_bytes += group.bus_bytes;
  }
  /// Adds `ms` over `blocks` timed pieces to the timer named `name`.
  void add_time(std::string_view name, double ms, std::uint64_t blocks) {
    StepTime& t = named(times, name);
    t.ms += ms;
    t.blocks += blocks;
  }
  /// Adds another step's (or part's) totals and every named counter, by name.
  CommStats& operator+=(const CommStats& more) {
    payload_bytes += more.payload_bytes;
    bus_bytes += more.bus_bytes;
    calls += more.calls;
    for (const GroupTraffic& g : more.groups) {
      GroupTraffic& mine = named(groups, g.name);
      mine.payload_bytes += g.payload_bytes;
      mine.bus_bytes += g.bus_bytes;
    }
    for (const StepTime& t : more.times) add_time(t.name, t.ms, t.blocks);
    return *this;
  }
  /// The group named `name`'s part; zeros when no stage added it.
  GroupTraffic group(std::string_view name) const { return find(groups, name); }
  /// The timer named `name`; zeros when no stage added it.
  StepTime time(std::string_view name) const { return find(times, name); }

 private:
  template <class T>
  static T& named(std::vector<T>& all, std::string_view name) {
    for (T& x : all)
      if (x.name == name) return x;
    return all.emplace_back(T{.name = std::string(name)});
  }
  template <class T>
  static T find(const std::vector<T>& all, std::string_view name) {
    for (const T& x : all)
      if (x.name == name) return x;
    return T{.name = std::string(name)};
  }
};

/// Rows of the sequence this rank's attention sees, contiguous in global position: `rows` rows
/// from position `first`. Context parallelism gives a rank two of them (stage 08's 2C chunks).
struct SequenceRun {
  std::int64_t rows = 0, first = 0;
};

/// The token ids a rank's column-parallel region holds: the rows of the sequence (in order, as
/// sequence_runs() gives them) and the batch columns [batch_begin, batch_end). Its logits are
/// those positions', and so are the ids its embedding lookup reads.
struct TokenCut {
  std::vector<SequenceRun> runs;
  std::int64_t batch_begin = 0, batch_end = 0;
};

/// The `role` of the language model's output layer in column_forward / column_backward.
inline constexpr std::string_view kOutputLayerRole = "output";

/// The reductions of the vocabulary-parallel cross-entropy.
enum class VocabReduce { max, sum };

/// A new [rows..., out] tensor for the output of x [rows..., in] times a weight [in, out].
inline Tensor linear_output(const Tensor& x, const Tensor& w) {
  auto shape = x.shape();
  shape.back() = w.dim(1);
  return Tensor::empty(shape, x.dtype(), x.device());
}

/// Weight-gradient GEMMs a backward set aside to run later: stage 09's zero-bubble schedule
/// splits a block's backward into B (the input gradient, which the previous pipeline stage waits
/// for) and W (the weight gradients, which nobody waits for). Each piece holds the tensors it
/// reads, so they outlive the layer's saved activations.
class WeightGradWork {
 public:
  void defer(std::function<void()> gemm) { work_.push_back(std::move(gemm)); }
  /// Runs every deferred piece in the order deferred, then forgets them.
  void run() {
    for (auto& w : work_) w();
    work_.clear();
  }
  std::size_t size() const { return work_.size(); }

 private:
  std::vector<std::function<void()>> work_;
};

class Parallelism {
 public:
  virtual ~Parallelism() = default;

  /// Which part of the model and data this rank holds.
  virtual Sharding sharding() const = 0;
  /// Words for the header, e.g. "none" or "mpi (host memory)".
  virtual std::string comm_name() const { return "none"; }
  /// This rank's group of each dimension the stage communicates over, for the placement check
  /// (common/placement.h): the whole job as the TP group, unless the stage lays out a mesh.
  virtual std::vector<MeshGroup> mesh_groups() const { return {{"tp", RankGroup()}}; }

  // --- the linear layers -----------------------------------------------------------------------
  // `role` names the layer in traces and the flight recorder: "qkv", "o", "gate/up", "down".

  /// y[i] = f(h) · w[i] for a group of column-parallel weights sharing the input h.
  virtual ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                                      std::string_view role) = 0;
  /// dw[i] = f(h)ᵀ · dy[i] (written), returns dh = f_backward(Σ dy[i] · w[i]ᵀ) in h's layout.
  virtual Tensor column_backward(const Tensor& saved, std::span<const Tensor> w,
                                 std::span<const Tensor> dy, std::span<const Tensor> dw,
                                 std::string_view role) = 0;
  /// Selective recompute: what column_forward saved for backward, made again from the same
  /// input h without communicating. `scale` is the saved tensor's FP8 scale (undefined unless
  /// the stage keeps FP8 shards). Stages 01-05 keep h itself.
  virtual Tensor column_saved(const Tensor& h, const Tensor& /*scale*/) { return h; }
  /// Returns y = g(a · w) in the layout of the residual stream.
  virtual Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) = 0;
  /// dw = aᵀ · g_backward(dy) (written), returns da = g_backward(dy) · wᵀ.
  virtual Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                              std::string_view role) = 0;

  /// While `work` is set, column_backward and row_backward compute the input gradient only and
  /// leave their dW GEMMs in `*work`, writing the same dw tensors when run; null restores the
  /// whole backward. Returns false (and changes nothing) when the stage cannot split its
  /// backward. Stages 04-08 can (stage 09 runs on them).
  virtual bool defer_weight_grads(WeightGradWork* work) { return work == nullptr; }

  // --- attention (context parallelism, stage 08; the rank's own fused attention elsewhere) ----

  /// Where the rows of q and k (dim 0, as column_forward returned them) sit in the sequence, in
  /// order: RoPE rotates each row for its global position. Default: `rows` from position 0.
  virtual std::vector<SequenceRun> sequence_runs(std::int64_t rows) const { return {{rows, 0}}; }
  /// Causal attention of this rank's queries (fused: out and lse, [B, heads, S] f32 floats whose
  /// layout only attention_backward reads). Default: ops::attention_fused_forward on the rank's
  /// own q, k, v (defined in block.cc). Stage 08 brings the other CP ranks' keys.
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 std::int64_t heads, const Tensor& out, const Tensor& lse,
                                 DType compute);
  /// dq, dk, dv (overwritten) from what attention_forward made. Default: the fused backward.
  virtual void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  std::int64_t heads, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, DType compute);

  // --- parameters sharded over a data-parallel group (stage 07's FSDP; identity elsewhere) ------
  // The trainer keeps what these hooks are given (Model: the parameters, gradients and optimizer
  // state this rank owns) and asks, layer by layer, for what the block computes with.

  /// After the model is built (TP shards of every parameter, this rank's part of the input and
  /// target): keep only this rank's share (FSDP: a dim-0 shard of every parameter and gradient,
  /// this replica's part of the batch).
  virtual void shard_model(Model& /*m*/) {}
  /// The parameters layer `l` computes with, from what the trainer holds (`stored[l]`: the
  /// compute copies of this rank's shards of layer l). FSDP: the layer's TP-local weights,
  /// all-gathered over the DP group; the gather of layer `next` (≥ 0) is issued too, so that it
  /// runs while `l` computes.
  virtual LayerParams layer_params(const std::vector<LayerParams>& stored, std::size_t l,
                                   int /*next*/) {
    return stored[l];
  }
  /// Layer `l` is done with what layer_params() returned: free it (FSDP: reshard).
  virtual void release_layer(std::size_t /*l*/) {}
  /// The gradient buffers layer `l`'s backward writes, given the trainer's (`stored`).
  virtual LayerParams layer_grads(std::size_t /*l*/, const LayerParams& stored) { return stored; }
  /// Layer `l`'s gradients are complete in `full` (from layer_grads): reduce them into `stored`
  /// (FSDP: a reduce-scatter over the DP group, on its own stream, while backward goes on).
  virtual void grads_done(std::size_t /*l*/, const LayerParams& /*full*/,
                          const LayerParams& /*stored*/) {}
  /// Before the optimizer step: every reduction grads_done() and reduce_lm_grads() issued has
  /// landed.
  virtual void finish_grads() {}

  // --- the language model's two ends (--task lm; DESIGN.md, "The language model around the
  // block"). The embedding is cut over the vocabulary like a row-parallel layer's input rows, the
  // output layer is a column-parallel linear (column_forward with role "output"), and the
  // cross-entropy reduces three [positions] vectors instead of gathering the logits. -----------

  /// The positions whose token ids this rank looks up and scores (c's S and B; the CP and DP
  /// cuts come from sharding()). Default: the sequence runs of its S / C region rows, batch
  /// columns [0, B) (stages 07-09 give their replica's B / D).
  virtual TokenCut token_cut(const BlockConfig& c) const {
    return {sequence_runs(c.seq / sharding().cp), 0, c.batch};
  }
  /// The embedding lookup's partial [rows, B, H] (this rank's vocabulary rows, zeros for the other
  /// ids) made whole in the residual stream's layout: the g of a row-parallel layer (stage 02: an
  /// all-reduce; from stage 03: a reduce-scatter along S). Default: as it is (one rank, the whole
  /// vocabulary).
  virtual Tensor vocab_reduce(const Tensor& partial) { return partial; }
  /// Its backward: the residual stream's gradient as every rank's lookup reads it, g's backward
  /// (stage 02: as it is; from stage 03: all-gathered along S).
  virtual Tensor vocab_reduce_backward(const Tensor& dx) { return dx; }
  /// In place over the ranks that share the vocabulary (the TP group): MAX or SUM of the
  /// cross-entropy's per-position f32 vectors. Default: nothing to reduce.
  virtual void vocab_all_reduce(const Tensor& /*t*/, VocabReduce /*op*/) {}
  /// The language model's parameters as an end computes with them, from what the trainer holds
  /// (`stored`: the compute copies of this rank's parts; the caller defines the tensors of the
  /// end it is about to run and leaves the others undefined). FSDP (stages 07-09): each end's
  /// shards all-gathered over the DP×CP group in one flat buffer (the embedding; the final gain
  /// with the output layer), as a layer's. Default: as they are.
  virtual LmParams lm_params(const LmParams& stored) { return stored; }
  /// The buffers an end's backward writes its gradients into, for the tensors `stored` (the
  /// trainer's gradients) defines. FSDP: unsharded fp32 tensors of the TP-local shapes.
  /// Default: `stored` itself.
  virtual LmParams lm_grads(const LmParams& stored) { return stored; }
  /// The gradients in `full` (from lm_grads(); the tensors it defines) are complete: reduce
  /// them into `stored` over the ranks that hold the same part of the model (FSDP: one fp32
  /// reduce-scatter per end over the DP×CP group, on a stream of its own, landed by
  /// finish_grads()). The final gain's over the TP group under sequence parallelism comes
  /// first, through reduce_replicated_grad(). Default: nothing (the buffers were `stored`).
  virtual void reduce_lm_grads(const LmParams& /*full*/, const LmParams& /*stored*/) {}

  // --- what the step loop needs across ranks ---------------------------------------------------
  /// Sums a per-rank scalar over all ranks. The caller makes each rank contribute only what it
  /// alone holds (a replicated value on rank 0 only), so every piece is counted once.
  virtual double sum_over_ranks(double local) { return local; }
  /// Called after backward on every gradient of a replicated parameter (sequence parallelism
  /// all-reduces the norm gains' gradients here).
  virtual void reduce_replicated_grad(const Tensor& /*grad*/) {}
  /// On rank 0: the full [S, B, H] tensor from this rank's part of an activation (collective).
  virtual Tensor gather_activation(const Tensor& local) { return local; }
  /// On rank 0: the full parameter (or gradient) from this rank's shard (collective).
  virtual Tensor gather_param(Param /*p*/, const Tensor& local) { return local; }
  /// On rank 0: the full language-model tensor (padded vocabulary) from this rank's part, split
  /// over the TP group as `split` says (collective).
  virtual Tensor gather_vocab(Split /*split*/, const Tensor& local) { return local; }
  /// On rank 0: what else --dump writes, as (file name without .npy, host tensor), e.g. stage
  /// 06's FP8 operands (collective; called once, after the first forward and backward).
  virtual std::vector<std::pair<std::string, Tensor>> dump_extra() { return {}; }
  /// What the stage trains beside the model's parameters (stage 10's experts: mlp_branch.h);
  /// null for none.
  virtual ExtraParameters* extra_parameters() { return nullptr; }
  /// The config --check's reference runs: `c`, with what the stage's layout decides that the
  /// model's arithmetic depends on (stage 10 under a pipeline: its micro-batches are the
  /// experts' routing groups, MoeConfig::microbatches).
  virtual BlockConfig reference_config(const BlockConfig& c) const { return c; }
  /// Communication since the last call, and resets the counters.
  virtual CommStats take_comm_stats() { return {}; }
  /// Waits until all queued work on this rank is done (device sync; a no-op on the cpu).
  virtual void synchronize() {}
};

}  // namespace tpx
