#include "07_fsdp_tp/layers.h"

#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "04_overlap_ring/traffic.h"
#include "05_copy_engine_async_tp/layers.h"
#include "06_fp8/layers.h"
#include "06_fp8/traffic.h"
#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/memory.h"
#include "07_fsdp_tp/traffic.h"
#include "common/check.h"
#include "common/ops.h"
#include "common/tp.h"
#include "common/trace.h"

namespace tpx::fsdp {
namespace {

/// The options stage 05 runs with inside one TP group: its communicator spans the group.
StageOptions tp_options(const StageOptions& o, const Mesh& m) {
  StageOptions t = o;
  t.comm.group = m.tp_group;
  return t;
}

/// Rows [begin, end) of `t` seen as [rows, cols]: a view.
Tensor rows_of(const Tensor& t, std::int64_t cols, std::int64_t begin, std::int64_t end) {
  return t.reshape({t.numel() / cols, cols}).slice0(begin, end);
}

/// Elements [begin, end) of a flat tensor, seen as [n / cols, cols].
Tensor flat_rows(const Tensor& flat, std::int64_t begin, std::int64_t end, std::int64_t cols) {
  return flat.slice0(begin, end).reshape({(end - begin) / cols, cols});
}

/// Tensor i of LmParams::all() (the embedding, the final gain, the output layer), to assign.
Tensor& lm_tensor(LmParams& p, std::size_t i) {
  const std::array<Tensor*, kLmParams> all = {&p.embedding, &p.norm_f, &p.w_out};
  return *all[i];
}

}  // namespace

Tensor::Shape FlatLayout::Entry::shard_shape() const {
  Tensor::Shape s = shape;
  s[0] = shard_rows;
  return s;
}

FlatLayout flat_layout(std::span<const Tensor> tp_local, int d) {
  TPX_CHECK(d >= 1, "FSDP over {} ranks", d);
  FlatLayout f;
  for (const Tensor& t : tp_local) {
    FlatLayout::Entry& e = f.entries.emplace_back();
    e.shape = t.shape();
    e.rows = e.shape[0];
    e.cols = t.numel() / std::max<std::int64_t>(e.rows, 1);
    // An empty tensor (stage 10's MoE layer has no dense SwiGLU: [H, 0], [0, H]) has no rows to
    // shard: every rank's part of it is empty.
    e.shard_rows = t.numel() == 0 ? 0 : (e.rows + d - 1) / d;
    e.offset = f.numel;
    f.numel += e.shard_numel();
  }
  return f;
}

FsdpTp::FsdpTp(const RunContext& ctx, Mesh mesh)
    : tp_options_(tp_options(ctx.options, mesh)),
      mesh_(std::move(mesh)),
      tp_ctx_{tp_options_, mesh_.tp_index, mesh_.tp, ctx.trace},
      // Under --dtype fp8 stage 06's FP8 GEMMs, each layer's weights quantized again for its
      // backward (gathered again, into another buffer): Fp8Weights.
      tp_(is_fp8(ctx.options.config.dtype)
              ? async_fp8::make_fp8_async_tp(tp_ctx_,
                                             ctx.options.flags<Fp8GatherFlags>().fp8_weight_gather
                                                 ? async_fp8::Fp8Weights::gathered
                                                 : async_fp8::Fp8Weights::requantized)
              : async_tp::make_copy_engine_async_tp(tp_ctx_)),
      trace_(ctx.trace),
      device_(ctx.options.config.device),
      gather_lane_(Stream::create(device_)),
      reduce_lane_(Stream::create(device_)) {
  CommOptions o = ctx.options.comm;
  o.group = mesh_.dp_cp_group;
  dp_comm_ = make_communicator(o, device_);
  if (mesh_.cp > 1) {
    // The DP group's own (a CP ring inside it, stage 08): only report gathers, host memory.
    o.group = mesh_.dp_group;
    o.kind = CommKind::mpi;
    dp_report_comm_ = make_communicator(o, device_);
  }
  fp8_gather_ = ctx.options.flags<Fp8GatherFlags>().fp8_weight_gather;
  keep_ = ctx.options.flags<async_fp8::Fp8RecipeFlags>();
  if (fp8_gather_) {
    // The weight matrices' amaxes agreed over every rank holding a part of them: the job's.
    o = ctx.options.comm;
    amax_comm_ = make_communicator(o, device_);
  }
}

FsdpTp::~FsdpTp() = default;

Sharding FsdpTp::sharding() const {
  Sharding s = tp_->sharding();
  s.dp = mesh_.dp;
  s.dp_cp_index = mesh_.dp_cp_index();
  // FSDP's unsharded layers, gathered as E4M3 codes under --fp8-weight-gather (fp32 when
  // --fp8-keep-last keeps any layer out of the recipe: the largest unsharded layer is its).
  s.dimensions.push_back(
      memory_dimension(mesh_.dp_cp_index() == 0, fp8_gather_ && keep_.keep_last == 0));
  return s;
}

std::string FsdpTp::comm_name() const {
  return fmt::format("mesh D {} × TP {}; tp: {}; dp: {}", mesh_.dp, mesh_.tp, tp_->comm_name(),
                     dp_comm_->name());
}

// --- the model: this rank's shards ---------------------------------------------------------------

void FsdpTp::shard_model(Model& m) {
  const int d = mesh_.dp_cp();
  // The data: this replica's B / D columns of the batch dim of [S/T, B, H]. The parameters are
  // sharded over the DP×CP group (the DP group when there is no CP dimension).
  auto batch_part = [&](const Tensor& t) {
    const Tensor host = t.device() == Device::cpu ? t : ops::to_device(t, Device::cpu);
    const std::int64_t s = t.dim(0), b = t.dim(1) / mesh_.dp, h = t.dim(2);
    const Tensor part = Tensor::empty({s, b, h});
    for (std::int64_t i = 0; i < s; ++i)
      std::memcpy(part.f32().data() + i * b * h,
                  host.f32().data() + (i * t.dim(1) + mesh_.dp_index * b) * h,
                  static_cast<std::size_t>(b * h) * sizeof(float));
    return t.device() == Device::cpu ? part : ops::to_device(part, t.device());
  };
  if (m.input.defined() && mesh_.dp > 1) {  // one replica: the whole batch
    m.input = batch_part(m.input);
    m.target = batch_part(m.target);
  }

  // The parameters and gradients: one flat fp32 shard per layer each; the Model's tensors are
  // views into them, so a gradient reduce-scatter writes straight into what the optimizer reads.
  layout_.clear();
  grad_shards_.clear();
  for (std::size_t l = 0; l < m.params.size(); ++l) {
    layout_.push_back(flat_layout(m.params[l].t, d));
    grad_shards_.push_back(shard_unit(layout_.back(), m.params[l].t, m.grads[l].t));
  }
  // The language model's ends (those this rank holds: a pipeline stage may hold one), a unit
  // each, sharded the same way.
  lm_units_.clear();
  for (const auto& [name, members] :
       {std::pair<std::string, std::vector<std::size_t>>{"embedding", {0}}, {"head", {1, 2}}}) {
    if (!lm_tensor(m.lm, members.front()).defined()) continue;
    std::vector<Tensor> params, grads;
    for (const std::size_t i : members) {
      params.push_back(lm_tensor(m.lm, i));
      grads.push_back(lm_tensor(m.lm_grads, i));
    }
    LmUnit u{name, members, flat_layout(params, d), Tensor()};
    u.grad_shard = shard_unit(u.layout, params, grads);
    for (std::size_t k = 0; k < members.size(); ++k) {
      lm_tensor(m.lm, members[k]) = params[k];
      lm_tensor(m.lm_grads, members[k]) = grads[k];
    }
    lm_units_.push_back(std::move(u));
  }
}

Tensor FsdpTp::shard_unit(const FlatLayout& f, std::span<Tensor> tensors,
                          std::span<Tensor> grads) const {
  const int me = mesh_.dp_cp_index();
  const Tensor host_shard = Tensor::zeros({f.numel});
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const FlatLayout::Entry& e = f[i];
    const std::int64_t begin = std::min(e.rows, me * e.shard_rows);
    const std::int64_t end = std::min(e.rows, (me + 1) * e.shard_rows);
    if (end > begin)
      ops::copy(rows_of(ops::to_device(tensors[i], Device::cpu), e.cols, begin, end),
                flat_rows(host_shard, e.offset, e.offset + (end - begin) * e.cols, e.cols));
  }
  const Tensor params = ops::to_device(host_shard, device_);
  const Tensor flat_grads = Tensor::empty({f.numel}, DType::f32, device_);
  ops::fill(flat_grads, 0.0f);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const FlatLayout::Entry& e = f[i];
    tensors[i] = params.slice0(e.offset, e.offset + e.shard_numel()).reshape(e.shard_shape());
    grads[i] = flat_grads.slice0(e.offset, e.offset + e.shard_numel()).reshape(e.shard_shape());
  }
  return flat_grads;
}

