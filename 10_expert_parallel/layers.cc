// Stage 10's experts beside stage 07's FSDP: one MlpBranch per MoE layer over the EP group, and
// what the training loop does with their parameters (layers.h).
#include "10_expert_parallel/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <span>

#include <fmt/format.h>

#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/flags.h"
#include "09_pipeline_parallel/flags.h"
#include "09_pipeline_parallel/pipeline.h"
#include "10_expert_parallel/memory.h"
#include "10_expert_parallel/traffic.h"
#include "common/check.h"
#include "common/comm/communicator.h"
#include "common/moe_ep.h"
#include "common/moe_flags.h"
#include "common/moe_model.h"
#include "common/ops.h"
#include "common/stream.h"
#include "common/trainer.h"

namespace tpx::ep {
namespace {

using I = std::int64_t;

Tensor host_tensor(std::span<const float> v, Tensor::Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, Device::cpu);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  return t;
}

/// v's floats as a tensor of `shape` on `device`.
Tensor on_device(std::span<const float> v, Tensor::Shape shape, Device device) {
  return ops::to_device(host_tensor(v, std::move(shape)), device);
}

/// A copy of t (its own storage) on t's device.
Tensor copy_of(const Tensor& t) {
  const Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  ops::copy(t, c);
  return c;
}

/// t's floats on the host, outside the allocator (a report's copy), or none for an undefined t.
std::vector<float> host_copy(const Tensor& t) {
  if (!t.defined()) return {};
  const Tensor h = ops::to_device(t, Device::cpu);
  return {h.f32().begin(), h.f32().end()};
}

/// Rows [S, b, H] (t = s·b + j) as [b·S, H] in sequence order (t' = j·S + s) with `to_sequence`,
/// and such rows [b·S, H] back to [S·b, H] without (moe_model.h's token order), by one
/// ops::gather_rows.
Tensor reorder(const Tensor& rows, I S, I b, bool to_sequence) {
  const I H = rows.dim(rows.ndim() - 1), n = S * b;
  const Tensor index = Tensor::empty({n}, DType::i32);
  for (I s = 0; s < S; ++s)
    for (I j = 0; j < b; ++j) {
      const I sequence = j * S + s, layout = s * b + j;
      index.data<std::int32_t>()[to_sequence ? sequence : layout] =
          static_cast<std::int32_t>(to_sequence ? layout : sequence);
    }
  const Tensor out = Tensor::empty({n, H}, DType::f32, rows.device());
  ops::gather_rows(rows.reshape({n, H}), ops::to_device(index, rows.device()), Tensor(), out);
  return out;
}

}  // namespace

/// Every MoE layer's experts, the communicators they move tokens and gradients over, and the
/// training loop's view of them (ExtraParameters).
class MoeLayers final : public ExtraParameters {
 public:
  /// `held`: the model's layers this rank holds (a pipeline stage's), as Model's.
  MoeLayers(const RunContext& ctx, const Mesh& mesh, int ep, std::vector<I> held);

  MlpBranch* mlp(std::size_t layer) override;
  void microbatch(int j, int m) override {
    microbatch_ = j;
    microbatches_ = m;
  }
  double loss_part() const override;
  double grad_square_sum() const override;
  void update(int t) override;
  void snapshot(NamedValues& params, NamedValues& grads) override;
  nlohmann::json summary() const override;
  nlohmann::json joined(const std::vector<nlohmann::json>& parts) const override;

  CommStats take_stats() {
    CommStats s;
    if (tp_) s += tp_->take_stats();  // the TP group's, as the dense layers'
    s.add_group("ep", ep_->take_stats());
    s.add_group("dp", tokens_->take_stats());
    if (replicas_) s.add_group("dp", replicas_->take_stats());
    return s;
  }
  /// Draws every MoE layer's experts (once): called when training asks for them, after the
  /// start-up's memory check, so that a model too large is refused before any rank allocates it.
  void make_layers();
  int ep_size() const { return ep_size_; }
  const RankGroup& ep_group() const { return ep_group_; }
  std::int64_t experts_per_rank() const { return c_.moe.experts / ep_size_; }
  /// The first step's assignments per expert, [MoE layers, E].
  Tensor first_counts() const;

 private:
  class Layer;
  const BlockConfig& c_;
  int ep_size_, ep_rank_, replica_;  // EP, this rank's index in its EP group, the group's index
  int tp_size_, tp_rank_;            // the TP group the experts' width is cut over
  int dp_, cp_;                      // the mesh's D and C: the token group's D·C ranks
  Stream stream_;
  RankGroup ep_group_;                          // EP consecutive replicas of one TP index
  std::unique_ptr<Communicator> ep_;            // the EP group: dispatch and combine
  std::unique_ptr<Communicator> tokens_;        // the D ranks: capacity, aux loss, router's grads
  std::unique_ptr<Communicator> replicas_;      // the D / EP holders of this rank's experts
  std::unique_ptr<Communicator> tp_;            // the TP group: its tokens gathered, outputs summed
  std::vector<I> held_;                         // the layers this rank holds
  std::vector<std::unique_ptr<Layer>> layers_;  // per held layer; null where it is dense
  int microbatch_ = 0, microbatches_ = 1;       // the current one, and the step's
  std::optional<Stream> lane_;                  // --moe-chunks > 1: the EP lane

