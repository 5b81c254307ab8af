// Stage 08, context parallelism (CP): the ranks form a D × C × T mesh (common/mesh.h, TP
// innermost, then CP, then DP) and the sequence itself is split over the C ranks of each CP
// group. Everything but attention works token by token, so it runs on the rank's own tokens
// exactly as stage 07 (linked, not copied): stage 05's async TP inside each TP group, the FSDP
// shards, now over the merged DP×CP group (TorchTitan's dp_shard_cp), since CP ranks hold the
// same weights but see different tokens.
//
//   chunks     the sequence is cut into 2C chunks of S/(2C) tokens; CP rank i holds chunks i and
//              2C−1−i (load balance under the causal mask: every rank gets one early and one
//              late chunk, so the same number of visible keys); under SP its TP group splits
//              those S/C tokens as stage 03 does. RoPE rotates each token at its global position.
//   ring       (--cp-method ring, the default) forward: the rank's K/V block (its two chunks, at
//              their GQA size) goes around the CP ring by P2P, one hop per step, while the block
//              it holds is attended to; each (query chunk, key chunk) pair gives a partial
//              output and log-sum-exp, merged into the running result (ops::attention_merge);
//              pairs wholly above the diagonal are skipped, diagonal ones masked. Backward runs
//              the ring again from the merged LSE, each block's dK/dV partial travelling with it
//              and coming home after C hops.
//   allgather  (--cp-method allgather) K and V all-gathered over CP, local queries against all
//              chunks; backward gathers them again and reduce-scatters dK/dV.
//   ulysses    (--cp-method ulysses, DeepSpeed Ulysses) an all-to-all turns the sequence-sharded
//              q, k, v into head-sharded whole-sequence ones (1/C of the rank's heads each), the
//              plain fused attention runs on them, a second all-to-all brings the output back;
//              backward does the same with dO and the gradients. Needs NKV % (C·T) == 0.
//
// defines: tpx::cp::ContextParallel, tpx::cp::make_context_parallel(),
//          tpx::cp::make_context_parallel_on(), tpx::cp::check_context_parallel(),
//          tpx::cp::plan_context_parallel()
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "07_fsdp_tp/layers.h"
#include "08_context_parallel/traffic.h"
#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/mesh.h"
#include "common/parallel.h"
#include "common/stage.h"
#include "common/stream.h"

namespace tpx::cp {

class ContextParallel : public Parallelism {
 public:
  /// `mesh` has been made (collectively) for ctx's job with C > 1; ctx.options.config is the
  /// global config.
  ContextParallel(const RunContext& ctx, const Mesh& mesh, CpMethod method);
  ~ContextParallel() override;

  Sharding sharding() const override;
  std::string comm_name() const override;
  std::vector<MeshGroup> mesh_groups() const override { return mesh_.groups(); }

  // The linear layers and the FSDP hooks: stage 07's, on this rank's tokens.
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override {
    return inner_->column_forward(h, w, role);
  }
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override {
    return inner_->column_backward(saved, w, dy, dw, role);
  }
  Tensor column_saved(const Tensor& h, const Tensor& scale) override {
    return inner_->column_saved(h, scale);
  }
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override {
    return inner_->row_forward(a, w, role);
  }
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override {
    return inner_->row_backward(a, w, dy, dw, role);
  }
  bool defer_weight_grads(WeightGradWork* work) override {
    return inner_->defer_weight_grads(work);
  }
  void reduce_replicated_grad(const Tensor& grad) override { inner_->reduce_replicated_grad(grad); }
  // The language model's ends: stage 07's, on this rank's two chunks of the sequence.
  TokenCut token_cut(const BlockConfig& c) const override;
  Tensor vocab_reduce(const Tensor& partial) override { return inner_->vocab_reduce(partial); }
  Tensor vocab_reduce_backward(const Tensor& dx) override {
    return inner_->vocab_reduce_backward(dx);
  }
  void vocab_all_reduce(const Tensor& t, VocabReduce op) override {
    inner_->vocab_all_reduce(t, op);
  }
  LmParams lm_params(const LmParams& stored) override { return inner_->lm_params(stored); }
  LmParams lm_grads(const LmParams& stored) override { return inner_->lm_grads(stored); }
  void reduce_lm_grads(const LmParams& full, const LmParams& stored) override {
    inner_->reduce_lm_grads(full, stored);
  }
  Tensor gather_vocab(Split split, const Tensor& local) override {
    return inner_->gather_vocab(split, local);
  }
  LayerParams layer_params(const std::vector<LayerParams>& stored, std::size_t l,
                           int next) override {
    return inner_->layer_params(stored, l, next);
  }
  void release_layer(std::size_t l) override { inner_->release_layer(l); }
  LayerParams layer_grads(std::size_t l, const LayerParams& stored) override {
    return inner_->layer_grads(l, stored);
  }
  void grads_done(std::size_t l, const LayerParams& full, const LayerParams& stored) override {
    inner_->grads_done(l, full, stored);
  }
  void finish_grads() override { inner_->finish_grads(); }
  double sum_over_ranks(double local) override { return inner_->sum_over_ranks(local); }
  Tensor gather_param(Param p, const Tensor& local) override {
    return inner_->gather_param(p, local);
  }