// --- forward and backward: gather just in time, reduce-scatter as soon as complete --------------

namespace {

/// What one rank contributes to a layer's weight gather, as bytes: each parameter's shard in the
/// dtype the block computes with (bf16 compute copies of the matrices and fp32 norm gains under
/// --dtype bf16; all fp32 otherwise), one after the other, each at a multiple of its element size
/// (the views below need no more: the copy-out gives every parameter memory of its own).
struct ByteLayout {
  std::vector<std::int64_t> offset;  // bytes into one rank's part, per tensor
  std::int64_t bytes = 0;            // of one rank's part
};

ByteLayout byte_layout(const FlatLayout& f, std::span<const Tensor> stored) {
  ByteLayout b;
  for (std::size_t i = 0; i < stored.size(); ++i) {
    const auto size = static_cast<std::int64_t>(dtype_size(stored[i].dtype()));
    b.bytes = (b.bytes + size - 1) / size * size;
    b.offset.push_back(b.bytes);
    b.bytes += f[i].shard_numel() * size;
  }
  return b;
}

/// The bytes [at, at + n·size) of the byte tensor `buf` seen as a [n / cols, cols] tensor of
/// `dtype`: a view that keeps `buf` alive.
Tensor typed_view(const Tensor& buf, std::int64_t at, std::int64_t n, std::int64_t cols,
                  DType dtype) {
  TPX_CHECK(buf.dtype() == DType::u8 &&
                at + n * static_cast<std::int64_t>(dtype_size(dtype)) <= buf.numel(),
            "typed view of {} bytes at {} of {}", n * dtype_size(dtype), at, buf.describe());
  return Tensor::borrow(static_cast<std::byte*>(buf.raw()) + at, {n / cols, cols}, dtype,
                        buf.device(), std::make_shared<const Tensor>(buf));
}

}  // namespace