  MoeEpOverlap overlap(Trace& trace) const {
    return {.chunks = int(c_.moe.chunks), .lane = lane_ ? &*lane_ : nullptr, .trace = &trace};
  }
  /// Where the token group's tokens lie in the capacity's order (cp_token_order: runs of
  /// sequence chunks under context parallelism), each rank holding b sequences.
  MoeTokenOrder token_order(I b) const { return cp_token_order(dp_, cp_, b); }
};

/// One MoE layer on this rank: the router and shared experts whole, its E/EP experts, their
/// gradients and AdamW moments, the balancing bias, and what backward needs.
class MoeLayers::Layer final : public MlpBranch {
 public:
  Layer(MoeLayers& owner, I layer)
      : o_(owner), layer_(layer), bias_(std::size_t(owner.c_.moe.experts), 0.0f) {
    bias_[0] = float(owner.c_.moe.skew);  // TPX_MOE_SKEW's, a test's skewed routing (else 0)
    const BlockConfig& c = o_.c_;
    const MoeWeights<float> w =
        moe_init<float>(c, layer, o_.ep_rank_ * local(), local(), o_.tp_rank_, o_.tp_size_);
    const I H = c.hidden, E = c.moe.experts, fe = c.moe.expert_ffn / o_.tp_size_,
            sf = c.moe.shared_ffn / o_.tp_size_, El = local();
    const Device d = c.device;
    w_.router = on_device(w.router, {H, E}, d);
    w_.w_gate = on_device(w.w_gate, {El, H, fe}, d);
    w_.w_up = on_device(w.w_up, {El, H, fe}, d);
    w_.w_down = on_device(w.w_down, {El, fe, H}, d);
    if (sf > 0) {
      w_.shared_gate = on_device(w.shared_gate, {H, sf}, d);
      w_.shared_up = on_device(w.shared_up, {H, sf}, d);
      w_.shared_down = on_device(w.shared_down, {sf, H}, d);
    }
    if (sharded()) {  // keep this holder's 1/G of the experts, let the rest go
      const Tensor all = pack(w_);
      const I G = o_.replicas_->size(), part = all.numel() / G;
      shard_ = copy_of(all.slice0(o_.replica_ * part, (o_.replica_ + 1) * part));
      release_experts();
    }
  }

  I local() const { return o_.c_.moe.experts / o_.ep_size_; }

  // (No span around the whole layer: its own spans say which part of it computes and which
  // waits for an exchange, so that the trace's exposed communication is the experts' too.)
  Tensor forward(const Tensor& h2, Trace& trace) override {
    TPX_CHECK(h2.device() == o_.c_.device && h2.dtype() == DType::f32, "experts on {}",
              h2.describe());
    Saved& s = slot();
    s = {};  // a held-out forward's, or none: backward frees the step's
    // The replica's tokens: under sequence parallelism each TP rank holds S/T positions of them.
    const Tensor rows = gather(h2, trace);
    const I S = rows.dim(0), b = rows.dim(1), H = rows.dim(2);
    MoeConfig routing = o_.c_.moe;  // this micro-batch a routing group of the step's M
    routing.microbatches = o_.microbatches_;
    s.shape = routing.shape(H, S * b);
    s.shape.expert_ffn /= o_.tp_size_;  // this rank's part of every expert's width
    s.shape.shared_ffn /= o_.tp_size_;
    s.x = reorder(rows, S, b, /*to_sequence=*/true);
    gather_experts(trace);
    const Tensor bias = on_device(bias_, {I(bias_.size())}, o_.c_.device);
    s.f = moe_ep_ops_forward(s.shape, w_, s.x, bias, *o_.ep_, o_.stream_, o_.tokens_.get(),
                             o_.overlap(trace), o_.token_order(b));
    release_experts();
    s.aux_loss = s.f.aux_loss;
    const Tensor y = reorder(s.f.y, S, b, /*to_sequence=*/false).reshape(rows.shape());
    s.f.y = {};  // backward does not read it
    return scatter(y, trace);
  }

  Tensor backward(const Tensor& dout, Trace& trace) override {
    Saved& s = slot();
    const Tensor rows = gather(dout, trace);
    const I S = rows.dim(0), b = rows.dim(1);
    const Tensor dy = reorder(rows, S, b, /*to_sequence=*/true);
    const bool first = backwards_ % o_.microbatches_ == 0;  // the step's first micro-batch
    if (first) g_ = {};  // the last step's, which the update has used
    gather_experts(trace);
    MoeTensorGrads g = moe_ep_ops_backward(s.shape, w_, s.x, s.f, dy, *o_.ep_, o_.stream_,
                                           o_.tp_.get(), o_.overlap(trace));
    release_experts();
    const Tensor dx = reorder(g.x, S, b, /*to_sequence=*/false).reshape(rows.shape());
    g.x = {};
    // The most rows one of the step's forwards received (--json's moe.rows_received_max).
    I received = 0;
    for (const Tensor& r : s.f.recv) received += r.dim(0);
    rows_ = first ? received : std::max(rows_, received);
    // The step's gradients and counts: this micro-batch's, added to the earlier ones'.
    if (first) {
      g_ = std::move(g.w);
      counts_ = s.f.routed_all;
    } else {
      const auto into = moe_tensors(g_);
      const auto from = moe_tensors(g.w);
      for (std::size_t p = 0; p < into.size(); ++p)
        if (into[p]->defined()) ops::accumulate(*from[p], *into[p]);
      for (std::size_t e = 0; e < counts_.size(); ++e) counts_[e] += s.f.routed_all[e];
    }
    if (++backwards_ % o_.microbatches_ == 0) {
      // After the step's last micro-batch: the router's and the shared experts' parts summed
      // over every token's rank; each expert's over its holders, each keeping 1/G (FSDP).
      for (const Tensor* t : {&g_.router, &g_.shared_gate, &g_.shared_up, &g_.shared_down})
        if (t->defined() && o_.tokens_->size() > 1) o_.tokens_->all_reduce(*t, o_.stream_);
      if (sharded()) reduce_scatter_experts(trace);
    }
    s.x = {};  // what backward needed (its auxiliary loss stays for the step's loss)
    s.f = {};
    return scatter(dx, trace);
  }