  // What CP adds.
  void shard_model(Model& m) override;
  std::vector<SequenceRun> sequence_runs(std::int64_t rows) const override;
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                         const Tensor& out, const Tensor& lse, DType compute) override;
  void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, std::int64_t heads,
                          const Tensor& dq, const Tensor& dk, const Tensor& dv,
                          DType compute) override;
  Tensor gather_activation(const Tensor& local) override;
  CommStats take_comm_stats() override;
  void synchronize() override;

  const Mesh& mesh() const { return mesh_; }

 private:
  /// The index (0 … 2C−1) of chunk j (0: the early one, 1: the late one) of CP rank r.
  std::int64_t chunk_of(int r, int j) const { return j == 0 ? r : 2 * mesh_.cp - 1 - r; }
  /// Forward of this rank's two query chunks against the two K/V chunks of CP rank `src`
  /// (k, v: that rank's [S/C, B, kv] block), merged into out and lse.
  void attend_block(const Tensor& q, const Tensor& k, const Tensor& v, int src, std::int64_t heads,
                    const Tensor& out, const Tensor& lse);
  /// Backward of the same pairs: adds into dq (this rank's) and dk, dv (src's block).
  void attend_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             int src, const Tensor& out, const Tensor& lse, std::int64_t heads,
                             const Tensor& dq, const Tensor& dk, const Tensor& dv);
  /// The gradients of one attention call: this rank's dq, dk, dv.
  struct Grads {
    const Tensor &dq, &dk, &dv;
  };
  /// Forward and backward of each method (attention_forward / attention_backward choose).
  /// Ulysses: all-to-alls to heads / C of the whole sequence around the rank's fused attention.
  void ulysses_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& lse, DType compute, int call);
  void ulysses_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, std::int64_t heads,
                        const Grads& grads, DType compute, int call);
  /// All-gather: every CP rank's K/V gathered, merged into the fp32 out32 and lse; backward
  /// returns this rank's block's complete dK/dV, packed [dk | dv] in fp32.
  void allgather_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                         const Tensor& out32, const Tensor& lse, int call);
  Tensor allgather_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, std::int64_t heads,
                            const Tensor& dq32, int call);
  /// Ring: the K/V blocks travel around the CP ranks while each is attended to; backward sends
  /// the dK/dV partial sums round with them and returns this rank's, complete (fp32, packed).
  void ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                    const Tensor& out32, const Tensor& lse, int call);
  Tensor ring_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& out, const Tensor& lse, std::int64_t heads, const Tensor& dq32,
                       int call);
  /// This rank's K and V packed into one buffer [k | v] (one transfer per hop).
  Tensor pack_kv(const Tensor& k, const Tensor& v) const;
  /// Ulysses' all-to-all: x [S/C, B, X] (this rank's chunks, all of its X/hd heads of hd
  /// columns) → [S, B, X/C] (the whole sequence in natural order, head part cp_index).
  Tensor seq_to_heads(const Tensor& x, const std::string& what);
  /// The inverse: x [S, B, X/C] → [S/C, B, X].
  Tensor heads_to_seq(const Tensor& x, const std::string& what);
  /// Block r of `send` to CP rank r and block r of `recv` from it, for every r (pairwise
  /// exchange, C − 1 sendrecv steps on the CP lane; block me copied locally). Waits for it.
  void all_to_all(const Tensor& send, const Tensor& recv, const std::string& what);
  /// Sends `send` to the next CP rank while receiving `recv` from the previous one, on the CP
  /// lane; returns the event of its arrival.
  Event ring_hop(const Tensor& send, const Tensor& recv, const std::string& what);
  /// All-gathers this rank's packed K/V `mine` into `all` over CP on the CP lane, booked in the
  /// flight recorder now; returns the event of its completion.
  Event gather_kv(const Tensor& mine, const Tensor& all, const std::string& what);

  StageOptions local_options_;  // the options with S / C, what stage 07 sees
  Mesh mesh_;
  CpMethod method_;
  RunContext local_ctx_;
  std::unique_ptr<fsdp::FsdpTp> inner_;
  Trace& trace_;
  Device device_;
  std::int64_t seq_ = 0;  // the global S
  std::unique_ptr<Communicator> cp_comm_;
  Stream cp_lane_;
  int forward_calls_ = 0, backward_calls_ = 0;  // names the ring transfers in traces
  double attention_ms_ = 0;                     // this step's attention blocks (--json)
  std::uint64_t attention_blocks_ = 0;
};

/// The stage's factory: lays out the mesh (--dp default 1, --cp default 2 when the ranks are
/// even), checks that S splits into 2C·T chunks and that D divides B (ConfigError, one line on
/// every rank), then builds stage 07 alone (C = 1) or CP around it.
std::unique_ptr<Parallelism> make_context_parallel(const RunContext& ctx);
/// The same on a mesh made already (stage 09 makes one with a PP dimension and runs this stage
/// on each pipeline stage's slice of it): every check but the mesh's own.
std::unique_ptr<Parallelism> make_context_parallel_on(const RunContext& ctx, Mesh mesh);
/// Throws ConfigError (one line, the same on every rank) unless `mesh` splits everything the
/// stage splits: D the batch, 2C·T the sequence, T the heads and the FFN, and CP's method its KV
/// heads (the checks of make_context_parallel, make_context_parallel_on and
/// plan_context_parallel alike).
void check_context_parallel(const RunContext& ctx, const Mesh& mesh);

/// --dry-run's plan: the same mesh and checks as make_context_parallel, and a step's bytes per
/// group from traffic.h (mesh_traffic(): stage 05's on the rank's tokens over TP, chapter
/// 8's K/V bytes over CP, FSDP over DP×CP).
StagePlan plan_context_parallel(const RunContext& ctx);

}  // namespace tpx::cp