FsdpTp::Gather FsdpTp::issue_gather(const FlatLayout& f, std::span<const Tensor> stored,
                                    const std::string& what) {
  const ByteLayout b = byte_layout(f, stored);
  // Pack this rank's shards (the compute copies are per tensor) into one buffer of bytes.
  const Tensor send = Tensor::empty({b.bytes}, DType::u8, device_);
  for (std::size_t i = 0; i < stored.size(); ++i) {
    const FlatLayout::Entry& e = f[i];
    if (e.shard_numel() == 0) continue;
    ops::copy(stored[i].reshape({e.shard_rows, e.cols}),
              typed_view(send, b.offset[i], e.shard_numel(), e.cols, stored[i].dtype()));
  }
  Gather g{Tensor::empty({std::int64_t(mesh_.dp_cp()) * b.bytes}, DType::u8, device_),
           Event(device_),
           b.offset,
           b.bytes,
           {},
           {}};
  for (const Tensor& t : stored) g.dtypes.push_back(t.dtype());
  // Booked now, so that the flight recorder has it in the program's order on every rank.
  const std::uint64_t booked = dp_comm_->book(CommOp::all_gather, what);
  // And marked on the DP-comm lane as queued (reporting only, no duration): a prefetch shows as
  // a mark inside the previous layer's forward, however late the lane thread gets to it.
  if (trace_.recording()) {
    const auto now = Trace::Clock::now();
    trace_.record(what + " queued", Lane::dp_comm, now, now, /*counted=*/false);
  }
  // Behind the compute stream's mark: the shards have been packed into send.
  g.done =
      run_after_compute(gather_lane_, {send, g.full}, [this, send, full = g.full, what, booked] {
        TraceScope span(trace_, what, Lane::dp_comm);
        dp_comm_->all_gather(send, full, gather_lane_, booked);
      });
  return g;
}