  /// Whether the experts are sharded over their holders (D/EP > 1).
  bool sharded() const { return o_.replicas_ != nullptr; }

  /// The experts' three tensors of `w` side by side, padded with zeros to a multiple of the
  /// holders G: what a holder's shard is 1/G of.
  Tensor pack(const MoeTensors& w) const {
    const I G = o_.replicas_->size();
    const I n = w.w_gate.numel() + w.w_up.numel() + w.w_down.numel();
    const Tensor all = Tensor::empty({(n + G - 1) / G * G}, DType::f32, o_.c_.device);
    I at = 0;
    for (const Tensor* t : {&w.w_gate, &w.w_up, &w.w_down}) {
      ops::copy(t->reshape({t->numel()}), all.slice0(at, at + t->numel()));
      at += t->numel();
    }
    if (at < all.numel()) ops::fill(all.slice0(at, all.numel()), 0.0f);
    return all;
  }
  /// pack()'s inverse into w's three tensors (their shapes: this rank's experts' and width),
  /// each a copy of its own.
  void unpack(const Tensor& all, MoeTensors& w) const {
    const I H = o_.c_.hidden, fe = o_.c_.moe.expert_ffn / o_.tp_size_, El = local(),
            n = El * H * fe;
    const Tensor::Shape shapes[] = {{El, H, fe}, {El, H, fe}, {El, fe, H}};
    Tensor* into[] = {&w.w_gate, &w.w_up, &w.w_down};
    for (int i = 0; i < 3; ++i)
      *into[i] = copy_of(all.slice0(i * n, (i + 1) * n)).reshape(shapes[i]);
  }

  /// The experts whole for a forward or backward (an all_gather of the shards over the holders,
  /// counted in the step's dp traffic), and let go after it.
  void gather_experts(Trace& trace) {
    if (!sharded()) return;
    TraceScope span(trace, "experts: FSDP all-gather", Lane::dp_comm);
    const I G = o_.replicas_->size();
    const Tensor all = Tensor::empty({shard_.numel() * G}, DType::f32, o_.c_.device);
    o_.replicas_->all_gather(shard_, all, o_.stream_);
    unpack(all, w_);
  }
  void release_experts() {
    if (!sharded()) return;
    for (Tensor* t : {&w_.w_gate, &w_.w_up, &w_.w_down}) *t = {};
  }

  /// After the step's last backward: the experts' gradients summed over the holders, each
  /// keeping its 1/G (a reduce_scatter), and the whole ones let go.
  void reduce_scatter_experts(Trace& trace) {
    TraceScope span(trace, "experts: FSDP reduce-scatter", Lane::dp_comm);
    Tensor packed = pack(g_);
    for (Tensor* t : {&g_.w_gate, &g_.w_up, &g_.w_down}) *t = {};
    const I G = o_.replicas_->size(), part = packed.numel() / G;
    grad_shard_ = Tensor::empty({part}, DType::f32, o_.c_.device);
    o_.replicas_->reduce_scatter(packed, grad_shard_, o_.stream_);
  }

  /// The TP group's parts of a [S/T, b, H] tensor, whole: [S, b, H] (itself when T = 1).
  Tensor gather(const Tensor& part, Trace& trace) const {
    if (!o_.tp_) return part;
    TraceScope span(trace, "experts: all-gather", Lane::comm);
    Tensor whole = Tensor::empty({part.dim(0) * o_.tp_size_, part.dim(1), part.dim(2)}, DType::f32,
                                 part.device());
    o_.tp_->all_gather(part, whole, o_.stream_);
    return whole;
  }
  /// The sum over the TP group of each rank's [S, b, H], this rank's S/T positions of it.
  Tensor scatter(const Tensor& whole, Trace& trace) const {
    if (!o_.tp_) return whole;
    TraceScope span(trace, "experts: reduce-scatter", Lane::comm);
    Tensor part = Tensor::empty({whole.dim(0) / o_.tp_size_, whole.dim(1), whole.dim(2)},
                                DType::f32, whole.device());
    o_.tp_->reduce_scatter(whole, part, o_.stream_);
    return part;
  }

  /// What forward keeps for backward (its float buffers; the routing's small integer ones are
  /// left out).
  std::size_t saved_bytes() const override {
    const Saved& s = saved_.at(std::size_t(o_.microbatch_));
    return (s.x.defined() ? s.x.nbytes() : 0) + s.f.bytes();
  }

  /// The step's auxiliary loss: its micro-batches' (each weighted 1/M by the shape).
  double aux_loss() const {
    double sum = 0.0;
    for (const Saved& s : saved_) sum += s.aux_loss;
    return sum;
  }

  /// Σ g² of what this rank counts, each value once over the mesh: the router (the same on
  /// every rank) where `router`, the shared experts' part of the width where `shared`, this
  /// rank's experts' part where `experts`.
  double square_sum(bool router, bool shared, bool experts) const {
    double sq = 0.0;
    auto add = [&](const Tensor& t) {
      if (t.defined()) sq += ops::sum_squares(t);
    };
    if (router) add(g_.router);
    if (shared)
      for (const Tensor* t : {&g_.shared_gate, &g_.shared_up, &g_.shared_down}) add(*t);
    if (sharded())  // each holder its own part
      add(grad_shard_);
    else if (experts)
      for (const Tensor* t : {&g_.w_gate, &g_.w_up, &g_.w_down}) add(*t);
    return sq;
  }

  /// SGD or AdamW at step t with the ops the model's parameters use (every tensor a matrix:
  /// decayed), then the balancing bias from the step's counts over all tokens.
  void update(int t) {
    const BlockConfig& c = o_.c_;
    const auto w = moe_tensors(w_);
    const auto g = moe_tensors(g_);
    // The tensors this rank steps: the seven (the experts' undefined when sharded), then the
    // experts' shard.
    std::vector<std::pair<Tensor*, Tensor*>> steps;
    for (std::size_t p = 0; p < w.size(); ++p) steps.emplace_back(w[p], g[p]);
    if (sharded()) steps.emplace_back(&shard_, &grad_shard_);
    if (moments_.empty() && c.optimizer == Optimizer::adamw)  // SGD keeps none
      for (const auto& [x, grad] : steps)
        for (int i = 0; i < 2; ++i)
          moments_.push_back(x->defined() ? ops::zeros_like(*x) : Tensor());
    ops::AdamWStep step = training::adamw_step(c, t);
    step.decay = float(1.0 - c.lr * c.weight_decay);
    for (std::size_t p = 0; p < steps.size(); ++p) {
      const Tensor& x = *steps[p].first;
      if (!x.defined()) continue;  // no shared experts; the experts' while sharded
      if (c.optimizer == Optimizer::sgd)
        ops::sgd_update(x, *steps[p].second, float(c.lr));
      else
        ops::adamw_update(x, *steps[p].second, moments_[2 * p], moments_[2 * p + 1], step);
    }
    if (c.moe.bias_rate > 0) moe_update_bias<float>(bias_, counts_, c.moe.bias_rate);
    history_.push_back(counts_);
  }

  /// A report's copy of every tensor whole, outside the allocator (as the dense layers' snapshot:
  /// the step's peak leaves it out).
  using Report = MoeWeights<float, std::vector<float>>;

  /// Every tensor whole on this rank (collective over the TP and EP groups): the width of all
  /// TP ranks, the experts of all EP ranks.
  Report whole(const MoeTensors& mine, const Tensor& shard) {
    const I H = o_.c_.hidden, T = o_.tp_size_;
    Report all{host_copy(mine.router),     host_copy(mine.w_gate),      host_copy(mine.w_up),
               host_copy(mine.w_down),     host_copy(mine.shared_gate), host_copy(mine.shared_up),
               host_copy(mine.shared_down)};
    // Over the holders first: this rank's experts whole, as pack() laid them.
    if (sharded()) {
      const std::vector<float> packed = report_gather(*o_.replicas_, host_copy(shard));
      const std::size_t n = std::size_t(local() * H * o_.c_.moe.expert_ffn / T);
      std::size_t at = 0;
      for (std::vector<float>* t : {&all.w_gate, &all.w_up, &all.w_down}) {
        t->assign(packed.begin() + std::ptrdiff_t(at), packed.begin() + std::ptrdiff_t(at + n));
        at += n;
      }
    }
    // Over TP: w_gate and w_up [count, H, FE/T] → [count, H, FE]; w_down [count, FE/T, H] →
    // [count, FE, H] (each expert's row blocks in rank order); the shared experts likewise.
    auto columns = [&](const std::vector<float>& part, I count) {
      const std::vector<float> parts = report_gather(*o_.tp_, part);
      const I rows = count * H, w = I(part.size()) / std::max<I>(rows, 1);
      std::vector<float> out(parts.size());
      for (I r = 0; r < T; ++r)
        for (I i = 0; i < rows; ++i)
          std::copy_n(parts.begin() + (r * rows + i) * w, w, out.begin() + (i * T + r) * w);
      return out;
    };
    auto row_blocks = [&](const std::vector<float>& part, I count) {
      const std::vector<float> parts = report_gather(*o_.tp_, part);
      const I block = I(part.size()) / std::max<I>(count, 1);
      std::vector<float> out(parts.size());
      for (I r = 0; r < T; ++r)
        for (I e = 0; e < count; ++e)
          std::copy_n(parts.begin() + (r * count + e) * block, block,
                      out.begin() + (e * T + r) * block);
      return out;
    };
    if (o_.tp_) {
      all.w_gate = columns(all.w_gate, local());
      all.w_up = columns(all.w_up, local());
      all.w_down = row_blocks(all.w_down, local());
      if (!all.shared_gate.empty()) {
        all.shared_gate = columns(all.shared_gate, 1);
        all.shared_up = columns(all.shared_up, 1);
        all.shared_down = row_blocks(all.shared_down, 1);
      }
    }
    // Over EP: expert e of rank i is expert i·E/EP + e.
    for (std::vector<float>* t : {&all.w_gate, &all.w_up, &all.w_down})
      *t = report_gather(*o_.ep_, *t);
    return all;
  }