void FsdpTp::issue_gather(const std::vector<LayerParams>& stored, std::size_t l) {
  const std::string what = fmt::format("layer {} weights all-gather", l);
  // A layer --fp8-keep-last keeps out of the recipe computes with its fp32 weights: they travel
  // as stored, with no amax agreed for them.
  if (!fp8_gather_ || !keep_.quantizes(std::int64_t(l), std::int64_t(layout_.size()))) {
    gathers_.insert_or_assign(l, issue_gather(layout_[l], stored[l].t, what));
    return;
  }
  const std::vector<Tensor> shards = fp8_shards(stored[l], l);
  Gather g = issue_gather(layout_[l], shards, what);
  for (const Tensor& s : shards) g.scales.push_back(s.scale());
  gathers_.insert_or_assign(l, std::move(g));
}

std::vector<Tensor> FsdpTp::fp8_shards(const LayerParams& stored, std::size_t l) {
  // Stage 06's tensorwise rule on the whole weight: scale = fmax / amax over every shard of every
  // TP rank, so the codes are the ones stage 06 would make from the unsharded weight.
  std::vector<Param> matrices;
  for (const Param p : kAllParams)
    if (param_split(p) != Split::replicated) matrices.push_back(p);
  const auto k = static_cast<std::int64_t>(matrices.size());
  const Tensor amax = Tensor::empty({k}, DType::f32, device_);
  for (std::int64_t i = 0; i < k; ++i)
    ops::amax(stored[matrices[std::size_t(i)]], amax.slice0(i, i + 1));
  {
    TraceScope span(trace_, fmt::format("layer {} weights amax", l), Lane::dp_comm);
    amax_comm_->all_reduce_max(amax, Stream(device_));
  }
  std::vector<Tensor> out(stored.t.begin(), stored.t.end());
  for (std::int64_t i = 0; i < k; ++i) {
    const Tensor& w = stored[matrices[std::size_t(i)]];
    const Tensor scale = Tensor::empty({1}, DType::f32, device_);
    ops::fp8_scale(amax.slice0(i, i + 1), DType::e4m3, scale);
    const Tensor q = Tensor::empty(w.shape(), DType::e4m3, device_);
    ops::quantize_fp8(w, scale, q);
    out[static_cast<std::size_t>(matrices[std::size_t(i)])] = q.with_scale(scale);
  }
  return out;
}

std::vector<Tensor> FsdpTp::copy_out(const Gather& g, const FlatLayout& f,
                                     std::span<const Tensor> stored) const {
  // Tensor i's rows from rank d sit at byte d·bytes + offset(i) of the gather.
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < stored.size(); ++i) {
    const FlatLayout::Entry& e = f[i];
    const DType dtype = g.dtypes[i];  // stored[i]'s, or E4M3 under --fp8-weight-gather
    const Tensor full = Tensor::empty(e.shape, dtype, device_);
    for (int d = 0; d < mesh_.dp_cp(); ++d) {
      const std::int64_t begin = std::min(e.rows, d * e.shard_rows);
      const std::int64_t end = std::min(e.rows, (d + 1) * e.shard_rows);
      if (end <= begin) continue;
      const Tensor part =
          typed_view(g.full, d * g.bytes + g.offset[i], e.shard_numel(), e.cols, dtype);
      ops::copy(part.slice0(0, end - begin), rows_of(full, e.cols, begin, end));
    }
    out.push_back(i < g.scales.size() && g.scales[i].defined() ? full.with_scale(g.scales[i])
                                                               : full);
  }
  return out;
}