  /// Every rank's `mine` (all of one size) in rank order: a report gather, not the step's.
  static std::vector<float> report_gather(Communicator& comm, const std::vector<float>& mine) {
    std::vector<float> all(mine.size() * std::size_t(comm.size()));
    comm.all_gather_report(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)),
                           "experts for the report");
    return all;
  }

  void snapshot(NamedValues& params, NamedValues& grads) {
    const Report w = whole(w_, shard_), g = whole(g_, grad_shard_);
    for (auto& t : moe_named(o_.c_.moe, w, layer_, 0)) params.push_back(std::move(t));
    for (auto& t : moe_named(o_.c_.moe, g, layer_, 0)) grads.push_back(std::move(t));
  }

  const std::vector<std::vector<std::int64_t>>& history() const { return history_; }
  const std::vector<std::int64_t>& rows_history() const { return rows_history_; }
  /// The most rows this rank received in one of the step's forwards, and the most over the
  /// token group's ranks, which the step's summary keeps.
  I rows() const { return rows_; }
  void add_rows_history(std::int64_t most) { rows_history_.push_back(most); }
  const std::vector<std::int64_t>& counts() const { return counts_; }

 private:
  MoeLayers& o_;
  I layer_;
  MoeTensors w_;
  HostVector<float> bias_;  // the balancing bias (the host's: it moves by the step's counts)
  /// What one micro-batch's forward keeps for its backward.
  struct Saved {
    MoeShape shape;
    Tensor x;  // the layer's input rows in sequence order
    MoeEpOpsForward f;
    double aux_loss = 0.0;  // kept past the backward, for the step's loss
  };
  /// The current micro-batch's (MoeLayers::microbatch()).
  Saved& slot() {
    saved_.resize(std::size_t(o_.microbatches_));
    return saved_[std::size_t(o_.microbatch_)];
  }

  std::vector<Saved> saved_;  // per micro-batch
  std::int64_t backwards_ = 0;
  // FSDP over the D/EP holders of the same experts (G > 1): this holder's 1/G of its experts'
  // three tensors packed [w_gate | w_up | w_down] (pack()), and of their gradients. w_'s three
  // are whole only while a forward or a backward runs: gathered, then let go.
  Tensor shard_, grad_shard_;
  MoeTensors g_;                                    // the step's, summed over its micro-batches
  std::vector<Tensor> moments_;                     // AdamW's, two per tensor
  std::vector<std::int64_t> counts_;                // the last step's assignments per expert
  std::vector<std::vector<std::int64_t>> history_;  // every step's
  I rows_ = 0;                                      // the most rows received, this step
  std::vector<std::int64_t> rows_history_;          // every step's, the most over the replicas
};

MoeLayers::MoeLayers(const RunContext& ctx, const Mesh& mesh, int ep, std::vector<I> held)
    : c_(ctx.options.config),
      ep_size_(ep),
      ep_rank_(mesh.dp_cp_index() % ep),
      replica_(mesh.dp_cp_index() / ep),
      tp_size_(mesh.tp),
      tp_rank_(mesh.tp_index),
      dp_(mesh.dp),
      cp_(mesh.cp),
      stream_(c_.device),
      held_(std::move(held)) {
  // Every group holds one TP index of one pipeline stage: rank t of each TP group routes and
  // dispatches with rank t of the others. Each split is collective over the job, used or not.
  // The token group is the D·C ranks of this TP index (D at C = 1), in (dp, cp) order; where
  // their tokens lie in the order the capacity counts them in: token_order().
  const int tp_index = mesh.tp_index, groups = mesh.dp_cp() / ep, stage = mesh.pp_index;
  const std::string where = mesh.pp > 1 ? fmt::format("{}.", stage) : "";
  CommOptions o = ctx.options.comm;
  ep_group_ = RankGroup::split((stage * groups + replica_) * mesh.tp + tp_index, ep_rank_,
                               fmt::format("ep group {}{}.{}", where, replica_, tp_index));
  o.group = ep_group_;
  ep_ = make_communicator(o, c_.device);
  o.group = mesh.dp_cp_group;
  o.group_label = fmt::format("dp group {} (experts)", tp_index);
  tokens_ = make_communicator(o, c_.device);
  RankGroup holders =
      RankGroup::split((stage * ep + ep_rank_) * mesh.tp + tp_index, replica_,
                       fmt::format("expert holders {}{}.{}", where, ep_rank_, tp_index));
  o.group_label = "";
  if (groups > 1) {
    o.group = holders;
    replicas_ = make_communicator(o, c_.device);
  }
  if (mesh.tp > 1) {
    o.group = mesh.tp_group;
    o.group_label = fmt::format("{} (experts)", mesh.tp_group.name());
    tp_ = make_communicator(o, c_.device);
  }
  if (c_.moe.chunks > 1) lane_ = Stream::create(c_.device);
}

void MoeLayers::make_layers() {
  if (!layers_.empty()) return;
  layers_.resize(held_.size());
  for (std::size_t i = 0; i < held_.size(); ++i)
    if (c_.moe.layer(held_[i])) layers_[i] = std::make_unique<Layer>(*this, held_[i]);
}

MlpBranch* MoeLayers::mlp(std::size_t layer) {
  return layer < layers_.size() ? layers_[layer].get() : nullptr;
}

double MoeLayers::loss_part() const {
  // The TP ranks of a replica route alike: each auxiliary loss counted on the group's rank 0.
  double sum = 0.0;
  if (tp_rank_ != 0) return sum;
  for (const auto& l : layers_)
    if (l) sum += l->aux_loss();
  return sum;
}

double MoeLayers::grad_square_sum() const {
  double sq = 0.0;
  for (const auto& l : layers_)
    if (l)
      sq += l->square_sum(ep_rank_ == 0 && replica_ == 0 && tp_rank_ == 0,
                          ep_rank_ == 0 && replica_ == 0, replica_ == 0);
  return sq;
}

void MoeLayers::update(int t) {
  std::vector<float> rows;  // each MoE layer's most rows received this step
  for (const auto& l : layers_)
    if (l) {
      l->update(t);
      rows.push_back(float(l->rows()));
    }
  if (rows.empty()) return;
  // The most over the token group's ranks: one report gather for all the layers, not the
  // step's traffic.
  const std::vector<float> all = Layer::report_gather(*tokens_, rows);
  std::size_t i = 0;
  for (const auto& l : layers_)
    if (l) {
      float most = 0.0f;
      for (std::size_t q = i; q < all.size(); q += rows.size()) most = std::max(most, all[q]);
      l->add_rows_history(std::int64_t(most));
      ++i;
    }
}

void MoeLayers::snapshot(NamedValues& params, NamedValues& grads) {
  for (const auto& l : layers_)
    if (l) l->snapshot(params, grads);
}

nlohmann::json MoeLayers::summary() const {
  // tokens_per_expert[step][MoE layer][expert]: the assignments the router chose, before drops;
  // rows_received_max[step][MoE layer]: the most rows a rank received in one forward.
  nlohmann::json steps = nlohmann::json::array(), rows = nlohmann::json::array();
  for (std::size_t s = 0;; ++s) {
    nlohmann::json row = nlohmann::json::array(), received = nlohmann::json::array();
    bool any = false;
    for (const auto& l : layers_)
      if (l && s < l->history().size()) {
        row.push_back(l->history()[s]);
        received.push_back(l->rows_history()[s]);
        any = true;
      }
    if (!any) break;
    steps.push_back(std::move(row));
    rows.push_back(std::move(received));
  }
  nlohmann::json layers = nlohmann::json::array();
  for (std::size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i]) layers.push_back(held_[i]);
  return {{"moe",
           {{"layers", layers},
            {"experts", c_.moe.experts},
            {"ep", ep_size_},
            {"tokens_per_expert", steps},
            {"rows_received_max", rows}}}};
}

nlohmann::json MoeLayers::joined(const std::vector<nlohmann::json>& parts) const {
  // Each pipeline stage's MoE layers, in stage order (the model's order); a stage without one
  // has no steps.
  nlohmann::json layers = nlohmann::json::array();
  nlohmann::json joined = {{"tokens_per_expert", nlohmann::json::array()},
                           {"rows_received_max", nlohmann::json::array()}};
  for (const nlohmann::json& part : parts) {
    const nlohmann::json& moe = part.at("moe");
    for (const auto& l : moe.at("layers")) layers.push_back(l);
    for (auto& [key, steps] : joined.items()) {
      const nlohmann::json& rows = moe.at(key);
      for (std::size_t s = 0; s < rows.size(); ++s) {
        if (s == steps.size()) steps.push_back(nlohmann::json::array());
        for (const auto& row : rows[s]) steps[s].push_back(row);
      }
    }
  }
  return {{"moe",
           {{"layers", layers},
            {"experts", c_.moe.experts},
            {"ep", ep_size_},
            {"tokens_per_expert", joined.at("tokens_per_expert")},
            {"rows_received_max", joined.at("rows_received_max")}}}};
}

Tensor MoeLayers::first_counts() const {
  HostVector<float> v;
  I n = 0;
  for (const auto& l : layers_)
    if (l) {
      for (const std::int64_t x : l->counts()) v.push_back(float(x));
      ++n;
    }
  return host_tensor(v, {n, c_.moe.experts});
}

template <>
WithExperts<fsdp::FsdpTp>::WithExperts(const RunContext& ctx, const Mesh& mesh, int ep,
                                       std::vector<std::int64_t> held)
    : FsdpTp(ctx, mesh),
      moe_(std::make_unique<MoeLayers>(ctx, mesh, ep, std::move(held))),
      dp_cp_index_(mesh.dp_cp_index()) {}