LayerParams FsdpTp::layer_params(const std::vector<LayerParams>& stored, std::size_t l, int next) {
  // The TP group's layers learn which layer runs (stage 06 keeps its last --fp8-keep-last out of
  // the recipe); what they return is stored[l], the shards: this stage's gathered copy replaces it.
  (void)tp_->layer_params(stored, l, next);
  if (mesh_.dp_cp() == 1) return stored[l];  // nothing is sharded
  if (!gathers_.contains(l)) issue_gather(stored, l);
  // Prefetch: the next layer's gather is queued now, behind this one on the DP-comm lane, and
  // runs while this layer computes.
  if (next >= 0 && !gathers_.contains(std::size_t(next))) issue_gather(stored, std::size_t(next));
  const Gather& g = gathers_.at(l);
  const Stream compute(device_);
  g.done.wait(compute);
  TraceScope span(trace_, fmt::format("layer {} weights copy-out", l));
  const std::vector<Tensor> full = copy_out(g, layout_[l], stored[l].t);
  LayerParams w;
  std::ranges::copy(full, w.t.begin());
  return w;
}

void FsdpTp::release_layer(std::size_t l) {
  gathers_.erase(l);  // reshard: the unsharded copy is freed (its views die with the block's use)
}

LayerParams FsdpTp::layer_grads(std::size_t l, const LayerParams& stored) {
  if (mesh_.dp_cp() == 1) return stored;
  LayerParams g;
  for (Param p : kAllParams) g[p] = Tensor::empty(layout_[l][p].shape, DType::f32, device_);
  return g;
}

void FsdpTp::grads_done(std::size_t l, const LayerParams& full, const LayerParams& /*stored*/) {
  if (mesh_.dp_cp() == 1) return;
  issue_reduction(layout_[l], full.t, grad_shards_[l],
                  fmt::format("layer {} grads reduce-scatter", l));
}

void FsdpTp::issue_reduction(const FlatLayout& f, std::span<const Tensor> full, const Tensor& shard,
                             const std::string& what) {
  // Pack in the gather's layout, [D, numel] with rank d's rows of every tensor at
  // d·numel + offset, padding zero, so that the reduce-scatter leaves each rank its own shard.
  Reduction r{Tensor::empty({std::int64_t(mesh_.dp_cp()) * f.numel}, DType::f32, device_),
              Event(device_)};
  ops::fill(r.flat, 0.0f);
  for (std::size_t i = 0; i < full.size(); ++i) {
    const FlatLayout::Entry& e = f[i];
    for (int d = 0; d < mesh_.dp_cp(); ++d) {
      const std::int64_t begin = std::min(e.rows, d * e.shard_rows);
      const std::int64_t end = std::min(e.rows, (d + 1) * e.shard_rows);
      if (end <= begin) continue;
      const std::int64_t at = d * f.numel + e.offset;
      ops::copy(rows_of(full[i], e.cols, begin, end),
                flat_rows(r.flat, at, at + (end - begin) * e.cols, e.cols));
    }
  }
  const Stream compute(device_);
  // At most two reductions in flight (this one and the one before): older ones have landed
  // before their buffers are let go, so memory does not grow with the number of layers.
  while (reductions_.size() > 1) {
    reductions_.front().done.wait(compute);
    reductions_.erase(reductions_.begin());
  }
  const std::uint64_t booked = dp_comm_->book(CommOp::reduce_scatter, what);
  // Marked as queued too, as a gather is: when it was issued, whenever the lane runs it.
  if (trace_.recording()) {
    const auto now = Trace::Clock::now();
    trace_.record(what + " queued", Lane::dp_comm, now, now, /*counted=*/false);
  }
  // Behind the compute stream's mark: the gradients have been packed into r.flat.
  r.done =
      run_after_compute(reduce_lane_, {r.flat, shard}, [this, flat = r.flat, shard, what, booked] {
        TraceScope span(trace_, what, Lane::dp_comm);
        dp_comm_->reduce_scatter(flat, shard, reduce_lane_, booked);
      });
  reductions_.push_back(std::move(r));
}