template <>
WithExperts<cp::ContextParallel>::WithExperts(const RunContext& ctx, const Mesh& mesh, int ep,
                                              std::vector<std::int64_t> held)
    : ContextParallel(ctx, mesh, ctx.options.flags<cp::ContextParallelFlags>().method()),
      moe_(std::make_unique<MoeLayers>(ctx, mesh, ep, std::move(held))),
      dp_cp_index_(mesh.dp_cp_index()) {}

template <class Base>
WithExperts<Base>::~WithExperts() = default;

template <class Base>
std::string WithExperts<Base>::comm_name() const {
  return fmt::format("{}; experts: EP {} ({} of them per rank)", Base::comm_name(), moe_->ep_size(),
                     moe_->experts_per_rank());
}

template <class Base>
Sharding WithExperts<Base>::sharding() const {
  Sharding s = Base::sharding();
  s.dimensions.push_back(memory_dimension(moe_->ep_size(), dp_cp_index_));
  return s;
}

template <class Base>
std::vector<MeshGroup> WithExperts<Base>::mesh_groups() const {
  std::vector<MeshGroup> groups = Base::mesh_groups();
  groups.push_back({"ep", moe_->ep_group()});
  return groups;
}

template <class Base>
ExtraParameters* WithExperts<Base>::extra_parameters() {
  moe_->make_layers();  // the experts' weights, once the memory check has passed
  return moe_.get();
}

template <class Base>
CommStats WithExperts<Base>::take_comm_stats() {
  CommStats s = Base::take_comm_stats();
  s += moe_->take_stats();
  return s;
}

template <class Base>
std::vector<std::pair<std::string, Tensor>> WithExperts<Base>::dump_extra() {
  auto extra = Base::dump_extra();
  extra.emplace_back("tokens_per_expert", moe_->first_counts());
  return extra;
}

template class WithExperts<fsdp::FsdpTp>;
template class WithExperts<cp::ContextParallel>;

namespace {

/// Refuses, in one line naming the flag and the rule and the same on every rank, what this
/// stage cannot run on `mesh`; returns EP. Needs no communication.
int checked_ep(const RunContext& ctx, const Mesh& mesh) {
  const BlockConfig& c = ctx.options.config;
  const MoeFlags& f = ctx.options.flags<MoeFlags>();
  const int ep = f.ep == 0 ? mesh.dp_cp() : f.ep;
  auto refuse = [](std::string line) { throw ConfigError(std::move(line)); };
  if (c.device != Device::cpu && c.moe.chunks > 1)
    refuse(fmt::format(
        "--moe-chunks {} runs on --device cpu only for now: on cuda the dispatch of one chunk "
        "beside the experts of another needs the exchanges on a stream of their own "
        "(--moe-chunks 1)",
        c.moe.chunks));
  if (c.dtype != DType::f32) refuse("stage 10 trains in fp32 for now (--dtype fp32)");
  if (c.recompute != Recompute::none)
    refuse(
        "stage 10 keeps every layer's activations for now (--recompute none): the experts "
        "would route again when a layer is recomputed");
  if (!c.checkpoint.save_dir.empty() || !c.checkpoint.resume_dir.empty())
    refuse("stage 10 cannot --save or --resume yet: a checkpoint does not hold the experts");
  if (c.generate.tokens > 0)
    refuse("stage 10 cannot --generate yet: generation runs the dense model");
  if (ep > mesh.dp_cp() || mesh.dp_cp() % ep != 0)
    refuse(mesh.cp == 1
               ? fmt::format("--ep ({}) must divide the data-parallel ranks D ({}): the experts "
                             "borrow their ranks from the data-parallel ones, D / EP groups of EP",
                             ep, mesh.dp)
               : fmt::format("--ep ({}) must divide the D·C ranks ({} × {}): the experts borrow "
                             "their ranks from the data- and context-parallel ones",
                             ep, mesh.dp, mesh.cp));
  if (const std::int64_t tokens = c.seq / mesh.cp * (c.batch / mesh.dp); c.moe.chunks > tokens)
    refuse(fmt::format(
        "--moe-chunks ({}) must be at most the tokens a rank routes in a step, S/C · B/D = {}: "
        "each chunk is some of them",
        c.moe.chunks, tokens));
  if (auto problem = moe_ep_problem(c.moe.experts, ep)) refuse(*problem);
  if (c.moe.expert_ffn % mesh.tp != 0)
    refuse(
        fmt::format("the experts' width FE ({}, --expert-ffn or --ffn) must be divisible by "
                    "the TP group's T ({}): each TP rank holds FE/T of every expert",
                    c.moe.expert_ffn, mesh.tp));
  return ep;
}

}  // namespace