TokenCut FsdpTp::token_cut(const BlockConfig& c) const {
  const std::int64_t part = c.batch / mesh_.dp;
  return {{{c.seq, 0}}, mesh_.dp_index * part, (mesh_.dp_index + 1) * part};
}

// --- the language model's ends: an FSDP unit each ---------------------------------------------

std::pair<const FsdpTp::LmUnit*, std::size_t> FsdpTp::lm_unit_of(std::size_t i) const {
  for (const LmUnit& u : lm_units_)
    for (std::size_t k = 0; k < u.members.size(); ++k)
      if (u.members[k] == i) return {&u, k};
  return {nullptr, 0};
}

namespace {

/// The units of `p` that it defines, each whole or not at all (a caller passes whole ends).
template <class Unit>
bool defines(const LmParams& p, const Unit& u) {
  const auto all = p.all();
  const bool first = all[u.members.front()]->defined();
  for (const std::size_t i : u.members)
    TPX_CHECK(all[i]->defined() == first, "the {} end passed in part", u.name);
  return first;
}

/// The tensors of unit `u` in `p`, in the unit's order.
template <class Unit>
std::vector<Tensor> unit_tensors(const LmParams& p, const Unit& u) {
  std::vector<Tensor> out;
  for (const std::size_t i : u.members) out.push_back(*p.all()[i]);
  return out;
}

}  // namespace

LmParams FsdpTp::lm_params(const LmParams& stored) {
  if (mesh_.dp_cp() == 1) return stored;  // nothing is sharded
  LmParams w = stored;
  for (const LmUnit& u : lm_units_) {
    if (!defines(stored, u)) continue;
    const std::vector<Tensor> shards = unit_tensors(stored, u);
    // Gathered when the end is about to run (the head's for its forward and backward at once),
    // and let go by the caller after it.
    const Gather g = issue_gather(u.layout, shards, u.name + " weights all-gather");
    g.done.wait(Stream(device_));
    TraceScope span(trace_, u.name + " weights copy-out");
    const std::vector<Tensor> full = copy_out(g, u.layout, shards);
    for (std::size_t k = 0; k < full.size(); ++k) lm_tensor(w, u.members[k]) = full[k];
  }
  return w;
}

LmParams FsdpTp::lm_grads(const LmParams& stored) {
  if (mesh_.dp_cp() == 1) return stored;
  LmParams g;
  for (const LmUnit& u : lm_units_)
    if (defines(stored, u))
      for (std::size_t k = 0; k < u.members.size(); ++k)
        lm_tensor(g, u.members[k]) = Tensor::empty(u.layout[k].shape, DType::f32, device_);
  return g;
}

void FsdpTp::reduce_lm_grads(const LmParams& full, const LmParams& /*stored*/) {
  if (mesh_.dp_cp() == 1) return;  // lm_grads() gave the stored gradients themselves
  for (const LmUnit& u : lm_units_)
    if (defines(full, u))
      issue_reduction(u.layout, unit_tensors(full, u), u.grad_shard,
                      u.name + " grads reduce-scatter");
}

void FsdpTp::finish_grads() {
  const Stream compute(device_);
  for (const Reduction& r : reductions_) r.done.wait(compute);
  reductions_.clear();
  gathers_.clear();  // a prefetch past the last layer (none is issued) would end here
}

// --- across the mesh -----------------------------------------------------------------------------

double FsdpTp::sum_over_ranks(double local) {
  // The TP group's sum, then the DP×CP group's, through the communicators: each a report gather
  // the flight recorder watches, added in rank order so that every rank gets the same sum.
  double all = 0.0;
  for (const double v : dp_comm_->all_gather_report(tp_->sum_over_ranks(local), "loss or norm sum"))
    all += v;
  return all;
}

void FsdpTp::dp_gather_for_report(Communicator& comm, const Tensor& src, const Tensor& dst) const {
  TPX_CHECK(src.device() == Device::cpu && dst.device() == Device::cpu &&
                dst.nbytes() == src.nbytes() * std::size_t(comm.size()),
            "dp gather {} into {}", src.describe(), dst.describe());
  comm.all_gather_report(std::span(static_cast<const std::byte*>(src.raw()), src.nbytes()),
                         std::span(static_cast<std::byte*>(dst.raw()), dst.nbytes()),
                         fmt::format("report gather {}", src.describe()));
}

Tensor FsdpTp::gather_activation(const Tensor& local) {
  const Tensor seq = ops::to_device(tp_->gather_activation(local), Device::cpu);  // [S, B/D, H]
  if (mesh_.dp == 1) return seq;
  const std::int64_t s = seq.dim(0), b = seq.dim(1), h = seq.dim(2);
  const auto e = static_cast<std::int64_t>(dtype_size(seq.dtype()));
  const Tensor all = Tensor::empty({mesh_.dp * s, b, h}, seq.dtype());
  dp_gather_for_report(dp_comm_for_report(), seq, all);
  // Replica d's [S, B/D, H] goes to batch columns [d·B/D, (d+1)·B/D) of [S, B, H].
  const Tensor full = Tensor::empty({s, b * mesh_.dp, h}, seq.dtype());
  for (int d = 0; d < mesh_.dp; ++d)
    for (std::int64_t i = 0; i < s; ++i)
      std::memcpy(static_cast<std::byte*>(full.raw()) + ((i * mesh_.dp + d) * b * h) * e,
                  static_cast<const std::byte*>(all.raw()) + ((d * s + i) * b * h) * e,
                  static_cast<std::size_t>(b * h * e));
  return full;
}

Tensor FsdpTp::unshard_for_report(const Tensor& local, std::int64_t rows) const {
  const Tensor host = ops::to_device(local, Device::cpu);
  Tensor::Shape shape = local.shape();
  shape[0] *= mesh_.dp_cp();
  const Tensor all = Tensor::empty(shape, local.dtype());
  dp_gather_for_report(*dp_comm_, host, all);
  return ops::to_device(all.slice0(0, rows), device_);  // the padding rows dropped
}

Tensor FsdpTp::gather_param(Param p, const Tensor& local) {
  if (mesh_.dp_cp() == 1) return tp_->gather_param(p, local);
  // An empty tensor (a MoE layer's dense SwiGLU, stage 10) is empty on every rank.
  if (local.numel() == 0) return local;
  // The DP shards back into the TP-local tensor, then stage 05's TP gather. Every layer that
  // holds p has the same layout.
  const auto holds =
      std::ranges::find_if(layout_, [&](const FlatLayout& f) { return f[p].shard_numel() > 0; });
  TPX_CHECK(holds != layout_.end(), "no layer holds {}", param_name(p));
  return tp_->gather_param(p, unshard_for_report(local, (*holds)[p].rows));
}

Tensor FsdpTp::gather_vocab(Split split, const Tensor& local) {
  if (mesh_.dp_cp() == 1) return tp_->gather_vocab(split, local);
  // The ends' tensor that `split` names (kLmSplits: the embedding's rows, the final gain, the
  // output layer's columns), from its DP shards, then stage 05's TP gather.
  const auto i = std::size_t(std::ranges::find(kLmSplits, split) - kLmSplits.begin());
  const auto [unit, k] = lm_unit_of(i);
  TPX_CHECK(unit != nullptr, "this rank holds no {}", kLmParamNames[i]);
  return tp_->gather_vocab(split, unshard_for_report(local, unit->layout[k].rows));
}