std::unique_ptr<Parallelism> make_expert_parallel(const RunContext& ctx) {
  if (ctx.options.flags<pp::PipelineFlags>().print_schedule)
    throw ConfigError(
        "stage 10 does not --print-schedule: 09_pipeline_parallel prints the same schedule (its "
        "memory estimate without the experts)");
  // Stage 07 with the experts on D × T, stage 08 with them on D × C × T.
  auto slice = [](const RunContext& c, const Mesh& mesh,
                  std::vector<std::int64_t> held) -> std::unique_ptr<Parallelism> {
    const int ep = checked_ep(c, mesh);
    if (mesh.cp == 1) return std::make_unique<ExpertParallel>(c, mesh, ep, std::move(held));
    cp::check_context_parallel(c, mesh);
    return std::make_unique<ExpertContextParallel>(c, mesh, ep, std::move(held));
  };
  const pp::PipelineSize size = pp::pipeline_size(ctx);
  if (size.pp > 1)  // P × D × C × T: stage 09's pipeline, the slice on each pipeline stage
    return pp::make_pipeline_with(ctx, [&](const RunContext& c, const Mesh& mesh,
                                           const auto& held) { return slice(c, mesh, held); });
  // D × T as stage 07 lays it out (refusing a D that does not divide B or the ranks), or D × C × T.
  Mesh mesh = size.cp == 1 ? fsdp::make_mesh(ctx) : Mesh::make(size.dp, size.cp);
  std::vector<std::int64_t> all(std::size_t(ctx.options.config.layers));
  std::iota(all.begin(), all.end(), 0);
  return slice(ctx, mesh, std::move(all));
}

TrainResult train_expert_parallel(const BlockConfig& c, Parallelism& par, bool snapshot,
                                  Trace& trace, const std::function<void(const StepRow&)>& on_row) {
  if (dynamic_cast<pp::PipelineParallel*>(&par))
    return pp::train_pipeline(c, par, snapshot, trace, on_row);
  return train(c, par, snapshot, trace, on_row);
}

namespace {

/// --dry-run under a pipeline: stage 09's plan of the rank (its layers and micro-batches), each
/// of its MoE layers' SwiGLU replaced by the experts, once per micro-batch (a routing group of
/// B/M sequences over the D replicas), their gradients reduced once per step.
StagePlan plan_pipeline_of_experts(const RunContext& ctx, const pp::PipelineSize& size) {
  const Mesh mesh = Mesh::make(size.dp, size.cp, size.pp);
  const int ep = checked_ep(ctx, mesh);
  return pipeline_plan_with_experts(
      pp::plan_pipeline_with(ctx, {memory_dimension(ep, mesh.dp_index)}), ctx.options.config, mesh,
      ep, size.microbatches);
}

}  // namespace

StagePlan plan_expert_parallel(const RunContext& ctx) {
  const pp::PipelineSize size = pp::pipeline_size(ctx);
  const BlockConfig& c = ctx.options.config;
  // Balanced routing must divide: a rank's tokens' assignments over the experts, and under
  // context parallelism with a capacity each of its sequence chunks' (balanced_kept_rows).
  const std::int64_t M = size.pp > 1 ? size.microbatches : 1;  // routing groups a step
  const std::int64_t n = c.seq / size.cp * (c.batch / M / size.dp);
  const std::int64_t run = size.cp > 1 ? c.seq / (2 * size.cp) : n;
  if ((n * c.moe.topk) % c.moe.experts != 0 ||
      (c.moe.capacity_factor > 0 && (run * c.moe.topk) % c.moe.experts != 0))
    throw ConfigError(fmt::format(
        "--dry-run counts the experts' bytes under balanced routing: {} = {} assignments must be "
        "divisible by --experts ({})",
        (n * c.moe.topk) % c.moe.experts != 0
            ? "a rank's S/C·B/D·K"
            : "a sequence chunk's S/(2C)·K (a capacity under --cp counts chunk by chunk)",
        ((n * c.moe.topk) % c.moe.experts != 0 ? n : run) * c.moe.topk, c.moe.experts));
  if (size.pp > 1) return plan_pipeline_of_experts(ctx, size);
  // The dense parameters' sharding and bytes: stage 07's, or stage 08's over D·C.
  StagePlan p = size.cp == 1 ? fsdp::plan_fsdp_tp(ctx) : cp::plan_context_parallel(ctx);
  const Mesh mesh = size.cp == 1 ? fsdp::make_mesh(ctx) : Mesh::make(size.dp, size.cp);
  const int ep = checked_ep(ctx, mesh);
  p.sharding.dimensions.push_back(memory_dimension(ep, mesh.dp_cp_index()));  // as sharding()
  const cp::CpMethod method = ctx.options.flags<cp::ContextParallelFlags>().method();
  const ExpertTraffic t =
      expert_traffic(c, mesh.dp, mesh.tp, ep, mesh.dp_cp_index(), mesh.cp, method);
  p.groups = {{.name = "dp", .label = mesh.cp > 1 ? "dp×cp group" : "dp group", .traffic = t.dp},
              {.name = "ep", .label = "ep group", .traffic = t.ep}};
  if (mesh.cp > 1) p.groups.push_back({.name = "cp", .label = "cp group", .traffic = t.cp});
  p.traffic = t.tp;
  for (const PlanGroup& g : p.groups) p.traffic += g.traffic;
  p.comm = mesh.cp > 1 ? fmt::format(
                             "mesh D {} × CP {} × TP {} (cp-method {}), experts over EP {} (dry "
                             "run: balanced routing)",
                             mesh.dp, mesh.cp, mesh.tp, cp::to_string(method), ep)
                       : fmt::format(
                             "mesh D {} × TP {}, experts over EP {} (dry run: balanced "
                             "routing)",
                             mesh.dp, mesh.tp, ep);
  return p;
}

}  // namespace tpx::ep