Communicator& FsdpTp::dp_comm_for_report() {
  return dp_report_comm_ ? *dp_report_comm_ : *dp_comm_;  // D×C = D when C = 1
}

CommStats FsdpTp::take_comm_stats() {
  CommStats s = tp_->take_comm_stats();
  s.add_group("dp", dp_comm_->take_stats());
  if (amax_comm_) s.add_group("dp", amax_comm_->take_stats());  // FSDP's FP8 weight gathers'
  return s;
}

void FsdpTp::synchronize() {
  tp_->synchronize();
  gather_lane_.synchronize();
  reduce_lane_.synchronize();
}

Mesh make_mesh(const RunContext& ctx) {
  const BlockConfig& c = ctx.options.config;
  const int dp = default_dp(ctx.options.flags<DataParallelFlags>().dp, ctx.world);
  if (dp < 1)
    throw ConfigError(
        fmt::format("--dp must be a positive number of data-parallel replicas (got {})", dp));
  Mesh mesh = Mesh::make(dp);  // refuses a D that does not divide the ranks
  if (c.batch % dp != 0)
    throw ConfigError(fmt::format(
        "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", dp,
        c.batch));
  check_tp_split(c, mesh.tp, /*sequence=*/true);
  return mesh;
}

std::unique_ptr<Parallelism> make_fsdp_tp(const RunContext& ctx) {
  return std::make_unique<FsdpTp>(ctx, make_mesh(ctx));
}

StagePlan plan_fsdp_tp(const RunContext& ctx) {
  const Mesh mesh = make_mesh(ctx);
  BlockConfig replica = ctx.options.config;  // stage 05 inside the TP group, on B / D
  replica.batch /= mesh.dp;
  StagePlan p;
  p.sharding = {.rank = mesh.tp_index,
                .world = mesh.tp,
                .weights = true,
                .sequence = true,
                .dp = mesh.dp,
                .dp_cp_index = mesh.dp_cp_index(),
                .dimensions = {}};
  const bool fp8_gather = ctx.options.flags<Fp8GatherFlags>().fp8_weight_gather;
  const std::int64_t keep_last = ctx.options.flags<async_fp8::Fp8RecipeFlags>().keep_last;
  // Stage 05's, inside the TP group; stage 06's under --dtype fp8, the weights requantized for
  // backward (make_fp8_async_tp refuses a recipe's block that a TP shard would cut; so does this).
  Traffic tp;
  if (is_fp8(replica.dtype)) {
    const lowp::Recipe r = ctx.options.flags<async_fp8::Fp8RecipeFlags>().recipe();
    async_fp8::check_recipe_split(replica, mesh.tp, r);
    // The TP group's dimension of the estimate first, then FSDP's: as sharding().
    if (auto d = async_fp8::recipe_memory_dimension(r))
      p.sharding.dimensions.push_back(std::move(d));
    tp = async_fp8::recipe_traffic(
        replica, mesh.tp, 0, r,
        fp8_gather ? async_fp8::Fp8Weights::gathered : async_fp8::Fp8Weights::requantized,
        keep_last);
  } else {
    tp = ring::traffic(replica, mesh.tp);
  }
  p.sharding.dimensions.push_back(
      memory_dimension(mesh.dp_cp_index() == 0, fp8_gather && keep_last == 0));  // as sharding()
  Traffic dp = fsdp_traffic(ctx.options.config, mesh.tp, mesh.dp, 1, fp8_gather, keep_last);
  dp += lm_grads_traffic(ctx.options.config, mesh.tp, mesh.dp, true, true);  // the ends (FSDP)
  p.groups = {{.name = "dp", .label = "dp group", .traffic = dp}};
  p.traffic = {tp.payload + dp.payload, tp.bus + dp.bus, tp.calls + dp.calls};
  p.comm = fmt::format("mesh D {} × TP {} (dry run)", mesh.dp, mesh.tp);
  return p;
}

}  // namespace tpx::fsdp
